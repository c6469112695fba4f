"""The models the trainer can build: a Llama-style decoder made of dtq modules, or a transformers
``LlamaForCausalLM`` converted with ``dtq.convert``. Both keep the byte embedding, final norm and
LM head in high precision; every other GEMM is a dtq module that quantizes under ``dtq.autocast``.

Both expose the same small surface the trainer needs: ``model(tokens) -> logits`` and
``model.blocks`` (the modules FSDP2 shards one by one and activation recompute wraps).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import dtq
from dtq.launch.config import ModelConfig
from dtq.parallel import tp


def rotary_table(seq: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of ``pos * theta^(-2i/d)``, each ``[seq, head_dim / 2]`` in fp32."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * inv_freq
    return angles.cos(), angles.sin()


class RotaryTable:
    """:func:`rotary_table`'s ``(cos, sin)``, as the decoder hands them to its blocks: a plain
    object, which FSDP2's mixed precision leaves alone (it casts the floating tensors of a
    module's tuple, list and dict arguments to ``param_dtype``: the fp32 table would be rounded
    to BF16), and one object per sequence length and device, kept by the decoder (compiled
    blocks then see the same input every step)."""

    __slots__ = ("table",)

    def __init__(self, table: tuple[torch.Tensor, torch.Tensor]):
        self.table = table


def rotary(x: torch.Tensor, theta: float, table: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Rotary position embedding of ``x: [batch, heads, seq, head_dim]`` (pairs ``(i, i + d/2)``
    rotated by ``pos * theta^(-2i/d)``, as in Llama), computed in fp32. ``table``: ``rotary_table``'s
    result for this shape, made once per step by the decoder (computing the angles inside each
    compiled block costs a cos and a sin per element of q and k, several times the rotation itself)."""
    cos, sin = table if table is not None else rotary_table(x.shape[-2], x.shape[-1], theta, x.device)
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x.dtype)


