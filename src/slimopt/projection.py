"""GaLore projection: the rank-r basis of one weight matrix and the maps into and out of it.

A basis has a left factor ``U`` (m×r, orthonormal columns) and/or a right factor ``Vh``
(r×n, orthonormal rows). A gradient ``G`` (m×n) is projected to ``Uᵀ G``, ``G Vhᵀ`` or
``Uᵀ G Vhᵀ`` and an update ``N`` in that space is mapped back with ``U N``, ``N Vh`` or
``U N Vh``. Bases are plain tensors, so they serialize with ``weights_only=True``.

Three ways to find a basis. Two find the top-r singular subspace:

- ``"svd"``: exact ``torch.linalg.svd`` of the gradient in fp32 (galore-torch's behaviour).
- ``"subspace"``: a Rayleigh-Ritz step on a search space. A warm refresh searches the previous
  basis plus a small power-iterated random sketch of the new gradient, which costs one large
  thin matrix product; a cold one (no basis yet) is a randomized range finder with oversampling
  and power iterations.

The third, ``"random"`` (APOLLO's), ignores the gradient: a Gaussian matrix scaled by 1/√r, so that
projecting preserves norms on average (E[PᵀP] = I). It is drawn from a seed rather than stored
(``random_basis``).

Singular vectors are defined only up to sign, and LAPACK, cuSOLVER and iterative methods pick
different signs. Every basis vector is therefore flipped so that its largest-magnitude entry is
positive, which makes refreshes reproducible across devices and methods.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from slimopt.codecs.slicing import row_slices

PROJ_TYPES = ("std", "reverse_std", "left", "right", "full")
PROJ_METHODS = ("subspace", "svd", "random")

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
    if len(slices) == 1:
        return grad.float() @ basis.right.T
    return torch.cat([grad[rows].float() @ basis.right.T for rows in slices])


def project_back(update: Tensor, basis: Basis, rows: slice = slice(None)) -> Tensor:
    """Map an update from the projected space back to (``rows`` of) the parameter's 2-D shape."""
    if basis.left is not None:
        update = basis.left[rows] @ update
        return update @ basis.right if basis.right is not None else update
    return update[rows] @ basis.right


def add_projected_back(target: Tensor, update: Tensor, basis: Basis, rows: slice, alpha: float) -> None:
    """``target += alpha · project_back(update, basis, rows)`` (``target`` is those rows), as one
    ``addmm_``: no temporary of the target's size. Written as ``addmm_`` and not as
    ``target.add_(a @ b, alpha=…)``, which Inductor on the CPU compiles wrongly (torch.compile of
    a training step that includes the optimizer's; tests/test_projection.py keeps the check)."""
    if basis.left is not None:
        left = basis.left[rows]
        if basis.right is not None:
            target.addmm_(left @ update, basis.right, alpha=alpha)
        else:
            target.addmm_(left, update, alpha=alpha)
        return
    target.addmm_(update[rows], basis.right, alpha=alpha)


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


def random_basis(
    shape: tuple[int, int], rank: int, uses: tuple[bool, bool], generator: torch.Generator, like: Tensor
) -> Basis:
    """A random projection of a ``shape`` matrix for the sides in ``uses``: Gaussian factors
    (m×r left, r×n right) scaled by 1/√rank, drawn by ``generator`` on its device and moved to
    ``like``'s (shapes only on the meta device)."""
    rows, cols = shape
    rank = min(rank, rows, cols)
    factor_shapes = ((rows, rank), (rank, cols))
    factors = []
    for used, factor_shape in zip(uses, factor_shapes, strict=True):
        if not used:
            factors.append(None)
        elif like.is_meta:
            factors.append(like.new_empty(factor_shape, dtype=torch.float32))
        else:
            drawn = torch.randn(factor_shape, generator=generator, device=generator.device)
            factors.append(drawn.div_(math.sqrt(rank)).to(like.device))
    return Basis(*factors)


