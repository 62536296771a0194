"""GaLore projection: the rank-r basis of one weight matrix and the maps into and out of it.

A basis has a left factor ``U`` (m×r, orthonormal columns) and/or a right factor ``Vh``
(r×n, orthonormal rows). A gradient ``G`` (m×n) is projected to ``Uᵀ G``, ``G Vhᵀ`` or
``Uᵀ G Vhᵀ`` and an update ``N`` in that space is mapped back with ``U N``, ``N Vh`` or
``U N Vh``. Bases are plain tensors, so they serialize with ``weights_only=True``.

Two ways to find the basis of the top-r singular subspace:

- ``"svd"``: exact ``torch.linalg.svd`` of the gradient in fp32 (galore-torch's behaviour).
- ``"subspace"``: a Rayleigh-Ritz step on a search space. A warm refresh searches the previous
  basis plus a small power-iterated random sketch of the new gradient, which costs one large
  thin matrix product; a cold one (no basis yet) is a randomized range finder with oversampling
  and power iterations.

Singular vectors are defined only up to sign, and LAPACK, cuSOLVER and iterative methods pick
different signs. Every basis vector is therefore flipped so that its largest-magnitude entry is
positive, which makes refreshes reproducible across devices and methods.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from slimopt.codecs.rows import row_slices

PROJ_TYPES = ("std", "reverse_std", "left", "right", "full")
PROJ_METHODS = ("subspace", "svd")

# Cold start of the subspace method: extra random columns and power iterations.
COLD_OVERSAMPLE = 8
COLD_POWER_ITERS = 2
# Warm refresh: random directions added to the previous basis, and power iterations.
WARM_OVERSAMPLE = 32
WARM_POWER_ITERS = 1


class Basis(NamedTuple):
    """Left factor (m×r) and right factor (r×n) of a projection; unused sides are None."""

    left: Tensor | None
    right: Tensor | None


def sides(shape: tuple[int, int], proj_type: str) -> tuple[bool, bool]:
    """Return (uses_left, uses_right) for a 2-D gradient of ``shape`` under ``proj_type``.

    Follows galore-torch: ``std`` keeps the basis on the smaller dimension (right factor when
    m >= n), ``reverse_std`` the larger one.
    """
    rows, cols = shape
    if proj_type == "std":
        return (False, True) if rows >= cols else (True, False)
    if proj_type == "reverse_std":
        return (True, False) if rows >= cols else (False, True)
    if proj_type == "left":
        return True, False
    if proj_type == "right":
        return False, True
    if proj_type == "full":
        return True, True
    raise ValueError(f"unknown proj_type {proj_type!r}; valid: {', '.join(PROJ_TYPES)}")


def projected_shape(shape: tuple[int, int], basis: Basis) -> torch.Size:
    """Shape of a 2-D tensor of ``shape`` once projected with ``basis``."""
    rows, cols = shape
    if basis.left is not None:
        rows = basis.left.shape[1]
    if basis.right is not None:
        cols = basis.right.shape[0]
    return torch.Size((rows, cols))


def project(grad: Tensor, basis: Basis) -> Tensor:
    """Map a 2-D gradient (any float dtype) into the fp32 projected space of ``basis``.

    A large gradient is converted to fp32 a slice of rows at a time, so a bf16 gradient never
    needs a full fp32 copy.
    """
    slices = row_slices(*grad.shape)
    if basis.left is not None:
        # Uᵀ G is a sum over row slices of U and G.
        projected = sum(basis.left[rows].T @ grad[rows].float() for rows in slices)
        return projected @ basis.right.T if basis.right is not None else projected
    parts = [grad[rows].float() @ basis.right.T for rows in slices]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def project_back(update: Tensor, basis: Basis, rows: slice = slice(None)) -> Tensor:
    """Map an update from the projected space back to (``rows`` of) the parameter's 2-D shape."""
    if basis.left is not None:
        update = basis.left[rows] @ update
        return update @ basis.right if basis.right is not None else update
    return update[rows] @ basis.right


def rotate(moment: Tensor, old: Basis, new: Basis, *, squared: bool) -> Tensor:
    """Re-express a moment stored in ``old``'s coordinates in ``new``'s.

    A first moment transforms linearly: ``m ← Q m`` with ``Q = U_newᵀ U_old`` (and ``m Qᵀ`` with
    ``Q = Vh_new Vh_oldᵀ`` on the right). For a second moment only the diagonal of the rotated
    covariance can be kept; assuming uncorrelated coordinates it is ``v ← (Q ⊙ Q) v``, which stays
    non-negative and equals the exact answer when the new basis is a permutation of the old.
    An infinite second moment (an overflowed g²) is saturated first: 0 · inf would be NaN.
    """
    if squared:
        moment = moment.clamp(max=torch.finfo(moment.dtype).max)
    if old.left is not None and new.left is not None:
        change = new.left.T @ old.left
        moment = (change * change if squared else change) @ moment
    if old.right is not None and new.right is not None:
        change = new.right @ old.right.T
        moment = moment @ (change * change if squared else change).T
    return moment


