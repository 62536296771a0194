"""TACO's update rule, the functional core: the column-wise one-sparse ternary direction and the
per-column heavy-hitter sketch it takes its direction from.

Direction (steepest descent under the dimension-normalized 1→1 operator norm): for a matrix
W (m×n, ``nn.Linear``'s out × in) and a direction source S, column j moves only at the row i*
of the largest |S[i, j]|, by sign(S[i*, j]) · m/n. The 1→1 norm of D is its largest column ℓ1
norm, normalized by n/m; the maximizer of ⟨S, D⟩ over its unit ball puts a column's whole
budget m/n on its largest entry. So an update has at most one non-zero per column, all of
magnitude m/n (no free scale: the learning rate is the only one), and is kept as n row indices
and n signs, never as an m×n tensor.

Source: "vanilla" TACO (``k = 0``) takes the current gradient. With history, every column keeps
a sketch of ``k`` slots (row index, value): each step the slots' values decay by β and take
(1 − β) of the new gradient at their rows, the column's ``k`` largest new gradient entries that
are not in a slot become candidates with (1 − β) of their value, and the ``k`` largest of slots
and candidates by magnitude stay (the smallest are evicted). A row with a steady share of the
gradient is kept as long as fewer than ``k`` other rows outweigh it at any time (one-off spikes
enter, decay and leave); with ``k ≥ m`` every row has a slot and the sketch is the dense
exponential moving average exactly (``dense_ema_source``, the oracle). Values are stored in
fp8 (e4m3) against one fp32 scale per column, indices in int16 (int32 for more than 32767
rows): ``k · 3 + 4`` bytes per column with int16 indices (k = 27: 85 bytes, the paper's ~86).

This module is the rule's mathematics; the optimizer shell's per-group rules, the registry
names and the fallback for embeddings, heads and vectors build on it.
"""

from __future__ import annotations

import torch
from torch import Tensor

# fp8 e4m3's largest finite value: a column's largest slot is stored as this.
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
VALUE_FORMATS = ("fp8", "fp32")


def column_top1(source: Tensor) -> tuple[Tensor, Tensor]:
    """For each column of ``source`` (m×n), the row of its largest magnitude and that entry's
    sign (0 for an all-zero column): two length-n tensors."""
    rows = source.abs().argmax(dim=0)
    signs = torch.sign(source.gather(0, rows.unsqueeze(0)).squeeze(0))
    return rows, signs


def direction_scale(shape: tuple[int, int]) -> float:
    """The magnitude m/n of every non-zero of an m×n direction."""
    rows, cols = shape
    return rows / cols


def dense_direction(rows: Tensor, signs: Tensor, shape: tuple[int, int]) -> Tensor:
    """The m×n direction of ``column_top1``'s (rows, signs), for tests and the oracle's checks:
    the optimizer applies it with one ``scatter_add_`` of n values instead."""
    direction = torch.zeros(shape, dtype=torch.float32, device=rows.device)
    direction.scatter_(0, rows.unsqueeze(0), (signs * direction_scale(shape)).unsqueeze(0).float())
    return direction


def apply_direction(weights: Tensor, rows: Tensor, signs: Tensor, step: float) -> None:
    """``weights`` (m×n) ← weights − step · D, touching one entry per column (``scatter_add_``
    of n values); rounded once into bf16 weights."""
    update = (signs * (-step * direction_scale(tuple(weights.shape)))).to(weights.dtype).unsqueeze(0)
    weights.scatter_add_(0, rows.unsqueeze(0), update)


def index_dtype(rows: int) -> torch.dtype:
    """The smallest signed integer type for row indices below ``rows``."""
    return torch.int16 if rows <= torch.iinfo(torch.int16).max else torch.int32


def empty_sketch(shape: tuple[int, int], k: int, values: str, device: torch.device) -> dict[str, Tensor]:
    """A sketch of ``k`` slots per column of an m×n matrix, every value 0. The slots start on
    distinct rows 0 … k−1 (k ≤ m), so a row is never held twice."""
    rows, cols = shape
    k = min(k, rows)
    slots = torch.arange(k, device=device, dtype=index_dtype(rows)).unsqueeze(1).expand(k, cols).contiguous()
    value_dtype = torch.float8_e4m3fn if values == "fp8" else torch.float32
    return {
        "sketch_rows": slots,
        "sketch_values": torch.zeros((k, cols), dtype=value_dtype, device=device),
        "sketch_scale": torch.ones(cols, dtype=torch.float32, device=device),
    }


def sketch_values(sketch: dict[str, Tensor]) -> Tensor:
    """The fp32 values of the slots (k×n)."""
    return sketch["sketch_values"].float() * sketch["sketch_scale"]


def update_sketch(sketch: dict[str, Tensor], grad: Tensor, beta: float) -> None:
    """Fold the gradient (m×n) into the sketch (in place): decay the slots by ``beta``, add
    (1 − beta) of the gradient at their rows, offer each column's k largest other gradient
    entries, keep the k largest by magnitude."""
    slots = sketch["sketch_rows"].long()
    k = slots.shape[0]
    grad = grad.float()
    kept = sketch_values(sketch) * beta + grad.gather(0, slots) * (1 - beta)
    # Candidates: the column's k largest gradient entries, unless a slot holds their row.
    candidates = grad.abs().topk(k, dim=0).indices
    held = (candidates.unsqueeze(1) == slots.unsqueeze(0)).any(dim=1)
    offered = grad.gather(0, candidates) * (1 - beta)
    score = torch.where(held, -1.0, offered.abs())
    # Slots first: among equal magnitudes a slot stays (sorting is stable).
    merged_rows = torch.cat([slots, candidates])
    merged_values = torch.cat([kept, torch.where(held, 0.0, offered)])
    merged_score = torch.cat([kept.abs(), score])
    order = merged_score.argsort(dim=0, descending=True, stable=True)[:k]
    _store(sketch, merged_rows.gather(0, order), merged_values.gather(0, order))


def sketch_source(sketch: dict[str, Tensor], shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """``column_top1`` of the sketch: each column's row of its largest slot, and its sign."""
    values = sketch_values(sketch)
    best = values.abs().argmax(dim=0, keepdim=True)
    rows = sketch["sketch_rows"].long().gather(0, best).squeeze(0)
    signs = torch.sign(values.gather(0, best).squeeze(0))
    return rows, signs


def dense_ema_source(average: Tensor, grad: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """The oracle: ``average`` (m×n fp32) ← average·β + grad·(1 − β) in place, then its
    ``column_top1``. The same arithmetic as a sketch's slots, so a sketch with k ≥ m equals it."""
    average.copy_(average * beta + grad.float() * (1 - beta))
    return column_top1(average)


def sketch_nbytes_per_column(rows: int, k: int, values: str = "fp8") -> int:
    """Bytes of one column's sketch: k indices, k values and one fp32 scale."""
    index = torch.empty((), dtype=index_dtype(rows)).element_size()
    value = 1 if values == "fp8" else 4
    return min(k, rows) * (index + value) + 4


def _store(sketch: dict[str, Tensor], rows: Tensor, values: Tensor) -> None:
    sketch["sketch_rows"].copy_(rows)
    if sketch["sketch_values"].dtype == torch.float32:
        sketch["sketch_values"].copy_(values)
        return
    peak = values.abs().amax(dim=0)
    scale = torch.where(peak > 0, peak / FP8_MAX, 1.0)
    sketch["sketch_scale"].copy_(scale)
    sketch["sketch_values"].copy_((values / scale).to(torch.float8_e4m3fn))
