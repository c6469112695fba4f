"""Per-direction quantization: one format for the rowwise payload, another for the columnwise one.

A hybrid is not a format and has no codec: it only answers ``for_direction``. Both payloads are
quantized from the original high-precision input, so a same-format hybrid is bitwise the plain
format.
"""

from __future__ import annotations

import dataclasses

from dtq.codec import COLUMNWISE, check_direction, codec_class, quantizer_names
from dtq.formats.base import Quantizer


@dataclasses.dataclass(frozen=True)
class HybridQuantizer(Quantizer):
    rowwise: Quantizer
    columnwise: Quantizer

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

    def for_direction(self, direction: str) -> Quantizer:
        check_direction(direction)
        return self.columnwise if direction == COLUMNWISE else self.rowwise

    @property
    def format_name(self) -> str:
        return f"hybrid({self.rowwise.format_name},{self.columnwise.format_name})"
