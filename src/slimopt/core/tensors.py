"""Views of parameters and gradients that every path of an update works on."""

from __future__ import annotations

import torch
from torch import Tensor

from slimopt.codecs.slicing import matrix_shape
from slimopt.sharding import local_view


def values(param: Tensor) -> Tensor:
    """The values an update works on: this process's shard of a DTensor, as real pairs if complex
    (an alias of the parameter)."""
    return real(local_view(param))


def real(tensor: Tensor) -> Tensor:
    """A complex tensor as real pairs (``torch.view_as_real``, as torch.optim does), else itself."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def as_matrix(tensor: Tensor) -> Tensor:
    """``tensor`` as ``shape[0] × rest`` (one row for a vector or a scalar): a view where the
    layout allows one, else a copy. A ``SparseDirection`` (TACO's, of a matrix) is one already."""
    return tensor.reshape(matrix_shape(tensor.shape)) if isinstance(tensor, Tensor) else tensor
