"""Per-direction quantization: one format for the rowwise payload, another for the columnwise one.

A hybrid is not a format and has no codec: it answers ``for_direction``, and says where its
columnwise payload comes from (``columnwise_source``):

* ``"original"`` (default): both payloads are quantized from the original high-precision input, so
  a same-format hybrid is bitwise the plain format;
* ``"rowwise_dequantized"``: the columnwise payload is the columnwise format applied to the
  *dequantized rowwise payload* (in fp32), so backward's GEMMs see the weight forward saw, requantized.
  Its amax (where the columnwise format takes one) is that of the dequantized values. The columnwise
  payload is then a function of the rowwise one: gathers may move the rowwise payload only and
  derive the other (docs/formats.md, "Hybrids").
"""

from __future__ import annotations

import dataclasses

import torch

from dtq.codec import COLUMNWISE, ROWWISE, as_2d, check_direction, codec_class, quantizer_names
from dtq.formats.base import Quantizer

COLUMNWISE_SOURCES = ("original", "rowwise_dequantized")


@dataclasses.dataclass(frozen=True)
class HybridQuantizer(Quantizer):
    rowwise: Quantizer
    columnwise: Quantizer
    columnwise_source: str = "original"

    def __post_init__(self):
        for d in ("rowwise", "columnwise"):
            sub = getattr(self, d)
            if isinstance(sub, HybridQuantizer):
                raise TypeError(
                    f"HybridQuantizer: {d}= is itself a HybridQuantizer; hybrids do not nest. "
                    f"Pass the plain quantizer of that direction, e.g. {d}={sub.for_direction(d)!r}"
                )
            if not isinstance(sub, Quantizer):
                raise TypeError(
                    f"HybridQuantizer: {d}= must be a dtq quantizer ({quantizer_names()}), got {type(sub).__name__}"
                )
            codec_class(sub)
        if self.rowwise is self.columnwise:
            raise ValueError(
                "HybridQuantizer: the same quantizer object was passed as rowwise= and columnwise=; "
                "each direction owns its own quantizer. Pass two objects (e.g. "
                "dataclasses.replace(q)), or use the plain quantizer directly if both "
                "directions share one format"
            )
        if self.columnwise_source not in COLUMNWISE_SOURCES:
            raise ValueError(
                f"HybridQuantizer: columnwise_source={self.columnwise_source!r}; use 'original' (the columnwise "
                "payload quantized from the input) or 'rowwise_dequantized' (from the dequantized rowwise payload)"
            )

        if self.columnwise_from_rowwise() and self.columnwise.codec(COLUMNWISE).uses_rng():
            raise ValueError(
                f"HybridQuantizer: columnwise_source='rowwise_dequantized' with a columnwise quantizer that rounds "
                f"stochastically ({self.columnwise!r}): a payload derived again from the rowwise one (as gathers do) "
                "would draw other random bits. Stochastic rounding is for gradients, which quantize from the original; "
                "drop stochastic_rounding or use columnwise_source='original'"
            )

    def __setstate__(self, state: dict) -> None:
        # hybrids pickled before columnwise_source existed quantized both directions from the input
        self.__dict__.update({"columnwise_source": "original", **state})

    def for_direction(self, direction: str) -> Quantizer:
        check_direction(direction)
        return self.columnwise if direction == COLUMNWISE else self.rowwise

    def columnwise_from_rowwise(self) -> bool:
        return self.columnwise_source == "rowwise_dequantized"

    def aliases(self, directions: tuple[str, ...]) -> dict[str, str]:
        # requantized values are never bitwise the rowwise payload, even when both formats match
        return {} if self.columnwise_from_rowwise() else super().aliases(directions)

    def deferred_amax(self, rowwise: bool = True, columnwise: bool = True) -> tuple[str, ...]:
        if not (columnwise and self.columnwise_from_rowwise()):
            return ()
        if self.rowwise.codec(ROWWISE).needs_amax() and self.columnwise.codec(COLUMNWISE).needs_amax():
            return (COLUMNWISE,)
        return ()

    def local_amax(
        self,
        x: torch.Tensor,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        rowwise_amax: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        if not (columnwise and self.columnwise_from_rowwise()):
            return super().local_amax(x, rowwise=rowwise, columnwise=columnwise)
        # the columnwise payload needs the rowwise one, so its amax too (even if rowwise is not wanted)
        out: dict[str, torch.Tensor] = {}
        if self.rowwise.codec(ROWWISE).needs_amax():
            out[ROWWISE] = (
                rowwise_amax
                if rowwise_amax is not None
                else self.rowwise.local_amax(x, rowwise=True, columnwise=False)[ROWWISE]
            )
        if self.columnwise.codec(COLUMNWISE).needs_amax() and (ROWWISE not in out or rowwise_amax is not None):
            y = self.dequantized_rowwise(x, out.get(ROWWISE))
            out[COLUMNWISE] = self.columnwise.local_amax(y, rowwise=False, columnwise=True)[COLUMNWISE]
        return out

    def dequantized_rowwise(self, x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 [M, K] values the columnwise payload of ``x`` is quantized from (``amax``: the
        rowwise direction's, reduced over shards, where it takes one)."""
        x2 = as_2d(x, self)
        data = self.rowwise.quantize_data(x2, columnwise=False, amax=amax)
        return self.codec(ROWWISE).dequantize(data.payload(ROWWISE), tuple(x2.shape))

    @property
    def format_name(self) -> str:
        src = ",rowwise_dequantized" if self.columnwise_from_rowwise() else ""
        return f"hybrid({self.rowwise.format_name},{self.columnwise.format_name}{src})"
