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
