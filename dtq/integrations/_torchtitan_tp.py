"""torchtitan's tensor-parallel sharding config of one Linear, read as a dtq tensor-parallel style.

torchtitan 0.3 ("partial_dtensor") declares a Linear's TP in its ``ShardingConfig``: the weight's
and bias's placements, the input's source / destination placements (keyed by the forward's
argument, ``"input"`` for ``nn.Linear``) and the output's. Its ``colwise_config`` and
``rowwise_config`` (``torchtitan.models.common.decoder_sharding``) are the two shapes a dense
Linear takes, and they are what dtq's own styles do:

* colwise: weight (and bias) ``Shard(0)``; input replicated, or declared arriving as the sequence
  shard ``Shard(d)`` with a replicated destination (dtq then gathers it quantized:
  ``sequence_parallel=True, sequence_dim=d``); output sharded on its feature (last) dim.
* rowwise: weight ``Shard(1)``, bias replicated; input sharded on its feature dim; output partial
  (dtq sums it inside the GEMM) with a destination of replicated (all-reduce) or the sequence
  shard ``Shard(d)`` (reduce-scatter, the gradient gathered quantized).

Only the TP mesh axis matters under "partial_dtensor" (data and context parallel axes stay out of
band, as in torchtitan's own ``resolve_mesh``); anything else is refused, naming the layer. At run
time the style takes the input in the layout it maps to (a plain tensor as this rank's local
piece of it); a DTensor arriving otherwise is redistributed, counted and warned about as a
high-precision fall-back, as torchtitan would redistribute it to the declared destination.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard

from dtq.parallel.styles import ColwiseParallel, RowwiseParallel

_INPUT_NAMES = ("input", "x")  # nn.Linear's forward argument (torchtitan's configs), dtq.nn.Linear's
_WORKS = (
    "dtq maps torchtitan's colwise_config (weight and bias Shard(0); input replicated, or the sequence shard "
    "with a replicated destination; output Shard(-1)) and rowwise_config (weight Shard(1), bias replicated; "
    "input Shard(-1); output Partial, to Replicate or to the sequence shard); keep the layer out with "
    "DtqConverter.Config(filter_fqns=[...])"
)


def _tp_placement(layout: Any, fqn: str, what: str) -> Any:
    """The DTensor placement an ``SpmdLayout`` gives the TP mesh axis (None: no layout, or one
    without a TP axis, which torchtitan leaves alone)."""
    if layout is None:
        return None
    import spmd_types as spmd
    from torchtitan.distributed.parallel_dims import MeshAxisName

    types = layout.per_axis_spmd_types()
    if MeshAxisName.EP in types:
        raise _refused(fqn, f"{what} is placed on the expert-parallel axis")
    tp = types.get(MeshAxisName.TP)
    return None if tp is None else spmd.spmd_type_to_dtensor_placement(tp)


def _refused(fqn: str, why: str) -> NotImplementedError:
    return NotImplementedError(
        f"dtq.integrations.torchtitan: {fqn} has a tensor-parallel sharding config that dtq's styles cannot run: "
        f"{why}; {_WORKS}"
    )


def _input(config: Any, fqn: str) -> tuple[Any, Any]:
    """The (source, destination) TP placements declared for the layer's input."""
    src_by_name, dst_by_name = config.in_src_shardings or {}, config.in_dst_shardings or {}
    names = set(src_by_name) | set(dst_by_name)
    if len(names) > 1 or not names <= set(_INPUT_NAMES):
        raise _refused(fqn, f"its input shardings name {sorted(names)}; a Linear's forward takes one tensor, 'input'")
    name = next(iter(names), None)
    what = f"the input ({name!r})"
    return _tp_placement(src_by_name.get(name), fqn, what), _tp_placement(dst_by_name.get(name), fqn, what)


def _is_shard(placement: Any, dim: int | None = None) -> bool:
    return isinstance(placement, Shard) and (dim is None or placement.dim == dim)