def canonicalize_signs(vectors: Tensor, dim: int) -> Tensor:
    """Flip each vector along ``dim`` so its largest-magnitude entry is positive (in place)."""
    peak = vectors.abs().argmax(dim=dim, keepdim=True)
    signs = torch.sign(vectors.gather(dim, peak))
    signs[signs == 0] = 1
    return vectors.mul_(signs)


class RowShards(Protocol):
    """How a gradient is split by rows across processes (``slimopt.sharding.RowSharding``):
    what the subspace method needs to find a right basis without gathering the gradient."""

    rows: int  # global rows
    offset: int  # this process's first row

    def all_reduce(self, tensor: Tensor) -> Tensor:
        """``tensor`` summed over the processes, the same on every one."""


def compute_basis(
    grad: Tensor,
    rank: int,
    uses: tuple[bool, bool],
    method: str,
    previous: Basis | None = None,
    generator: torch.Generator | None = None,
    shards: RowShards | None = None,
) -> Basis:
    """Return the top-``rank`` singular basis of a 2-D fp32 ``grad`` for the sides in ``uses``.

    ``previous`` warm-starts the ``"subspace"`` method; ``generator`` (a CPU generator) seeds its
    random directions. With ``shards``, ``grad`` is this process's rows of a gradient split by
    rows: only a right basis (r×n) can be found, by the subspace method, from all-reduced n×k
    sketches (Gᵀ(G Y) = Σ Gₚᵀ(Gₚ Y)), never the m×n gradient; every process gets the same basis.
    Raises ``torch.linalg.LinAlgError`` (a ``RuntimeError``) when a decomposition fails and
    ``ValueError`` for an unknown method or a sharded gradient with another method or side.
    """
    uses_left, uses_right = uses
    if shards is not None and (uses_left or method != "subspace"):
        raise ValueError("a gradient split by rows takes only a right basis by the subspace method")
    global_shape = grad.shape if shards is None else (shards.rows, grad.shape[1])
    rank = min(rank, *global_shape)
    if method == "svd":
        u, _, vh = torch.linalg.svd(grad, full_matrices=False)
        left, right = u[:, :rank], vh[:rank]
    elif method == "subspace":
        # Iterate on the side that holds the basis; for a right-only basis work on Gᵀ.
        if shards is not None:
            operator: _Operator = _ShardedTranspose(grad, shards)
        else:
            operator = _Whole(grad if uses_left else grad.T)
        warm = None if previous is None else (previous.left if uses_left else previous.right.T)
        found, right = _subspace_basis(operator, rank, warm, generator, need_right=uses_left and uses_right)
        left, right = (found, right) if uses_left else (None, found.T)
    else:
        raise ValueError(f"unknown proj_method {method!r}; valid: {', '.join(PROJ_METHODS)}")
    return Basis(
        canonicalize_signs(left.contiguous(), 0) if uses_left else None,
        canonicalize_signs(right.contiguous(), 1) if uses_right else None,
    )


class _Operator(Protocol):
    """The matrix A whose top left singular vectors the subspace method finds (A is G or Gᵀ)."""

    shape: tuple[int, int]

    def forward(self, x: Tensor) -> Tensor:
        """A x, for x as ``gaussian`` and ``adjoint`` give it."""

    def adjoint(self, y: Tensor) -> Tensor:
        """Aᵀ y."""

    def gram(self, reduced: Tensor) -> Tensor:
        """reducedᵀ reduced, for ``reduced`` = Aᵀ Q."""

    def gaussian(self, cols: int, generator: torch.Generator | None) -> Tensor:
        """A random ``shape[1]`` × ``cols`` block (this process's rows of it)."""


class _Whole:
    """A, whole on this process."""

    def __init__(self, matrix: Tensor) -> None:
        self.matrix, self.shape = matrix, tuple(matrix.shape)

    def forward(self, x: Tensor) -> Tensor:
        return self.matrix @ x

    def adjoint(self, y: Tensor) -> Tensor:
        return self.matrix.T @ y

    def gram(self, reduced: Tensor) -> Tensor:
        return reduced.T @ reduced

    def gaussian(self, cols: int, generator: torch.Generator | None) -> Tensor:
        return _gaussian(self.shape[1], cols, self.matrix, generator)


