"""The trainer's configuration: frozen dataclasses read from a TOML file, validated on creation.

A config file has up to four tables, ``[model]``, ``[data]``, ``[train]`` and ``[parallel]``;
every key is optional (the defaults are the tiny CPU model). Command-line overrides use the same
dotted names: ``--set train.steps=100 --set train.recipe='"fp8"'`` (values are TOML; a bare word
is taken as a string).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None

MODELS = ("dtq", "hf_llama")
OFFLOADS = ("none", "save_on_cpu", "dtq")
DTYPES = ("float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")


class ConfigError(ValueError):
    """A mistake in the config or on the command line. The trainer prints the message as one
    line (rank 0 only, no traceback) and exits with status 2; any ``ValueError`` from
    :func:`load` is reported the same way."""


def _positive(owner: str, **values: int | float) -> None:
    for name, v in values.items():
        if not v > 0:
            raise ValueError(f"config: {owner}.{name} = {v!r} must be > 0")


def _choice(owner: str, name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"config: {owner}.{name} = {value!r}; use one of {', '.join(map(repr, choices))}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder over bytes. ``kind = "dtq"`` builds it from dtq modules;
    ``"hf_llama"`` builds a transformers ``LlamaForCausalLM`` and converts it with ``dtq.convert``."""

    kind: str = "dtq"
    layers: int = 2
    hidden: int = 256
    ffn_hidden: int = 512
    heads: int = 4
    kv_heads: int | None = None  # hf_llama only (grouped-query attention); None: = heads
    vocab: int = 256  # byte-level tokens
    seq_len: int = 128
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        _choice("model", "kind", self.kind, MODELS)
        _positive("model", layers=self.layers, hidden=self.hidden, ffn_hidden=self.ffn_hidden, heads=self.heads,
                  vocab=self.vocab, seq_len=self.seq_len, rope_theta=self.rope_theta, norm_eps=self.norm_eps,
                  init_std=self.init_std)
        if self.hidden % self.heads:
            raise ValueError(f"config: model.hidden = {self.hidden} must be a multiple of model.heads = {self.heads}")
        if (self.hidden // self.heads) % 2:
            raise ValueError(f"config: the head size model.hidden / model.heads = {self.hidden // self.heads} must be "
                             "even (rotary embeddings rotate pairs of features)")
        if self.vocab < 256:
            raise ValueError(f"config: model.vocab = {self.vocab}; byte-level tokens need at least 256")
        if self.kv_heads is not None:
            if self.kind != "hf_llama":
                raise ValueError("config: model.kv_heads (grouped-query attention) is only used by kind = \"hf_llama\"; "
                                 "the dtq decoder has one fused QKV projection with kv_heads = heads")
            _positive("model", kv_heads=self.kv_heads)
            if self.heads % self.kv_heads:
                raise ValueError(f"config: model.heads = {self.heads} must be a multiple of model.kv_heads = "
                                 f"{self.kv_heads}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Byte-level text of the Python standard library's own ``*.py`` files (sorted, so every
    machine with the same Python reads the same bytes). ``max_bytes`` caps how much is read;
    ``val_fraction`` of it (every 1/val_fraction-th 4 KiB chunk) is held out for evaluation."""

    max_bytes: int = 8_000_000
    val_fraction: float = 0.02

    def __post_init__(self):
        _positive("data", max_bytes=self.max_bytes)
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"config: data.val_fraction = {self.val_fraction} must be in (0, 1)")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One optimizer step consumes ``batch_size`` sequences on every rank. ``recipe`` is a name
    from ``launch/recipes.py`` or ``"module:function"`` returning a dtq recipe (None: BF16-style
    high precision). Schedules are functions of the step, so resuming needs no scheduler state."""

    steps: int = 40
    batch_size: int = 2
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    seed: int = 0
    recipe: str = "hybrid"
    backward_override: str | None = None
    quantized_params: bool = False
    recompute: bool = False
    compile: bool = False  # torch.compile each block (dtq's GEMMs are custom ops inside its graph)
    offload: str = "none"
    dtype: str = "float32"  # parameter / compute dtype (FSDP2 MixedPrecisionPolicy param_dtype)
    device: str = "auto"
    log_every: int = 10
    eval_every: int = 0  # 0: evaluate once, at the end
    eval_batches: int = 4
    checkpoint_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 0  # keep the newest k checkpoints, delete older ones; 0: keep all
    out_dir: str = "runs/tiny"
    progress_bar: bool = True  # a progress bar on rank 0 when stderr is an interactive terminal (tqdm)

    def __post_init__(self):
        _positive("train", steps=self.steps, batch_size=self.batch_size, lr=self.lr, log_every=self.log_every,
                  eval_batches=self.eval_batches)
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "keep_checkpoints", "weight_decay", "grad_clip",
                     "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"config: train.{name} = {getattr(self, name)} must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"config: train.min_lr_ratio = {self.min_lr_ratio} must be in [0, 1]")
        _choice("train", "offload", self.offload, OFFLOADS)
        _choice("train", "dtype", self.dtype, DTYPES)
        _choice("train", "device", self.device, DEVICES)
        if self.backward_override == "none":  # TOML has no null: "none" spells the default
            object.__setattr__(self, "backward_override", None)
        _choice("train", "backward_override", self.backward_override, (None, "high_precision", "dequantized"))
        from dtq.launch.recipes import check_recipe_name

        check_recipe_name(self.recipe)
        if self.quantized_params and self.recipe == "bf16":
            raise ValueError("config: train.quantized_params = true needs a quantizing recipe to store the weights "
                             "in; recipe \"bf16\" keeps everything in high precision")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """``tp``: tensor-parallel degree (the rest of the world is FSDP2 data parallel).
    ``replicate``: HSDP replica groups: FSDP2 shards each parameter over world / (replicate * tp)
    ranks and all-reduces gradients across the replicas (1: plain FSDP2 over all of them).
    ``sequence_parallel``: with ``tp > 1``, split activations along the sequence between the
    GEMMs (their inputs are then gathered quantized). ``reshard_after_forward``: FSDP2's setting
    for every block (the root never reshards)."""

    tp: int = 1
    replicate: int = 1
    sequence_parallel: bool = False
    reshard_after_forward: bool = True

    def __post_init__(self):
        _positive("parallel", tp=self.tp, replicate=self.replicate)
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("config: parallel.sequence_parallel = true needs parallel.tp > 1")


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "parallel": ParallelConfig}