def canonicalize_signs(vectors: Tensor, dim: int) -> Tensor:
    """Flip each vector along ``dim`` so its largest-magnitude entry is positive (in place)."""
    peak = vectors.abs().argmax(dim=dim, keepdim=True)
    signs = torch.sign(vectors.gather(dim, peak))
    signs[signs == 0] = 1
    return vectors.mul_(signs)


def compute_basis(
    grad: Tensor,
    rank: int,
    uses: tuple[bool, bool],
    method: str,
    previous: Basis | None = None,
    generator: torch.Generator | None = None,
) -> Basis:
    """Return the top-``rank`` singular basis of a 2-D fp32 ``grad`` for the sides in ``uses``.

    ``previous`` warm-starts the ``"subspace"`` method; ``generator`` (a CPU generator) seeds its
    random directions.
    Raises ``torch.linalg.LinAlgError`` (a ``RuntimeError``) when a decomposition fails and
    ``ValueError`` for an unknown method.
    """
    uses_left, uses_right = uses
    rank = min(rank, *grad.shape)
    if method == "svd":
        u, _, vh = torch.linalg.svd(grad, full_matrices=False)
        left, right = u[:, :rank], vh[:rank]
    elif method == "subspace":
        left, right = _subspace_basis(grad, rank, uses, previous, generator)
    else:
        raise ValueError(f"unknown proj_method {method!r}; valid: {', '.join(PROJ_METHODS)}")
    return Basis(
        canonicalize_signs(left.contiguous(), 0) if uses_left else None,
        canonicalize_signs(right.contiguous(), 1) if uses_right else None,
    )


def _subspace_basis(
    grad: Tensor,
    rank: int,
    uses: tuple[bool, bool],
    previous: Basis | None,
    generator: torch.Generator | None,
) -> tuple[Tensor | None, Tensor | None]:
    """Top singular vectors for the sides in ``uses`` by warm-started subspace iteration."""
    uses_left, uses_right = uses
    # Iterate on the side that holds the basis; for a right-only basis work on Gᵀ.
    transposed = not uses_left
    matrix = grad.T if transposed else grad
    warm = None
    if previous is not None:
        warm = previous.right.T if transposed else previous.left
    if warm is not None and warm.shape == (matrix.shape[0], rank):
        # The old basis plus a small power-iterated random sketch of the new gradient: the sketch
        # finds directions that appeared since the last refresh, and the Rayleigh-Ritz step below
        # picks the best rank-r subspace of the union with a single large matrix product.
        extra = min(WARM_OVERSAMPLE, matrix.shape[0] - rank)
        sketch = matrix @ _gaussian(matrix.shape[1], extra, matrix, generator)
        for _ in range(WARM_POWER_ITERS):
            sketch = matrix @ (matrix.T @ _orthonormal(sketch))
        range_basis = _orthonormal(torch.cat([warm, sketch], dim=1))
    else:
        width = min(rank + COLD_OVERSAMPLE, *matrix.shape)
        range_basis = _orthonormal(matrix @ _gaussian(matrix.shape[1], width, matrix, generator))
        for _ in range(COLD_POWER_ITERS):
            range_basis = _orthonormal(matrix @ (matrix.T @ range_basis))
    left, right = _rayleigh_ritz(matrix, range_basis, rank, need_right=uses_left and uses_right)
    if transposed:
        return None, left.T
    return left, right


def _gaussian(rows: int, cols: int, like: Tensor, generator: torch.Generator | None) -> Tensor:
    if like.is_meta:  # the memory planner's dry run: shapes only
        return like.new_empty(rows, cols)
    # Drawn on the CPU, so a given seed gives the same basis on every device.
    return torch.randn(rows, cols, dtype=like.dtype, generator=generator).to(like.device)


def _orthonormal(block: Tensor) -> Tensor:
    return torch.linalg.qr(block).Q


def _rayleigh_ritz(
    matrix: Tensor, range_basis: Tensor, rank: int, *, need_right: bool
) -> tuple[Tensor, Tensor | None]:
    """Best rank-``rank`` singular vectors of ``matrix`` inside the span of ``range_basis``."""
    reduced = matrix.T @ range_basis  # n×k: (Qᵀ G)ᵀ
    gram = reduced.T @ reduced  # Qᵀ G Gᵀ Q, k×k
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    top = eigenvectors[:, -rank:].flip(1)
    left = range_basis @ top
    if not need_right:
        return left, None
    singular_values = eigenvalues[-rank:].flip(0).clamp_min(torch.finfo(matrix.dtype).tiny).sqrt()
    right = (reduced @ top / singular_values).T
    return left, right
