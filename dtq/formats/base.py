"""``Quantizer``: the base of every quantizer config.

A *quantizer* is a small frozen dataclass: the settings of one format, with value equality and no
state. Each format's file in ``dtq/formats`` defines its quantizer and registers the codec that
does its payload math (:mod:`dtq.codec`); ``Quantizer.quantize`` returns a
:class:`dtq.QuantizedTensor`, so the configs stand on the tensor layer (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from dtq.codec import (
    Codec,
    QuantizedData,
    as_2d,
    bind_codecs,
    check_direction,
    codec_class,
    quantize_payloads,
    wanted_directions,
)
from dtq.tensor import QuantizedTensor


@dataclasses.dataclass(frozen=True)
class Quantizer:
    """Base of every quantizer config. Subclasses are frozen dataclasses validated in ``__post_init__``."""

    def for_direction(self, direction: str) -> Quantizer:
        """The plain quantizer that produces ``direction`` (itself, except for a hybrid)."""
        check_direction(direction)
        return self

    def codec(self, direction: str) -> Codec:
        """The codec of ``direction``, bound to ``for_direction(direction)``. Built on first use and
        kept on this object, so this is a dict lookup: GEMMs and quantization bind on every call."""
        try:
            return self._codecs[direction]
        except (AttributeError, KeyError):
            return bind_codecs(self, direction)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_codecs"}  # pickles as before binding

    @property
    def format_name(self) -> str:
        return codec_class(self).name

    def block_rows(self, direction: str) -> int:
        """Dim-0 alignment of ``direction``: a dim-0 slice must start (and end, unless at the end)
        on a multiple of this."""
        return max((r for r in self.codec(direction).fields().values() if r), default=1)

    def aliases(self, directions: tuple[str, ...]) -> dict[str, str]:
        """Of ``directions``, those whose payload is bitwise an earlier one's (per-tensor FP8,
        square tiles, passthrough), mapped to it: only the others need moving or storing."""
        out: dict[str, str] = {}
        for i, d in enumerate(directions):
            c = self.codec(d)
            for src in directions[:i]:
                if src not in out and self.for_direction(src) == c.q and c.identical_directions():
                    out[d] = src
                    break
        return out

    def columnwise_from_rowwise(self) -> bool:
        """Whether the columnwise payload is quantized from the dequantized rowwise payload (a
        ``HybridQuantizer(columnwise_source="rowwise_dequantized")``) rather than from the input."""
        return False

    def deferred_amax(self, rowwise: bool = True, columnwise: bool = True) -> tuple[str, ...]:
        """Directions whose amax depends on another direction's amax reduced over shards first:
        :meth:`local_amax` leaves them out unless given ``rowwise_amax`` (a second round)."""
        return ()

    def local_amax(
        self,
        x: torch.Tensor,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        rowwise_amax: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The amax each requested direction needs (``Codec.needs_amax``: tensor-wide, or one per
        column), computed on this (local) tensor. Reduce the values with MAX across the ranks that
        hold other rows and pass them to ``quantize(amax=...)`` so that shards quantize as slices
        of the whole.

        A direction in :meth:`deferred_amax` (a hybrid's columnwise payload quantized from the
        rowwise one, both formats taking a tensor-wide amax) is left out: call again with the
        reduced ``rowwise_amax`` for its local value and reduce that too
        (``dtq.distributed.amax.sharded_amax`` does both rounds). Plain formats ignore ``rowwise_amax``."""
        x2 = as_2d(x, self)
        out, whole = {}, None
        for d in wanted_directions(rowwise, columnwise):
            c = self.codec(d)
            if c.needs_amax():
                c.check_shape(tuple(x2.shape))
                if not c.amax_is_tensor_max():
                    out[d] = c.local_amax(x2)
                else:  # the tensor-wide max|x|: the same value for every direction that takes it
                    whole = out[d] = c.local_amax(x2) if whole is None else whole
        return out

    def quantize(
        self,
        x: torch.Tensor,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        amax: Mapping[str, torch.Tensor] | torch.Tensor | None = None,
        seed: int | torch.Tensor | None = None,
    ) -> QuantizedTensor:
        """Quantize a high-precision tensor into the requested directions.

        ``amax`` overrides the tensor-wide amax (a tensor for every direction that needs one, or a
        ``{direction: tensor}`` mapping, e.g. the all-reduced result of :meth:`local_amax`).
        ``seed`` fixes stochastic rounding; by default one seed is drawn from torch's generator
        of the input's device, so activation recompute (which restores RNG state) replays it.
        """
        payloads = quantize_payloads(self, x, wanted_directions(rowwise, columnwise), amax=amax, seed=seed)
        return QuantizedTensor(x.shape, x.dtype, self, payloads, requires_grad=False)

    def quantize_data(
        self,
        x: torch.Tensor,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        amax: Mapping[str, torch.Tensor] | torch.Tensor | None = None,
        seed: int | torch.Tensor | None = None,
    ) -> QuantizedData:
        """:meth:`quantize` for dtq's own GEMM path: the same payloads, as a :class:`QuantizedData`."""
        payloads = quantize_payloads(self, x, wanted_directions(rowwise, columnwise), amax=amax, seed=seed)
        return QuantizedData(x.shape, x.dtype, self, payloads, device=x.device)
