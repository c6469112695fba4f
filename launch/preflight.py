"""Shape checks before the first step: every GEMM operand the recipe quantizes must have the
dims its format can block, and every FSDP2 shard must hold whole dim-0 blocks of what it gathers.

dtq raises the same errors at the first forward; checking up front turns them into one message
that names the config keys to change, instead of a traceback from inside a rank.
"""

from __future__ import annotations

import dtq
from dtq.formats import codec_for
from dtq.nn import QuantizedModule

# GEMM operand -> which config keys set its [M, K] view (for the message).
_WHY = {
    "input": "its [M, K] = [tokens per rank = train.batch_size * model.seq_len, in features]",
    "weight": "its [N, K] = [out features, in features], set by model.hidden and model.ffn_hidden",
    "grad_output": "its [M, N] = [tokens per rank = train.batch_size * model.seq_len, out features]",
}


def _directions(recipe: dtq.Recipe, tensor_type: str) -> tuple[str, ...]:
    """The directions a slot is quantized in: rowwise for fprop/dgrad operands, columnwise for
    backward operands unless a backward override builds none."""
    if recipe.backward_override is not None:
        return ("rowwise",) if tensor_type != "grad_output" else ()
    return ("rowwise", "columnwise")


def check_shapes(model, recipe: dtq.Recipe | None, tokens_per_rank: int, fsdp_world: int) -> None:
    """Raise ValueError naming the module, the operand and the config keys when ``recipe`` cannot
    quantize one of ``model``'s GEMM operands, or FSDP2 over ``fsdp_world`` ranks would split a
    block of a gathered weight."""
    if recipe is None:
        return
    problems = []
    for module in model.modules():
        if not isinstance(module, QuantizedModule):
            continue
        roles = [r for r in module.quantizer_roles() if r is not None]
        for g, wname in enumerate(module.weight_names()):
            n, k = getattr(module, wname).shape
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
                        problems.append(f"{role.name} {role.tensor_type} ({_WHY[role.tensor_type]}): {e}")
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
