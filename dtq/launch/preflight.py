"""Shape checks before the first step: every GEMM operand the recipe quantizes must have the
dims its format can block, and every FSDP2 shard must hold whole dim-0 blocks of what it gathers.

dtq raises the same errors at the first forward; checking up front turns them into one message
that names the config keys to change, instead of a traceback from inside a rank.
"""

from __future__ import annotations

from collections.abc import Mapping

import dtq
from dtq.formats import codec_for
from dtq.nn import QuantizedModule

# GEMM operand -> which config keys set its [M, K] view (for the message).
_WHY = {
    "input": "its [M, K] = [tokens per rank = train.batch_size * model.seq_len, in features]",
    "weight": "its [N, K] = [out features, in features], set by model.hidden and model.ffn_hidden",
    "grad_output": "its [M, N] = [tokens per rank = train.batch_size * model.seq_len, out features]",
}
_TP = " (this rank's parallel.tp shard)"


def _directions(recipe: dtq.Recipe, tensor_type: str) -> tuple[str, ...]:
    """The directions a slot is quantized in: rowwise for fprop/dgrad operands, columnwise for
    backward operands unless a backward override builds none."""
    if recipe.backward_override is not None:
        return ("rowwise",) if tensor_type != "grad_output" else ()
    return ("rowwise", "columnwise")


def _split_operand(weight_dim: int | None, tensor_type: str) -> bool:
    """Whether tensor parallelism splits this operand: the weight whenever it splits the weight,
    the input with the weight's K (dim 1), the output gradient with its N (dim 0)."""
    return weight_dim is not None and {"weight": True, "input": weight_dim == 1,
                                       "grad_output": weight_dim == 0}[tensor_type]


def check_shapes(model, recipe: dtq.Recipe | None, tokens_per_rank: int, fsdp_world: int, tp: int = 1,
                 tp_dims: dict[int, Mapping[str, int]] | None = None) -> None:
    """Raise ValueError naming the module, the operand and the config keys when ``recipe`` cannot
    quantize one of ``model``'s GEMM operands, or FSDP2 over ``fsdp_world`` ranks would split a
    block of a gathered weight. With ``tp > 1``, ``tp_dims`` (``parallel.tp_weight_dims``) says
    which weights tensor parallelism splits along which dim: those are checked at the shard
    shapes a rank's GEMMs see (sequence-parallel inputs are gathered to whole tokens first)."""
    if recipe is None:
        return
    problems = []
    for module in model.modules():
        if not isinstance(module, QuantizedModule):
            continue
        roles = [r for r in module.quantizer_roles() if r is not None]
        split = (tp_dims or {}).get(id(module), {}) if tp > 1 else {}
        for g, wname in enumerate(module.weight_names()):
            shape = list(getattr(module, wname).shape)
            if wname in split:
                dim = split[wname]
                if shape[dim] % tp:
                    problems.append(f"{module.name or type(module).__name__}.{wname} {shape}: parallel.tp = {tp} "
                                    f"does not divide its dim {dim} ({shape[dim]}), which tensor parallelism splits")
                    continue
                shape[dim] //= tp
            n, k = shape
            shapes = {"input": (tokens_per_rank, k), "weight": (n, k), "grad_output": (tokens_per_rank, n)}
            for role in roles[3 * g:3 * g + 3]:
                q = recipe.quantizer(role)
                if q is None:
                    continue
                for d in _directions(recipe, role.tensor_type):
                    sub = q.for_direction(d)
                    try:
                        codec_for(sub).check_shape(sub, shapes[role.tensor_type], d)
                    except ValueError as e:
                        problems.append(f"{role.name} {role.tensor_type} ({_WHY[role.tensor_type]}"
                                        f"{_TP if _split_operand(split.get(wname), role.tensor_type) else ''}): {e}")
                    if role.tensor_type == "weight" and fsdp_world > 1:
                        rows = -(-n // fsdp_world)
                        need = q.block_rows(d)
                        if rows % need:
                            problems.append(
                                f"{role.name} weight {[n, k]}: FSDP2 over {fsdp_world} ranks gives shards of {rows} "
                                f"rows, but {sub.format_name} {d} blocks span {need} rows; make this dim / "
                                f"{fsdp_world} a multiple of {need} (model.hidden, model.ffn_hidden), or use fewer ranks")
    if problems:
        shown = "\n  ".join(problems[:8]) + (f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ValueError(f"config: the recipe cannot quantize these GEMM operands:\n  {shown}")