class Attention(torch.nn.Module):
    """RMSNorm fused into the QKV projection (``dtq.nn.LayerNormLinear``), rotary embeddings,
    causal SDPA, and the output projection (``dtq.nn.Linear``). Activations are sequence-first
    ``[seq, batch, hidden]``; QKV rows are head-major (``[head][q|k|v][head_dim]``), so a
    tensor-parallel row shard holds whole heads and this module runs on however many it holds."""

    def __init__(self, cfg: ModelConfig, name: str):
        super().__init__()
        self.head_dim, self.theta = cfg.hidden // cfg.heads, cfg.rope_theta
        self.qkv = dtq.nn.LayerNormLinear(
            cfg.hidden, 3 * cfg.hidden, bias=False, normalization="RMSNorm", eps=cfg.norm_eps, name=f"{name}.qkv"
        )
        self.proj = dtq.nn.Linear(cfg.hidden, cfg.hidden, bias=False, name=f"{name}.proj")

    def forward(self, x: torch.Tensor, rope: RotaryTable | None = None) -> torch.Tensor:
        qkv = self.qkv(x)  # [seq, batch, 3 * local hidden]: the whole sequence, under SP too
        t, b, n = qkv.shape
        # split, not unpacking: backward then concatenates the three gradients instead of summing
        # three zero-filled ones (inductor's kernel read every source for every element)
        heads = qkv.view(t, b, n // (3 * self.head_dim), 3, self.head_dim).split(1, dim=3)
        q, k, v = (h.squeeze(3).permute(1, 2, 0, 3) for h in heads)  # [batch, heads, seq, head_dim]
        table = rope.table if rope is not None else None
        q, k = rotary(q, self.theta, table), rotary(k, self.theta, table)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [batch, heads, seq, head_dim]
        return self.proj(out.permute(2, 0, 1, 3).reshape(t, b, -1))


class Block(torch.nn.Module):
    """Pre-norm residual block: ``x + attn(x)`` then ``x + mlp(x)``, the MLP's RMSNorm fused into
    ``dtq.nn.LayerNormMLP`` with SwiGLU (gate/up rows interleaved in blocks, so tensor
    parallelism can split the MLP at any TP size that divides the blocks)."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.attn = Attention(cfg, f"layers.{index}.attn")
        self.mlp = dtq.nn.LayerNormMLP(
            cfg.hidden,
            cfg.ffn_hidden,
            bias=False,
            normalization="RMSNorm",
            activation="swiglu",
            eps=cfg.norm_eps,
            name=f"layers.{index}.mlp",
            swiglu_interleave=SWIGLU_INTERLEAVE if cfg.ffn_hidden % SWIGLU_INTERLEAVE == 0 else None,
        )

    def forward(self, x: torch.Tensor, rope: RotaryTable | None = None) -> torch.Tensor:
        """``rope``: the decoder's rotary table for the whole sequence (made here when None)."""
        x = x + self.attn(x, rope)
        return x + self.mlp(x)


SWIGLU_INTERLEAVE = 64


class Decoder(torch.nn.Module):
    """Byte-level Llama-style decoder. ``recompute=True`` recomputes each block in backward
    (``torch.utils.checkpoint``, non-reentrant). With sequence parallelism (``sp_group`` set by
    ``launch.parallel``) the blocks run on this rank's slice of the sequence; embedding, final
    norm and LM head see the whole sequence on every rank."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed = torch.nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = torch.nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.norm = torch.nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.lm_head = torch.nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        torch.nn.init.normal_(self.embed.weight, std=cfg.init_std)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        else:
            torch.nn.init.normal_(self.lm_head.weight, std=cfg.init_std)
        self.recompute = False
        self.sp_group = None
        self.head_dim, self.theta = cfg.hidden // cfg.heads, cfg.rope_theta
        self._rope: dict = {}  # (sequence length, device) -> RotaryTable

    @property
    def blocks(self) -> list[torch.nn.Module]:
        return list(self.layers)

    def rotary(self, seq: int, device: torch.device) -> RotaryTable:
        """The rotary table of ``seq`` positions on ``device``, made once (not in every block)."""
        key = (seq, device)
        if key not in self._rope:
            self._rope[key] = RotaryTable(rotary_table(seq, self.head_dim, self.theta, device))
        return self._rope[key]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).transpose(0, 1)  # sequence-first: the dim sequence parallelism splits
        rope = self.rotary(tokens.shape[1], tokens.device)
        if self.sp_group is not None:
            x = tp.SplitToSP.apply(x, self.sp_group)
        for layer in self.layers:
            x = checkpoint(layer, x, rope, use_reentrant=False) if self.recompute and self.training else layer(x, rope)
        if self.sp_group is not None:
            x = tp.GatherToReplicated.apply(x, self.sp_group)
        return self.lm_head(self.norm(x.transpose(0, 1)))


class HFCausalLM(torch.nn.Module):
    """A transformers ``LlamaForCausalLM`` from a random-init ``LlamaConfig`` (nothing is
    downloaded), its attention and MLP projections converted to ``dtq.nn.Linear``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError:
            raise RuntimeError(
                'model.kind = "hf_llama" needs the transformers package: pip install transformers '
                "(or dtq's extra: pip install 'dtq[hf]')"
            ) from None
        hf_cfg = LlamaConfig(
            vocab_size=cfg.vocab,
            hidden_size=cfg.hidden,
            intermediate_size=cfg.ffn_hidden,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
            num_key_value_heads=cfg.kv_heads or cfg.heads,
            max_position_embeddings=cfg.seq_len,
            rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta,
            tie_word_embeddings=cfg.tie_embeddings,
            initializer_range=cfg.init_std,
            attention_bias=False,
            mlp_bias=False,
            use_cache=False,
            attn_implementation="sdpa",
        )
        self.hf = LlamaForCausalLM(hf_cfg)
        dtq.convert(self.hf, module_filter_fn=lambda module, fqn: fqn != "lm_head")

    @property
    def blocks(self) -> list[torch.nn.Module]:
        return list(self.hf.model.layers)

    @property
    def recompute(self) -> bool:
        return self.hf.is_gradient_checkpointing

    @recompute.setter
    def recompute(self, on: bool) -> None:
        if on:
            self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.hf.gradient_checkpointing_disable()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens, use_cache=False).logits


def build_model(cfg: ModelConfig) -> torch.nn.Module:
    """The model a config asks for, on the CPU, initialized from torch's current RNG state (seed
    it alike on every rank: FSDP2 shards the same full tensors everywhere)."""
    return Decoder(cfg) if cfg.kind == "dtq" else HFCausalLM(cfg)