def _need_toml():
    if tomllib is None:
        raise RuntimeError("launch: reading TOML configs on Python 3.10 needs the tomli package: pip install tomli")
    return tomllib


def _parse_value(text: str) -> Any:
    """A TOML value (``100``, ``3e-4``, ``true``, ``"fp8"``); anything else is a plain string."""
    try:
        return _need_toml().loads(f"v = {text}")["v"]
    except Exception:  # noqa: BLE001 - tomllib.TOMLDecodeError and friends: a bare word
        return text


def from_dict(raw: dict[str, Any]) -> Config:
    """A validated Config from nested tables; unknown tables or keys are errors (typos must not
    be silently ignored)."""
    unknown = set(raw) - set(_SECTIONS)
    if unknown:
        raise ValueError(f"config: unknown table(s) {sorted(unknown)}; the tables are {sorted(_SECTIONS)}")
    parts = {}
    for name, cls in _SECTIONS.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            raise ValueError(f"config: [{name}] must be a table")
        fields = {f.name for f in dataclasses.fields(cls)}
        bad = set(table) - fields
        if bad:
            raise ValueError(f"config: unknown key(s) {sorted(bad)} in [{name}]; valid keys: {sorted(fields)}")
        parts[name] = cls(**{k: _typed(name, f, table[k]) for f in dataclasses.fields(cls) for k in [f.name]
                             if k in table})
    return Config(**parts)


_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}
_KINDS = {"bool": bool, "int": int, "float": float, "str": str}


def _typed(section: str, field: dataclasses.Field, value: Any) -> Any:
    """``value`` checked against the field's declared type (``bool``, ``int``, ``float``, ``str``,
    optionally ``| None``), so that a wrong type fails here with the key in the message rather
    than as a truthy string or a TypeError deep in the trainer. A boolean may be written in any
    case and as yes/no, on/off, 1/0 (``--set train.recompute=False``)."""
    declared = str(field.type).replace(" ", "")
    kind = _KINDS.get(declared.removesuffix("|None"))
    if kind is None:  # tables (dict[...]) and anything else: taken as given
        return value
    key = f"{section}.{field.name}"
    if value is None and declared.endswith("|None"):
        return value
    if kind is bool:
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
            return bool(value)
        if not isinstance(value, bool):
            raise ValueError(f"config: {key} must be true or false, got {value!r}")
        return value
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"config: {key} must be an integer, got {value!r}")
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config: {key} must be a number, got {value!r}")
        return float(value)
    if kind is str and not isinstance(value, str):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # --set train.out_dir=2024 reads as a number
        raise ValueError(f"config: {key} must be a string, got {value!r}")
    return value


def load(path: str | pathlib.Path | None, overrides: list[str] = ()) -> Config:
    """Read ``path`` (None: all defaults) and apply ``table.key=value`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        with open(path, "rb") as f:
            raw = _need_toml().load(f)
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot:
            raise ValueError(f"config: override {item!r} must look like table.key=value, e.g. train.steps=100")
        raw.setdefault(section, {})[name] = _parse_value(value.strip())
    return from_dict(raw)
