"""State storage: how each optimizer moment is kept between steps.

A codec turns an fp32 moment into stored tensors (``encode``) and back (``decode``); the
optimizer decodes, lets the update rule work in fp32 and encodes again, one parameter at a
time, so no fp32 copy of a compressed state outlives its step. Which codec a moment gets
depends on the format (``states=``), on whether it is a first moment ("linear", signed) or a
second moment ("square", non-negative), and on its size.

| format    | first moment                         | second moment                                   |
|-----------|--------------------------------------|-------------------------------------------------|
| fp32      | fp32                                 | fp32                                            |
| bf16      | bf16, stochastic rounding            | bf16, stochastic rounding                       |
| int8      | dynamic map, signed, block 256       | dynamic map, unsigned, block 256, no zero for v>0 |
| int4      | 4-bit dynamic map, block 128         | 4-bit linear map without zero, block 128         |
| ternary   | {-1,0,+1}, SR, 5 per byte, scale     | factored row/column means (matrices of at least |
|           | row·col × per-block-of-8 byte        | 32×32), else int4                               |

``states="first/second"`` gives each moment a format of its own (``"ternary/fp32"``: the first
moment ternary, the second fp32). Moments with fewer than ``MIN_COMPRESSED_NUMEL`` elements stay
fp32. Ternary row and column
statistics cost 4 bytes per row (column), so they are kept only along dimensions of at least 32
(``slimopt.codecs.ternary.scale_layout``): a 1×n or n×1 matrix costs what a vector does. A 3-D
moment (stacked experts) is scaled as its (experts·rows) × columns matrix and factored per expert.
"""

from slimopt.codecs.base import Codec, state_key
from slimopt.codecs.choose import DEFAULT_BLOCK_SIZES, STATE_FORMATS, moment_codec, moment_formats
from slimopt.codecs.slicing import MIN_COMPRESSED_NUMEL

__all__ = [
    "DEFAULT_BLOCK_SIZES",
    "MIN_COMPRESSED_NUMEL",
    "STATE_FORMATS",
    "Codec",
    "moment_codec",
    "moment_formats",
    "state_key",
]
