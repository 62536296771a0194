"""slimopt: optimizers that train large language models in far less memory.

``GaLoreAdamW`` and ``GaLoreAdafactor`` are drop-in ``torch.optim`` optimizers (galore-torch's
param-group convention); ``build_optimizer`` configures one for a model by name.
"""

from slimopt.optimizer import GaLoreAdafactor, GaLoreAdamW, GaLoreOptimizer
from slimopt.registry import available_optimizers, build_optimizer, select_target_modules

__all__ = [
    "GaLoreAdafactor",
    "GaLoreAdamW",
    "GaLoreOptimizer",
    "available_optimizers",
    "build_optimizer",
    "select_target_modules",
]

__version__ = "0.1.0"