def _colwise(fqn: str, declared: str, bias: Any, has_bias: bool, src: Any, dst: Any, outs: tuple) -> ColwiseParallel:
    if has_bias and not _is_shard(bias, 0):
        raise _refused(fqn, f"a column-parallel weight needs its bias Shard(0), not {bias} ({declared})")
    sequence = _is_shard(src) and not _is_shard(src, -1)  # gathered (quantized) into the GEMM's whole input
    replicated = (
        isinstance(dst, Replicate) if sequence else all(p is None or isinstance(p, Replicate) for p in (src, dst))
    )
    if not replicated:
        raise _refused(
            fqn,
            "a column-parallel GEMM takes its whole input: replicated, or the sequence shard with a replicated "
            f"destination ({declared})",
        )
    out_src, out_dst = outs
    if not all(p is None or _is_shard(p) for p in outs) or None not in outs and out_src != out_dst:
        raise _refused(fqn, f"a column-parallel output stays sharded on its feature dim ({declared})")
    return ColwiseParallel(sequence_parallel=sequence, sequence_dim=src.dim if sequence else 0, use_local_output=False)


def _rowwise(fqn: str, declared: str, bias: Any, has_bias: bool, src: Any, dst: Any, outs: tuple) -> RowwiseParallel:
    if has_bias and not (bias is None or isinstance(bias, Replicate)):
        raise _refused(fqn, f"a row-parallel weight needs its bias replicated, not {bias} ({declared})")
    if not all(p is None or _is_shard(p) for p in (src, dst)):
        raise _refused(fqn, f"a row-parallel GEMM takes its input sharded on the feature dim ({declared})")
    out_src, out_dst = outs
    if not (out_src is None or isinstance(out_src, Partial)) or not isinstance(out_dst, (Replicate, Shard)):
        raise _refused(
            fqn,
            "dtq's row-parallel GEMM sums the partial outputs itself: declare the output's destination "
            f"Replicate (all-reduce) or the sequence shard (reduce-scatter) ({declared})",
        )
    sequence = _is_shard(out_dst)
    if _is_shard(out_dst, -1):
        raise _refused(fqn, f"its output would be sharded on the feature dim ({declared})")
    return RowwiseParallel(
        sequence_parallel=sequence, sequence_dim=out_dst.dim if sequence else 0, use_local_output=False
    )


def tp_style(config: Any, fqn: str, has_bias: bool) -> ColwiseParallel | RowwiseParallel:
    """The dtq style that runs what ``config`` (a torchtitan ``ShardingConfig``) declares for the
    Linear ``fqn``, with ``use_local_output=False`` (torchtitan's activations stay DTensors);
    ``NotImplementedError`` naming the layer for anything else."""
    if config.local_map is not None:
        raise _refused(fqn, "it runs under local_map (a local-tensor region of the layer's own)")
    if isinstance(config.out_src_shardings, tuple):
        raise _refused(fqn, "it declares several outputs")
    weight = _tp_placement(config.state_shardings.get("weight"), fqn, "the weight")
    bias = _tp_placement(config.state_shardings.get("bias"), fqn, "the bias")
    src, dst = _input(config, fqn)
    outs = (
        _tp_placement(config.out_src_shardings, fqn, "the output"),
        _tp_placement(config.out_dst_shardings, fqn, "the output"),
    )
    declared = f"weight {weight}, input {src} -> {dst}, output {outs[0]} -> {outs[1]}"
    if _is_shard(weight, 0):
        return _colwise(fqn, declared, bias, has_bias, src, dst, outs)
    if _is_shard(weight, 1) or _is_shard(weight, -1):
        return _rowwise(fqn, declared, bias, has_bias, src, dst, outs)
    raise _refused(
        fqn, f"its weight is placed {weight} on the TP axis, neither Shard(0) (colwise) nor Shard(1) (rowwise)"
    )


__all__ = ["tp_style"]
