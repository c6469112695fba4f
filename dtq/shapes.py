"""Which GEMM shapes a recipe can quantize, checked before anything runs.

dtq raises the same errors at the first forward or FSDP2 gather, one layer at a time and from
inside a rank. ``dtq.convert(model, recipe=...)`` runs these checks on every Linear it would swap
(and skips, or with ``strict=True`` refuses, those a recipe cannot hold); a trainer runs
:func:`shape_problems` on the converted model with its token count and parallel layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from dtq.formats import DIRECTIONS, ROWWISE
from dtq.recipe import QuantizerRole, Recipe

OPERANDS = ("input", "weight", "grad_output")


@dataclasses.dataclass(frozen=True)
class ShapeProblem:
    """One GEMM operand a recipe cannot quantize at its (shard) shape.

    ``shape``: the operand's 2-D view as checked: input ``[M, K]``, weight ``[N, K]``,
    grad_output ``[M, N]`` (M is None when the token count was not given). ``layout``: "format"
    (the format's blocks), "fsdp" (an FSDP2 shard would split a block: ``multiple`` is the row
    multiple a shard needs) or "tp" (tensor parallelism does not divide ``dim`` of the weight)."""

    name: str
    operand: str
    shape: tuple[int | None, int]
    reason: str
    layout: str = "format"
    tp_shard: bool = False
    multiple: int = 1
    dim: int | None = None

    @property
    def detail(self) -> str:
        """The problem without the GEMM's name."""
        shape = "[" + ", ".join("tokens" if s is None else str(s) for s in self.shape) + "]"
        where = " (this rank's tensor-parallel shard)" if self.tp_shard else ""
        return f"{self.operand} {shape}{where}: {self.reason}"

    def __str__(self) -> str:
        return f"{self.name} {self.detail}"


def operand_directions(recipe: Recipe, operand: str) -> tuple[str, ...]:
    """The directions a GEMM quantizes an operand in: rowwise for forward/dgrad, columnwise for
    wgrad/dgrad operands unless a backward override builds none (then grad_output is not
    quantized at all)."""
    if recipe.backward_override is not None:
        return (ROWWISE,) if operand != "grad_output" else ()
    return DIRECTIONS


def gemm_problems(
    recipe: Recipe,
    roles: Sequence[QuantizerRole],
    weight_shape: Sequence[int],
    *,
    tokens: int | None = None,
    fsdp_world: int = 1,
    tp: int = 1,
    split_dim: int | None = None,
    name: str | None = None,
) -> list[ShapeProblem]:
    """Problems of one GEMM whose (input, weight, grad_output) slots have ``roles`` and whose whole
    weight is ``[N, K] = weight_shape``. ``tokens``: rows of the input per rank (None: not checked;
    the row constraints are assumed met). ``fsdp_world``: ranks FSDP2 shards the weight's rows
    over. ``split_dim``: the weight dim tensor parallelism splits over ``tp`` ranks. ``name``: how
    messages name the GEMM (default: its weight role's name, the module's fully qualified name)."""
    n, k = (int(s) for s in weight_shape)
    name = roles[1].name if name is None else name
    if split_dim is not None and tp > 1:
        size = (n, k)[split_dim]
        if size % tp:
            return [
                ShapeProblem(
                    name,
                    "weight",
                    (n, k),
                    f"does not divide its dim {split_dim} ({size}), which tensor parallelism splits over {tp} ranks",
                    layout="tp",
                    multiple=tp,
                    dim=split_dim,
                )
            ]
        n, k = (n // tp, k) if split_dim == 0 else (n, k // tp)
    problems = []
    for role in roles:
        q = recipe.quantizer(role)
        op = role.tensor_type
        dirs = operand_directions(recipe, op)
        if q is None or not dirs:
            continue
        # an unknown token count is taken as one every row block of the format divides
        m = tokens if tokens is not None else math.lcm(*(q.block_rows(d) for d in dirs))
        shape = {"input": (m, k), "weight": (n, k), "grad_output": (m, n)}[op]
        shown = shape if tokens is not None or op == "weight" else (None, shape[1])
        split = split_dim is not None and tp > 1 and (op == "weight" or split_dim == (1 if op == "input" else 0))
        for d in dirs:
            sub = q.for_direction(d)
            try:
                q.codec(d).check_shape(shape)
            except ValueError as e:
                reason = str(e) if tokens is not None else getattr(e, "requirement", str(e))
                problems.append(ShapeProblem(name, op, shown, reason, tp_shard=split))
            if op == "weight" and fsdp_world > 1:
                rows, need = -(-n // fsdp_world), q.block_rows(d)
                if rows % need:
                    problems.append(
                        ShapeProblem(
                            name,
                            op,
                            (n, k),
                            f"FSDP2 over {fsdp_world} ranks gives shards of {rows} rows, but "
                            f"{sub.format_name} {d} blocks span {need} rows",
                            layout="fsdp",
                            tp_shard=split,
                            multiple=need,
                        )
                    )
    return problems


def linear_problem(
    recipe: Recipe, name: str, out_features: int, in_features: int, *, fsdp_world: int = 1
) -> str | None:
    """Why ``recipe`` cannot quantize a Linear ``[out_features, in_features]`` named ``name`` whose
    weight FSDP2 shards over ``fsdp_world`` ranks (one line), or None if it can."""
    roles = [QuantizerRole("linear", op, name) for op in OPERANDS]
    problems = gemm_problems(recipe, roles, (out_features, in_features), fsdp_world=fsdp_world)
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{type(recipe).__name__} cannot quantize its {problems[0].detail}{more}"


def shape_problems(
    model: torch.nn.Module,
    recipe: Recipe,
    *,
    tokens: int | None = None,
    fsdp_world: int = 1,
    tp: int = 1,
    tp_dims: Mapping[int, Mapping[str, int]] | None = None,
) -> list[ShapeProblem]:
    """Every GEMM operand of ``model``'s dtq modules that ``recipe`` cannot quantize, by fully
    qualified name (the modules' role names). ``tp_dims``: ``{id(module): {weight name: dim}}``
    of the weights tensor parallelism over ``tp`` ranks will split (what dtq.parallel's styles'
    ``weight_dims`` say); their shards are checked."""
    from dtq.nn.module import QuantizedModule

    problems = []
    for fqn, module in model.named_modules():
        if not isinstance(module, QuantizedModule) or module.gemm_state.high_precision is not None:
            continue  # (a module a size rule keeps in high precision quantizes nothing)
        roles = [r for r in module.quantizer_roles() if r is not None]
        split = (tp_dims or {}).get(id(module), {}) if tp > 1 else {}
        for g, (wname, suffix) in enumerate(zip(module.weight_names(), module.gemm_suffixes())):
            problems += gemm_problems(
                recipe,
                roles[3 * g : 3 * g + 3],
                getattr(module, wname).shape,
                tokens=tokens,
                fsdp_world=fsdp_world,
                tp=tp,
                split_dim=split.get(wname),
                name=(module.name or fqn or type(module).__name__) + suffix,
            )
    return problems


__all__ = ["ShapeProblem", "gemm_problems", "linear_problem", "shape_problems", "operand_directions", "OPERANDS"]
