"""Format codecs. Importing this package registers every built-in codec."""

from dtq.codec import COLUMNWISE, DIRECTIONS, ROWWISE, Codec, registered_quantizers
from dtq.formats.base import Quantizer
from dtq.formats.float8 import Float8Quantizer
from dtq.formats.float8_block import Float8BlockQuantizer
from dtq.formats.float8_row import Float8RowwiseQuantizer
from dtq.formats.hybrid import COLUMNWISE_SOURCES, HybridQuantizer
from dtq.formats.identity import IdentityQuantizer
from dtq.formats.mxfp8 import MXFP8Quantizer
from dtq.formats.nvfp4 import NVFP4Quantizer

__all__ = [
    "ROWWISE",
    "COLUMNWISE",
    "DIRECTIONS",
    "Codec",
    "Quantizer",
    "registered_quantizers",
    "Float8Quantizer",
    "Float8BlockQuantizer",
    "Float8RowwiseQuantizer",
    "MXFP8Quantizer",
    "NVFP4Quantizer",
    "IdentityQuantizer",
    "HybridQuantizer",
    "COLUMNWISE_SOURCES",
]
