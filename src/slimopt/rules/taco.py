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

``TACORule`` is the rule as the optimizer shell runs it (``slimopt.TACO``, registry name
``taco``): matrices in its groups, embeddings, the output head and vectors in fallback groups
with ``rule="adamw"``.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from slimopt.checks import number, number_error
from slimopt.codecs.slicing import fp32_row_slices, slices_to_update

# fp8 e4m3's largest finite value: a column's largest slot is stored as this.
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
VALUE_FORMATS = ("fp8", "fp32")


def column_top1(source: Tensor) -> tuple[Tensor, Tensor]:
    """For each column of ``source`` (m×n, any floating dtype), the row of its largest magnitude
    and that entry's sign (0 for an all-zero column): two length-n tensors. From the column
    maxima and minima, kept as ``source`` is read a slice of rows at a time in fp32, so the
    largest temporary is one slice's fp32 copy, not |source| or the matrix in fp32. The first
    row wins a tie, as in one ``max`` over the whole column."""
    top = top_rows = bottom = bottom_rows = None
    for start, part in fp32_row_slices(source):
        part_top, part_top_rows = part.max(dim=0)
        part_bottom, part_bottom_rows = part.min(dim=0)
        if top is None:
            top, top_rows, bottom, bottom_rows = part_top, part_top_rows, part_bottom, part_bottom_rows
            continue
        higher, lower = part_top > top, part_bottom < bottom
        top = torch.where(higher, part_top, top)
        top_rows = torch.where(higher, part_top_rows + start, top_rows)
        bottom = torch.where(lower, part_bottom, bottom)
        bottom_rows = torch.where(lower, part_bottom_rows + start, bottom_rows)
    pick = top.abs() >= bottom.abs()
    return torch.where(pick, top_rows, bottom_rows), torch.sign(torch.where(pick, top, bottom)).float()


