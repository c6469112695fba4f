# Sourced by the device scripts: $OUT exists, this checkout is importable, and wheels carried in
# .whl/ (torchao for the peer rows, pydantic & co. for the trainer's `train` extra) are installed
# into /tmp/site ahead of it on PYTHONPATH.
OUT=${OUT:-/tmp/dtq_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
# A kernel library carried in .kcache/ (an earlier call's $OUT/dtq_kernels.so.xz and csrc.sum,
# built from the same csrc/) is imported instead of built (DTQ_KERNEL_LIBRARY): a build costs 2-3
# minutes of every fresh lease. keep_kernels, after a build, puts the library (stripped and
# compressed: the device tool returns files of at most 16 MiB) and the sum into $OUT.
_csrc_sum=$(find csrc -maxdepth 1 -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.h' \) \
  | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16)
if [[ -f .kcache/dtq_kernels.so.xz && ! -f .kcache/dtq_kernels.so ]]; then
  xz -dk .kcache/dtq_kernels.so.xz
fi
if [[ -f .kcache/dtq_kernels.so && "$(cat .kcache/csrc.sum 2>/dev/null)" == "$_csrc_sum" ]]; then
  export DTQ_KERNEL_LIBRARY=$PWD/.kcache/dtq_kernels.so
  echo "kernels: the carried .kcache/dtq_kernels.so (csrc sum $_csrc_sum)"
elif [[ -f .kcache/dtq_kernels.so ]]; then
  echo "kernels: .kcache/ was built from other sources; building"
fi
keep_kernels() {
  [[ -n "${DTQ_KERNEL_LIBRARY:-}" ]] && return 0
  local so
  so=$(ls "$(python3 -c 'from dtq import kernels; print(kernels.build_dir())')"/dtq_kernels*.so 2>/dev/null | head -1)
  [[ -n "$so" ]] || return 0
  strip --strip-unneeded -o "$OUT/dtq_kernels.so" "$so" && xz -T0 -f "$OUT/dtq_kernels.so" && echo "$_csrc_sum" > "$OUT/csrc.sum"
  ls -la "$OUT"/dtq_kernels.so*
}
