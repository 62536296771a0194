"""slimopt: optimizers that train large language models in far less memory.

``GaLoreAdamW`` and ``GaLoreAdafactor`` are drop-in ``torch.optim`` optimizers (galore-torch's
param-group convention) with fp32, bf16, int8, int4 or ternary moments (``states=``);
``APOLLOAdamW`` scales the raw gradient by AdamW's moments of a random projection (APOLLO,
APOLLO-Mini); ``TACO`` moves each matrix by one entry per column from a sketch of its gradient history;
``Muon`` orthogonalizes each matrix's momentum (``torch.optim.Muon``'s), its momentum storable as
int8, int4 or ternary codes too (``Muon8bit``, ``Muon4bit``, ``MuonTernary``);
``build_optimizer`` configures one for a model by name; ``layerwise`` makes it update inside
backward; ``state_nbytes`` counts its state, ``decoded_state`` reads a parameter's moments and
``describe`` says what it does with each parameter. ``quantize_weights`` stores a model's linear
weights as int8 codes that these optimizers train (``export_weights`` writes them out plain).
``slimopt.distributed`` (DDP's shared refreshes, ZeRO-1) comes with ``import slimopt``.
"""

from slimopt import distributed as distributed

# load_state_dict's conversions, at the path they had before they moved into the core.
from slimopt.core import loading as loading
from slimopt.describe import describe
from slimopt.layerwise import LayerwiseHandle, layerwise
from slimopt.memory import state_nbytes
from slimopt.optimizers import (
    TACO,
    AdamW4bit,
    AdamW8bit,
    AdamWTernary,
    APOLLOAdamW,
    GaLoreAdafactor,
    GaLoreAdamW,
    GaLoreAdamW8bit,
    GaLoreOptimizer,
    Muon,
    Muon4bit,
    Muon8bit,
    MuonTernary,
    SlimoptOptimizer,
    decoded_state,
)
from slimopt.registry import available_optimizers, build_optimizer
from slimopt.targets import select_target_modules
from slimopt.weight_formats import export_weights, quantize_weights

__all__ = [
    "TACO",
    "APOLLOAdamW",
    "AdamW4bit",
    "AdamW8bit",
    "AdamWTernary",
    "GaLoreAdafactor",
    "GaLoreAdamW",
    "GaLoreAdamW8bit",
    "GaLoreOptimizer",
    "LayerwiseHandle",
    "Muon",
    "Muon4bit",
    "Muon8bit",
    "MuonTernary",
    "SlimoptOptimizer",
    "available_optimizers",
    "build_optimizer",
    "decoded_state",
    "describe",
    "export_weights",
    "layerwise",
    "quantize_weights",
    "select_target_modules",
    "state_nbytes",
]

__version__ = "0.1.0"