def column_extremes(source: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The rows of each column's ``k`` largest and ``k`` smallest entries of ``source`` (m×n,
    any floating dtype; k ≤ m): two k×n tensors, each column's rows in descending (ascending)
    order of value. Read a slice of rows at a time in fp32; each slice's extremes are merged
    into the running ones, so no m×n temporary is made."""
    largest = smallest = None
    for start, part in fp32_row_slices(source):
        count = min(k, part.shape[0])
        top, bottom = part.topk(count, dim=0), part.topk(count, dim=0, largest=False)
        found_top = (top.values, top.indices + start)
        found_bottom = (bottom.values, bottom.indices + start)
        largest = found_top if largest is None else _merged(largest, found_top, k, largest=True)
        smallest = found_bottom if smallest is None else _merged(smallest, found_bottom, k, largest=False)
    return largest[1], smallest[1]


def _merged(
    running: tuple[Tensor, Tensor], found: tuple[Tensor, Tensor], k: int, *, largest: bool
) -> tuple[Tensor, Tensor]:
    """The ``k`` largest (smallest) of two lists of (values, rows) per column."""
    values, rows = torch.cat([running[0], found[0]]), torch.cat([running[1], found[1]])
    best = values.topk(min(k, values.shape[0]), dim=0, largest=largest)
    return best.values, rows.gather(0, best.indices)


def direction_scale(shape: tuple[int, int]) -> float:
    """The magnitude m/n of every non-zero of an m×n direction."""
    rows, cols = shape
    return rows / cols


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
    """Fold the gradient (m×n, any floating dtype) into the sketch (in place): decay the slots
    by ``beta``, add (1 − beta) of the gradient at their rows, offer each column's k largest
    other gradient entries, keep the k largest by magnitude. The gradient is read at the slots'
    rows and by slices of rows (``column_extremes``): no m×n temporary."""
    slots = sketch["sketch_rows"].long()
    k = slots.shape[0]
    kept = sketch_values(sketch) * beta + grad.gather(0, slots).float() * (1 - beta)
    # Candidates: the column's k largest and k smallest gradient entries (the k largest
    # magnitudes are among them), unless a slot or the first list holds their row.
    largest, smallest = column_extremes(grad, k)
    candidates = torch.cat([largest, smallest])
    held = (candidates.unsqueeze(1) == slots.unsqueeze(0)).any(dim=1)
    held[k:] |= (smallest.unsqueeze(1) == largest.unsqueeze(0)).any(dim=1)
    offered = grad.gather(0, candidates).float() * (1 - beta)
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
    """The oracle: ``average`` (m×n fp32) ← average·β + grad·(1 − β) in place, a slice of rows
    at a time, then its ``column_top1``. The same arithmetic as a sketch's slots, so a sketch
    with k ≥ m equals it."""
    for _, rows in slices_to_update(*average.shape, meta=average.is_meta):
        average[rows] = average[rows] * beta + grad[rows].float() * (1 - beta)
    return column_top1(average)


def _store(sketch: dict[str, Tensor], rows: Tensor, values: Tensor) -> None:
    sketch["sketch_rows"].copy_(rows)
    if sketch["sketch_values"].dtype == torch.float32:
        sketch["sketch_values"].copy_(values)
        return
    peak = values.abs().amax(dim=0)
    scale = torch.where(peak > 0, peak / FP8_MAX, 1.0)
    sketch["sketch_scale"].copy_(scale)
    sketch["sketch_values"].copy_((values / scale).to(torch.float8_e4m3fn))


class OneSparse(NamedTuple):
    """A direction with one entry per column: ``values[j]`` at row ``rows[j]`` of column j (of
    the transposed weights when ``transposed``). ``add_to`` applies it."""

    rows: Tensor
    values: Tensor
    transposed: bool

    def add_to(self, weights: Tensor, alpha: float, first_row: int = 0) -> None:
        """Add alpha · direction to ``weights``, the rows from ``first_row`` of the matrix (all
        of it by default), in place: one ``scatter_add_`` of n values, the entries of other
        rows adding zero."""
        values = (self.values * alpha).to(weights.dtype)
        if self.transposed:  # the weights' rows are the direction's columns
            part = slice(first_row, first_row + weights.shape[0])
            weights.scatter_add_(1, self.rows[part].unsqueeze(1), values[part].unsqueeze(1))
            return
        rows = self.rows - first_row
        inside = (rows >= 0) & (rows < weights.shape[0])
        index = torch.where(inside, rows, 0).unsqueeze(0)
        weights.scatter_add_(0, index, torch.where(inside, values, 0).unsqueeze(0))


# The rule's hyperparameters (per param group) and their defaults.
TACO_DEFAULTS: dict[str, Any] = {"k": 16, "beta": 0.9, "sketch_values": "fp8", "history": "sketch"}
HISTORIES = ("sketch", "dense")


class TACORule:
    """TACO as an update rule of the optimizer shell: the direction is ``column_top1`` of the
    gradient (``k = 0``), of the sketch (``history="sketch"``) or of a dense fp32 moving average
    (``history="dense"``, the oracle), returned as a ``OneSparse`` of n entries that the shell
    adds to the weights. Hyperparameters per group: ``k``, ``beta``, ``sketch_values``
    ({"fp8", "fp32"}) and ``history`` (``TACO_DEFAULTS``)."""

    moment_kinds: ClassVar[dict[str, str]] = {}  # its state is its own, not a codec's moments
    elementwise: ClassVar[bool] = False  # a column's largest entry needs the whole column
    reads_own_dtype: ClassVar[bool] = True  # it reads the gradient by slices of rows itself
    factored_keys: ClassVar[tuple[str, ...]] = ()
    fused: ClassVar[str | None] = None
    # Hyperparameters of the rule besides lr and weight_decay.
    defaults: ClassVar[dict[str, Any]] = {**TACO_DEFAULTS, "transposed": False}
    help: ClassVar[dict[str, str]] = {
        "k": "slots per column of the gradient sketch (0: the current gradient alone)",
        "beta": "decay rate of the gradient history",
        "sketch_values": "how the sketch's values are stored: fp8 or fp32",
        "history": "sketch, or dense (an fp32 moving average: the oracle)",
        "transposed": "weights stored in × out (transformers' Conv1D), read as out × in",
    }

    def validate(self, group: dict[str, Any]) -> list[str]:
        settings = {key: group.get(key, default) for key, default in TACO_DEFAULTS.items()}
        name = group.get("name")
        where = f" ({name})" if name else ""
        errors = []
        k = settings["k"]
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            errors.append(f"k must be an integer >= 0 (0: no history), got {k!r}")
        beta = number(settings["beta"])
        if beta is None or not 0.0 <= beta < 1.0:
            errors.append(f"beta must be in [0, 1), got {settings['beta']!r}")
        if settings["sketch_values"] not in VALUE_FORMATS:
            errors.append(
                f"unknown sketch_values {settings['sketch_values']!r}; valid: {', '.join(VALUE_FORMATS)}"
            )
        if settings["history"] not in HISTORIES:
            errors.append(f"unknown history {settings['history']!r}; valid: {', '.join(HISTORIES)}")
        errors += number_error("lr", group["lr"])
        if "rank" in group:
            errors.append("the TACO rule takes no rank: its direction is one entry per column already")
        shapes = [tuple(p.shape) for p in group["params"] if p.dim() != 2]
        if shapes:
            errors.append(
                f"the TACO rule{where} updates matrices only; parameters of shapes {shapes} need a "
                "fallback: put them in a param group with rule='adamw' (build_optimizer(model, "
                "'taco') does)"
            )
        return errors

    def init_state(self, grad: Tensor, group: dict[str, Any], *, projected: bool) -> dict[str, Tensor]:
        settings = {key: group.get(key, default) for key, default in TACO_DEFAULTS.items()}
        shape = tuple(grad.T.shape if group.get("transposed", False) else grad.shape)
        if grad.numel() == 0:  # an empty matrix never moves
            return {}
        if settings["history"] == "dense":
            return {"taco_average": torch.zeros(shape, dtype=torch.float32, device=grad.device)}
        if settings["k"] == 0:
            return {}
        return empty_sketch(shape, settings["k"], settings["sketch_values"], grad.device)

    def direction(self, grad: Tensor, state: dict[str, Tensor], age: int, group: dict[str, Any]) -> OneSparse:
        beta = group.get("beta", TACO_DEFAULTS["beta"])
        transposed = group.get("transposed", False)
        if transposed:  # weights stored in × out: TACO's columns are their rows
            grad = grad.T
        shape = tuple(grad.shape)
        if grad.numel() == 0:
            nothing = grad.new_zeros(0, dtype=torch.long)
            return OneSparse(nothing, grad.new_zeros(0), transposed)
        if "taco_average" in state:
            rows, signs = dense_ema_source(state["taco_average"], grad, beta)
        elif "sketch_rows" in state:
            update_sketch(state, grad, beta)
            rows, signs = sketch_source(state, shape)
        else:
            rows, signs = column_top1(grad)
        return OneSparse(rows, signs * direction_scale(shape), transposed)

    def bias_correction(self, group: dict[str, Any], age: int) -> float:
        return 1.0

    def step_size(self, group: dict[str, Any], weights: Tensor, step: int) -> float:
        return group["lr"]