class _ShardedTranspose:
    """A = Gᵀ for a gradient G split by rows: vectors in A's domain (G's rows) stay split, and
    every product into A's range (n×k) or a k×k Gram matrix is all-reduced."""

    def __init__(self, local: Tensor, shards: RowShards) -> None:
        self.local, self.shards = local, shards
        self.shape = (local.shape[1], shards.rows)

    def forward(self, x: Tensor) -> Tensor:
        return self.shards.all_reduce(self.local.T @ x)

    def adjoint(self, y: Tensor) -> Tensor:
        return self.local @ y

    def gram(self, reduced: Tensor) -> Tensor:
        return self.shards.all_reduce(reduced.T @ reduced)

    def gaussian(self, cols: int, generator: torch.Generator | None) -> Tensor:
        # The whole block is drawn on every process, so the basis equals an unsharded run's.
        block = _gaussian(self.shards.rows, cols, self.local, generator)
        return block[self.shards.offset : self.shards.offset + self.local.shape[0]]


def _subspace_basis(
    operator: _Operator,
    rank: int,
    warm: Tensor | None,
    generator: torch.Generator | None,
    *,
    need_right: bool,
) -> tuple[Tensor, Tensor | None]:
    """Top ``rank`` left (and right) singular vectors of the operator's matrix by warm-started
    subspace iteration."""
    rows, cols = operator.shape
    if warm is not None and warm.shape == (rows, rank):
        # The old basis plus a small power-iterated random sketch of the new gradient: the sketch
        # finds directions that appeared since the last refresh, and the Rayleigh-Ritz step below
        # picks the best rank-r subspace of the union with a single large matrix product.
        extra = min(WARM_OVERSAMPLE, rows - rank)
        sketch = operator.forward(operator.gaussian(extra, generator))
        for _ in range(WARM_POWER_ITERS):
            sketch = operator.forward(operator.adjoint(_orthonormal(sketch)))
        range_basis = _orthonormal(torch.cat([warm, sketch], dim=1))
    else:
        width = min(rank + COLD_OVERSAMPLE, rows, cols)
        range_basis = _orthonormal(operator.forward(operator.gaussian(width, generator)))
        for _ in range(COLD_POWER_ITERS):
            range_basis = _orthonormal(operator.forward(operator.adjoint(range_basis)))
    return _rayleigh_ritz(operator, range_basis, rank, need_right=need_right)


def _gaussian(rows: int, cols: int, like: Tensor, generator: torch.Generator | None) -> Tensor:
    if like.is_meta:  # the memory planner's dry run: shapes only
        return like.new_empty(rows, cols)
    # Drawn on the CPU, so a given seed gives the same basis on every device.
    return torch.randn(rows, cols, dtype=like.dtype, generator=generator).to(like.device)


def _orthonormal(block: Tensor) -> Tensor:
    return torch.linalg.qr(block).Q


def _rayleigh_ritz(
    operator: _Operator, range_basis: Tensor, rank: int, *, need_right: bool
) -> tuple[Tensor, Tensor | None]:
    """Best rank-``rank`` singular vectors of the operator's matrix A inside the span of
    ``range_basis``."""
    reduced = operator.adjoint(range_basis)  # n×k: (Qᵀ A)ᵀ
    gram = operator.gram(reduced)  # Qᵀ A Aᵀ Q, k×k
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    top = eigenvectors[:, -rank:].flip(1)
    left = range_basis @ top
    if not need_right:
        return left, None
    singular_values = eigenvalues[-rank:].flip(0).clamp_min(torch.finfo(reduced.dtype).tiny).sqrt()
    right = (reduced @ top / singular_values).T
    return left, right
