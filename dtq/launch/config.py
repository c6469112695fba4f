"""The trainer's configuration: frozen dataclasses read from a TOML file, validated on creation
by pydantic against their field types (docs/training.md, "How configs are parsed").

A config file has up to four tables, ``[model]``, ``[data]``, ``[train]`` and ``[parallel]``;
every key is optional (the defaults are the tiny CPU model). Command-line overrides use the same
dotted names: ``--set train.steps=100 --set train.recipe='"fp8"'`` (values are TOML; a bare word
is taken as a string).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from typing import Annotated, Any, Literal

try:
    from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
    from pydantic.dataclasses import dataclass as pydantic_dataclass
except ImportError:  # pragma: no cover - the train extra installs it
    raise ImportError("dtq's trainer validates its config with pydantic: pip install 'dtq[train]'") from None

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None


class ConfigError(ValueError):
    """A mistake in the config or on the command line. The trainer prints the message as one
    line (rank 0 only, no traceback) and exits with status 2; :func:`load` raises nothing else for
    a bad file or override."""


# Field types: pydantic checks them when a config is made. Integers are strict (``"abc"``, ``true``
# and ``2.5`` are refused, not coerced); floats take integers; booleans take true/false, yes/no,
# on/off, 1/0 in any case (``--set train.recompute=False``); a string field takes a number as its text.
Count = Annotated[int, Field(strict=True, gt=0)]
Natural = Annotated[int, Field(strict=True, ge=0)]
Positive = Annotated[float, Field(strict=True, gt=0)]
NonNegative = Annotated[float, Field(strict=True, ge=0)]
Fraction = Annotated[float, Field(strict=True, ge=0, le=1)]
# Unknown keys are errors: a typo must not be silently ignored.
config_dataclass = pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid", coerce_numbers_to_str=True))


@config_dataclass
class ModelConfig:
    """A Llama-style decoder over bytes. ``kind = "dtq"`` builds it from dtq modules;
    ``"hf_llama"`` builds a transformers ``LlamaForCausalLM`` and converts it with ``dtq.convert``."""

    kind: Literal["dtq", "hf_llama"] = "dtq"
    layers: Count = 2
    hidden: Count = 256
    ffn_hidden: Count = 512
    heads: Count = 4
    kv_heads: Count | None = None  # hf_llama only (grouped-query attention); None: = heads
    vocab: Annotated[int, Field(strict=True, ge=256)] = 256  # byte-level tokens: at least 256
    seq_len: Count = 128
    tie_embeddings: bool = True
    rope_theta: Positive = 10000.0
    norm_eps: Positive = 1e-5
    init_std: Positive = 0.02

    def __post_init__(self):
        if self.hidden % self.heads:
            raise ValueError(f"config: model.hidden = {self.hidden} must be a multiple of model.heads = {self.heads}")
        if (self.hidden // self.heads) % 2:
            raise ValueError(
                f"config: the head size model.hidden / model.heads = {self.hidden // self.heads} must be "
                "even (rotary embeddings rotate pairs of features)"
            )
        if self.kv_heads is not None:
            if self.kind != "hf_llama":
                raise ValueError(
                    'config: model.kv_heads (grouped-query attention) is only used by kind = "hf_llama"; '
                    "the dtq decoder has one fused QKV projection with kv_heads = heads"
                )
            if self.heads % self.kv_heads:
                raise ValueError(
                    f"config: model.heads = {self.heads} must be a multiple of model.kv_heads = {self.kv_heads}"
                )


@config_dataclass
class DataConfig:
    """Byte-level text of the Python standard library's own ``*.py`` files (sorted, so every
    machine with the same Python reads the same bytes). ``max_bytes`` caps how much is read;
    ``val_fraction`` of it (every 1/val_fraction-th 4 KiB chunk) is held out for evaluation."""

    max_bytes: Count = 8_000_000
    val_fraction: Annotated[float, Field(strict=True, gt=0, lt=1)] = 0.02


@config_dataclass
class TrainConfig:
    """One optimizer step consumes ``batch_size`` sequences on every rank. ``recipe`` is a name
    from ``launch/recipes.py`` or ``"module:function"`` returning a dtq recipe (None: BF16-style
    high precision). Schedules are functions of the step, so resuming needs no scheduler state."""

    steps: Count = 40
    batch_size: Count = 2
    lr: Positive = 3e-3
    min_lr_ratio: Fraction = 0.1
    warmup_steps: Natural = 5
    weight_decay: NonNegative = 0.1
    beta1: Fraction = 0.9
    beta2: Fraction = 0.95
    grad_clip: NonNegative = 1.0  # 0 disables clipping
    seed: Natural = 0
    recipe: str = "hybrid"
    # TOML has no null: "none" spells the default (None)
    backward_override: Literal["high_precision", "dequantized", "none"] | None = None
    quantized_params: bool = False
    recompute: bool = False
    compile: bool = False  # torch.compile each block (dtq's GEMMs are custom ops inside its graph)
    # where backward runs on GPUs: "caller", the training loop's thread; "autograd", torch's
    # default worker thread per device (more host time per step: docs/benchmarks.md, "Which GEMMs
    # gain", backward on the training loop's thread)
    backward_thread: Literal["caller", "autograd"] = "caller"
    offload: Literal["none", "save_on_cpu", "dtq"] = "none"
    # "auto": GEMMs too small to gain from the recipe stay in high precision, by the rule measured
    # for it on this device at batch_size x seq_len tokens (dtq.SizeRule.measured)
    size_rule: Literal["off", "auto"] = "off"
    dtype: Literal["float32", "bfloat16"] = "float32"  # parameter / compute dtype (FSDP2 MixedPrecisionPolicy)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_every: Count = 10
    eval_every: Natural = 0  # 0: evaluate once, at the end
    eval_batches: Count = 4
    checkpoint_every: Natural = 0  # 0: only at the end
    keep_checkpoints: Natural = 0  # keep the newest k checkpoints, delete older ones; 0: keep all
    out_dir: str = "runs/tiny"
    progress_bar: bool = True  # a progress bar on rank 0 when stderr is an interactive terminal (tqdm)

    def __post_init__(self):
        if self.backward_override == "none":
            object.__setattr__(self, "backward_override", None)
        from dtq.launch.recipes import check_recipe_name

        check_recipe_name(self.recipe)
        if self.quantized_params and self.recipe == "bf16":
            raise ValueError(
                "config: train.quantized_params = true needs a quantizing recipe to store the weights "
                'in; recipe "bf16" keeps everything in high precision'
            )


@config_dataclass
class ParallelConfig:
    """``tp``: tensor-parallel degree (the rest of the world is FSDP2 data parallel).
    ``replicate``: HSDP replica groups: FSDP2 shards each parameter over world / (replicate * tp)
    ranks and all-reduces gradients across the replicas (1: plain FSDP2 over all of them).
    ``sequence_parallel``: with ``tp > 1``, split activations along the sequence between the
    GEMMs (their inputs are then gathered quantized). ``reshard_after_forward``: FSDP2's setting
    for every block (the root never reshards); "auto" is false when FSDP2 shards over one rank
    (one GPU, or HSDP with one rank per replica), where resharding frees only a copy of the
    weights and backward would gather (and quantize) them again, and true otherwise.
    ``quantized_gather``: true, FSDP2 gathers high-precision weights quantized (the recipe's weight
    format, half the bytes or less); false gathers them in ``train.dtype`` and each GEMM quantizes
    its gathered weight (``dtq.parallel.gather_high_precision``), the faster step where the
    network is fast (docs/benchmarks.md, FSDP2); "auto", quantized only where a weight's shards
    span several hosts (``dtq.launch.parallel.quantized_gather``). ``fsdp_units``: "blocks", FSDP2's
    ``fully_shard`` on every block and on the root; "root", on the root only (one gather and one
    gradient reduction for the whole model); "auto", "root" where the whole job is one rank and
    the blocks would not reshard after forward (nothing to overlap and no memory to free, while
    each unit's hooks cost host time every step: ``dtq.launch.parallel.fsdp_units``), else
    "blocks"."""

    tp: Count = 1
    replicate: Count = 1
    sequence_parallel: bool = False
    reshard_after_forward: bool | Literal["auto"] = "auto"
    quantized_gather: bool | Literal["auto"] = "auto"
    fsdp_units: Literal["auto", "blocks", "root"] = "auto"

    def __post_init__(self):
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("config: parallel.sequence_parallel = true needs parallel.tp > 1")
        if self.fsdp_units == "root" and self.reshard_after_forward is True:
            raise ValueError(
                'config: parallel.fsdp_units = "root" never reshards after forward (FSDP2 keeps the root\'s '
                'weights gathered); set parallel.reshard_after_forward = false or "auto", or fsdp_units = "blocks"'
            )


@config_dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)

    def __post_init__(self):
        if self.train.quantized_params and self.parallel.quantized_gather is False:
            raise ValueError(
                "config: parallel.quantized_gather = false needs train.quantized_params = false "
                "(quantized parameters are gathered in their format)"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "parallel": ParallelConfig}


def _need_toml():
    if tomllib is None:
        raise RuntimeError("dtq's trainer reads TOML configs on Python 3.10 with tomli: pip install 'dtq[train]'")
    return tomllib


def _parse_value(text: str) -> Any:
    """A TOML value (``100``, ``3e-4``, ``true``, ``"fp8"``); anything else is a plain string."""
    try:
        return _need_toml().loads(f"v = {text}")["v"]
    except Exception:  # noqa: BLE001 - tomllib.TOMLDecodeError and friends: a bare word
        return text


def from_dict(raw: dict[str, Any]) -> Config:
    """A validated Config from nested tables: pydantic checks each value against its field's type
    and rejects unknown tables and keys (a typo must not be silently ignored), then each table's
    ``__post_init__`` checks what relates its fields. A mistake is a :class:`ConfigError` of one line."""
    try:
        return _VALIDATOR.validate_python(raw)
    except ValidationError as e:
        raise ConfigError(_one_line(*_first_key_errors(e.errors(include_url=False)))) from None


def _first_key_errors(errors: list[dict]) -> list[dict]:
    """The errors of the first key pydantic refused: one, or one per member of a union type
    (their locations end with the member's type, which is dropped)."""
    key = tuple(errors[0]["loc"][:2])
    return [dict(e, loc=key) for e in errors if tuple(e["loc"][:2]) == key] if len(errors[0]["loc"]) > 2 else errors[:1]


_VALIDATOR = TypeAdapter(Config)


def _one_line(error: dict, *alternatives: dict) -> str:
    """pydantic's error for one key as a line naming it: ``config: train.steps = 'abc': Input
    should be a valid integer`` (a union type's members' messages joined by "or")."""
    if alternatives:
        msgs = [error["msg"]] + [e["msg"].replace("Input should be ", "") for e in alternatives]
        return f"config: {'.'.join(str(p) for p in error['loc'])} = {error['input']!r}: {', or '.join(msgs)}"
    loc = [str(part) for part in error["loc"]]
    if error["type"] == "value_error":  # a __post_init__ check: its message names its keys
        return str(error["ctx"]["error"])
    if error["type"] == "unexpected_keyword_argument":
        what, owner = ("table", Config) if len(loc) == 1 else ("key", _SECTIONS[loc[0]])
        valid = ", ".join(f.name for f in dataclasses.fields(owner))
        return (
            f"config: unknown {what} {'.'.join(loc)}; valid {what}s{'' if len(loc) == 1 else ' of ' + loc[0]}: {valid}"
        )
    return f"config: {'.'.join(loc)} = {error['input']!r}: {error['msg']}"


def load(path: str | pathlib.Path | None, overrides: list[str] = ()) -> Config:
    """Read ``path`` (None: all defaults) and apply ``table.key=value`` overrides; any mistake, an
    unreadable file included, is a :class:`ConfigError`."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = _need_toml().load(f)
        except OSError as e:
            raise ConfigError(f"config: cannot read --config {str(path)!r}: {e.strerror}") from None
        except ValueError as e:  # tomllib.TOMLDecodeError
            raise ConfigError(f"config: {path}: {e}") from None
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot:
            raise ConfigError(f"config: override {item!r} must look like table.key=value, e.g. train.steps=100")
        raw.setdefault(section, {})[name] = _parse_value(value.strip())
    return from_dict(raw)
