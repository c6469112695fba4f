"""Shape checks before the first step: every GEMM operand the recipe quantizes must have the
dims its format can block, and every FSDP2 shard must hold whole dim-0 blocks of what it gathers.

The checks themselves are the library's (``dtq.shapes``); this turns them into one message that
names the config keys to change, instead of a traceback from inside a rank.
"""

from __future__ import annotations

from collections.abc import Mapping

import dtq
from dtq.shapes import ShapeProblem, shape_problems

# GEMM operand -> which config keys set its [M, K] view (for the message).
_WHY = {
    "input": "its [M, K] = [tokens per rank = train.batch_size * model.seq_len, in features]",
    "weight": "its [N, K] = [out features, in features], set by model.hidden and model.ffn_hidden",
    "grad_output": "its [M, N] = [tokens per rank = train.batch_size * model.seq_len, out features]",
}
_TP = " (this rank's parallel.tp shard)"


def _explain(p: ShapeProblem, fsdp_world: int, tp: int) -> str:
    """The library's problem in the trainer's terms: which config keys to change."""
    shape = list(p.shape)
    if p.layout == "tp":
        return f"{p.name} weight {shape}: parallel.tp = {tp} {p.reason}"
    if p.layout == "fsdp":
        return (
            f"{p.name} weight {shape}: {p.reason}; make this dim / {fsdp_world} a multiple of {p.multiple} "
            "(model.hidden, model.ffn_hidden), or use fewer ranks"
        )
    return f"{p.name} {p.operand} ({_WHY[p.operand]}{_TP if p.tp_shard else ''}): {p.reason}"


def check_shapes(
    model,
    recipe: dtq.Recipe | None,
    tokens_per_rank: int,
    fsdp_world: int,
    tp: int = 1,
    tp_dims: dict[int, Mapping[str, int]] | None = None,
) -> None:
    """Raise ValueError naming the module, the operand and the config keys when ``recipe`` cannot
    quantize one of ``model``'s GEMM operands, or FSDP2 over ``fsdp_world`` ranks would split a
    block of a gathered weight. With ``tp > 1``, ``tp_dims`` (``parallel.tp_weight_dims``) says
    which weights tensor parallelism splits along which dim: those are checked at the shard
    shapes a rank's GEMMs see (sequence-parallel inputs are gathered to whole tokens first)."""
    if recipe is None:
        return
    problems = [
        _explain(p, fsdp_world, tp)
        for p in shape_problems(model, recipe, tokens=tokens_per_rank, fsdp_world=fsdp_world, tp=tp, tp_dims=tp_dims)
    ]
    if problems:
        shown = "\n  ".join(problems[:8]) + (f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ValueError(f"config: the recipe cannot quantize these GEMM operands:\n  {shown}")
