"""TACO's rule core (``slimopt.rules.taco``): the column-wise one-sparse direction against a
brute-force maximizer, the sketch against the dense moving average it approximates."""

from __future__ import annotations

import itertools

import pytest
import torch

import slimopt
from slimopt.rules import taco

from .support import steady_step_peak


def dense_direction(rows: torch.Tensor, signs: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The m×n direction of ``column_top1``'s (rows, signs): the optimizer applies it with one
    ``scatter_add_`` of n values instead."""
    direction = torch.zeros(shape, dtype=torch.float32, device=rows.device)
    direction.scatter_(0, rows.unsqueeze(0), (signs * taco.direction_scale(shape)).unsqueeze(0).float())
    return direction


def sketch_nbytes_per_column(rows: int, k: int, values: str = "fp8") -> int:
    """Bytes of one column's sketch: k indices, k values and one fp32 scale."""
    index = torch.empty((), dtype=taco.index_dtype(rows)).element_size()
    value = 1 if values == "fp8" else 4
    return min(k, rows) * (index + value) + 4


def _normalized_one_to_one(direction: torch.Tensor) -> float:
    """The dimension-normalized 1→1 operator norm: the largest column ℓ1 norm, times n/m."""
    rows, cols = direction.shape
    return float(direction.abs().sum(dim=0).max()) * cols / rows


@pytest.mark.parametrize("shape", [(3, 2), (2, 3), (3, 3)])
def test_the_direction_is_the_maximizer_over_the_unit_ball(shape) -> None:
    """A linear function's maximum over the unit ball (a product of scaled ℓ1 balls, one per
    column) is at a vertex: every column ±(m/n) at one row. All vertices are tried."""
    rows, cols = shape
    generator = torch.Generator().manual_seed(0)
    scale = taco.direction_scale(shape)
    vertices = [(sign * scale, row) for row in range(rows) for sign in (-1, 1)]
    for _ in range(5):
        grad = torch.randn(shape, generator=generator)
        best = max(
            sum(value * float(grad[row, col]) for col, (value, row) in enumerate(choice))
            for choice in itertools.product(vertices, repeat=cols)
        )
        direction = dense_direction(*taco.column_top1(grad), shape)
        assert _normalized_one_to_one(direction) == pytest.approx(1.0)
        assert float((grad * direction).sum()) == pytest.approx(best, rel=1e-6)
        assert ((direction != 0).sum(dim=0) == 1).all()
        assert torch.allclose(direction[direction != 0].abs(), torch.tensor(scale))


def test_the_update_touches_one_entry_per_column() -> None:
    weights = torch.randn(6, 4)
    before = weights.clone()
    rows, signs = taco.column_top1(torch.randn(6, 4))
    taco.OneSparse(rows, signs * taco.direction_scale((6, 4)), transposed=False).add_to(weights, alpha=-0.1)
    changed = weights != before
    assert (changed.sum(dim=0) == 1).all()
    expected = before - 0.1 * dense_direction(rows, signs, (6, 4))
    assert torch.allclose(weights, expected)


def test_a_sketch_with_a_slot_for_every_row_is_the_dense_average() -> None:
    """k ≥ m, fp32 values: the sketch's source equals the dense moving average's, step by step,
    and its values are the average's exactly."""
    shape = (12, 7)
    generator = torch.Generator().manual_seed(1)
    sketch = taco.empty_sketch(shape, 16, "fp32", torch.device("cpu"))
    average = torch.zeros(shape)
    for _ in range(20):
        grad = torch.randn(shape, generator=generator) * torch.rand(shape, generator=generator)
        taco.update_sketch(sketch, grad, 0.9)
        expected = taco.dense_ema_source(average, grad, 0.9)
        for ours, theirs in zip(taco.sketch_source(sketch, shape), expected, strict=True):
            assert torch.equal(ours, theirs)
        dense = torch.zeros(shape).scatter_(0, sketch["sketch_rows"].long(), taco.sketch_values(sketch))
        assert torch.equal(dense, average)


def test_a_persistent_heavy_hitter_survives_eviction() -> None:
    """Row 3 of every column gets a steady 1.0; every step another row gets a one-off spike of
    3.0, which enters above it ((1 − β)·3 against (1 − β)·1) and decays. With k = 4, more slots
    than spikes that outweigh row 3 at any time, the spikes come and go while row 3 stays and,
    once its average passes theirs, is the source."""
    shape, beta = (40, 5), 0.9
    sketch = taco.empty_sketch(shape, 4, "fp8", torch.device("cpu"))
    for step in range(30):
        grad = torch.zeros(shape)
        grad[3] = 1.0
        grad[(step * 7 + 11) % 40 if (step * 7 + 11) % 40 != 3 else 0] = 3.0
        taco.update_sketch(sketch, grad, beta)
        if step >= 10:
            rows, signs = taco.sketch_source(sketch, shape)
            assert (rows == 3).all() and (signs == 1).all(), step
            assert (sketch["sketch_rows"] == 3).any(dim=0).all()


def test_vanilla_takes_the_gradient() -> None:
    grad = torch.randn(9, 5)
    rows, signs = taco.column_top1(grad)
    assert torch.equal(rows, grad.abs().argmax(dim=0))
    assert torch.equal(signs, torch.sign(grad[rows, torch.arange(5)]))


@pytest.mark.parametrize(("rows", "k", "values", "expected"), [
    (4096, 16, "fp8", 52),
    (4096, 27, "fp8", 85),
    (40000, 16, "fp8", 84),
    (4096, 16, "fp32", 100),
    (8, 16, "fp8", 28),
])  # fmt: skip
def test_bytes_per_column_are_as_documented(rows, k, values, expected) -> None:
    assert sketch_nbytes_per_column(rows, k, values) == expected
    sketch = taco.empty_sketch((rows, 3), k, values, torch.device("cpu"))
    stored = sum(t.numel() * t.element_size() for t in sketch.values())
    assert stored == 3 * expected


def test_fp8_values_keep_a_columns_largest_slot_to_a_few_percent() -> None:
    shape = (64, 8)
    sketch = taco.empty_sketch(shape, 4, "fp8", torch.device("cpu"))
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    taco.update_sketch(sketch, grad, 0.0)  # β = 0: the slots hold the gradient's top 4
    top = grad.abs().topk(4, dim=0).values
    held = taco.sketch_values(sketch).abs().sort(dim=0, descending=True).values
    assert torch.allclose(held, top, rtol=0.07)


# ----------------------------------------------------------------------------- the optimizer


def _train(optimizer_factory, steps: int = 6, split: int | None = None, seed: int = 0):
    """Steps of a 24×16 and a 16×40 matrix with fixed random gradients; with ``split``, the state
    goes through torch.save into a fresh optimizer before that step."""
    import io

    torch.manual_seed(seed)
    weights = [torch.nn.Parameter(torch.randn(24, 16)), torch.nn.Parameter(torch.randn(16, 40))]
    optimizer = optimizer_factory(weights)
    generator = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        if step == split:
            buffer = io.BytesIO()
            torch.save(optimizer.state_dict(), buffer)
            buffer.seek(0)
            optimizer = optimizer_factory(weights)
            optimizer.load_state_dict(torch.load(buffer, weights_only=True))
        for weight in weights:
            weight.grad = torch.randn(weight.shape, generator=generator)
        optimizer.step()
    return [w.detach().clone() for w in weights], optimizer


def test_a_full_sketch_trains_as_the_dense_oracle() -> None:
    """k ≥ m with fp32 values: every step's direction, hence every weight, equals the oracle's."""
    sketch, _ = _train(lambda ws: slimopt.TACO(ws, lr=1e-2, k=64, sketch_values="fp32"))
    dense, oracle = _train(lambda ws: slimopt.TACO(ws, lr=1e-2, history="dense"))
    assert all(torch.equal(a, b) for a, b in zip(sketch, dense, strict=True))
    assert oracle.state[oracle.param_groups[0]["params"][0]]["taco_average"].shape == (24, 16)


@pytest.mark.parametrize("options", [{"k": 16}, {"k": 0}, {"history": "dense"}])
def test_resume_is_bit_exact(options) -> None:
    def make(ws):
        return slimopt.TACO(ws, lr=1e-2, weight_decay=0.1, **options)

    whole, _ = _train(make)
    resumed, _ = _train(make, split=3)
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed, strict=True))


def test_each_step_moves_one_entry_per_column_by_lr_times_m_over_n() -> None:
    weight = torch.nn.Parameter(torch.randn(24, 16))
    optimizer = slimopt.TACO([weight], lr=0.5, k=4)
    before = weight.detach().clone()
    weight.grad = torch.randn(24, 16)
    optimizer.step()
    change = weight.detach() - before
    assert ((change != 0).sum(dim=0) == 1).all()
    assert torch.allclose(change[change != 0].abs(), torch.tensor(0.5 * 24 / 16))


def test_state_bytes_are_the_sketch_per_column() -> None:
    _, optimizer = _train(lambda ws: slimopt.TACO(ws, lr=1e-2, k=8))
    assert slimopt.state_nbytes(optimizer) == 16 * (8 * 3 + 4) + 40 * (8 * 3 + 4)


def test_build_optimizer_routes_what_is_not_a_linear_matrix_to_the_fallback() -> None:
    from .conftest import tiny_llama

    model = tiny_llama()
    optimizer = slimopt.build_optimizer(model, "taco", lr=1e-3)
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert set(groups) == {"taco", "fallback", "no_decay"}
    assert all(p.dim() == 2 for p in groups["taco"]["params"]) and len(groups["taco"]["params"]) == 14
    assert groups["fallback"]["rule"] == "adamw" and groups["fallback"]["states"] == "int8"
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in groups["fallback"]["params"]} == {
        "model.embed_tokens.weight",
        "lm_head.weight",
    }
    x = torch.randint(0, 256, (2, 16))
    losses = []
    for _ in range(4):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]


def test_the_fallback_takes_its_own_learning_rate_and_a_scheduler_scales_both() -> None:
    from .conftest import tiny_llama

    optimizer = slimopt.build_optimizer(tiny_llama(), "taco", lr=0.05, fallback_lr=1e-3)
    lrs = {g["name"]: g["lr"] for g in optimizer.param_groups}
    assert lrs == {"taco": 0.05, "fallback": 1e-3, "no_decay": 1e-3}
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 0.5)
    assert {g["name"]: g["lr"] for g in optimizer.param_groups} == {k: v * 0.5 for k, v in lrs.items()}
    with pytest.raises(ValueError, match="fallback_lr must be a finite number >= 0, got -1"):
        slimopt.build_optimizer(tiny_llama(), "taco", lr=0.05, fallback_lr=-1)


def test_a_conv1d_weight_moves_one_entry_per_input_feature() -> None:
    """GPT-2 stores its layers in × out: TACO's columns (input features) are its rows."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    optimizer = slimopt.build_optimizer(model, "taco", lr=1e-2)
    assert "taco_transposed" in {g["name"] for g in optimizer.param_groups}
    weight = model.transformer.h[0].mlp.c_fc.weight  # 32 × 128: in × out
    before = weight.detach().clone()
    tokens = torch.randint(0, 64, (2, 8))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    change = weight.detach() - before
    assert ((change != 0).sum(dim=1) == 1).all()
    assert torch.allclose(change[change != 0].abs(), torch.tensor(1e-2 * 128 / 32))


def test_layerwise_updates_equal_stepping() -> None:
    from .conftest import tiny_llama

    results = []
    for layerwise in (False, True):
        model = tiny_llama()
        optimizer = slimopt.build_optimizer(model, "taco", lr=1e-3)
        if layerwise:
            slimopt.layerwise(optimizer)
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
        for _ in range(3):
            model(input_ids=x, labels=x).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"k": -1}, r"k must be an integer >= 0 \(0: no history\), got -1"),
        ({"beta": 1.0}, r"beta must be in \[0, 1\), got 1.0"),
        ({"history": "full"}, r"unknown history 'full'; valid: sketch, dense"),
        ({"sketch_values": "int4"}, r"unknown sketch_values 'int4'; valid: fp8, fp32"),
    ],
)
def test_bad_hyperparameters_are_named(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        slimopt.TACO([torch.nn.Parameter(torch.randn(4, 4))], **options)


def test_a_vector_without_a_fallback_is_refused() -> None:
    params = [{"params": [torch.nn.Parameter(torch.randn(8))], "name": "norms"}]
    with pytest.raises(
        ValueError, match=r"param group 0: the TACO rule \(norms\) updates matrices only.*rule='adamw'"
    ):
        slimopt.TACO(params)
    slimopt.TACO([{"params": [torch.nn.Parameter(torch.randn(8))], "rule": "adamw"}])
    with pytest.raises(ValueError, match=r"unknown rule 'sgd'; valid: adamw, adafactor, lion, taco"):
        slimopt.TACO([{"params": [torch.nn.Parameter(torch.randn(8))], "rule": "sgd"}])


# ----------------------------------------------------------------------------- convergence

# The documented bound (docs/taco.md): on this small fine-tune the sketch's (k = 16) validation
# loss is within 1% of the dense oracle's, and TACO's matrix updates take at least 0.5% off the
# loss of the same run with the matrices frozen (only the fallback training).
ORACLE_BOUND = 0.01
GAIN_OVER_FROZEN = 0.005


@pytest.mark.slow
def test_a_small_fine_tune_converges_within_the_bound_of_the_oracle(shakespeare_tokens) -> None:
    from .conftest import tiny_llama

    def windows(source, generator, count):
        starts = torch.randint(0, len(source) - 64, (count,), generator=generator)
        return torch.stack([source[i : i + 64] for i in starts])

    def train(model, optimizer, source, steps, seed):
        generator = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x = windows(source, generator, 8)
            model(input_ids=x, labels=x).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    pretraining, adaptation, validation = (
        shakespeare_tokens[:300_000],
        shakespeare_tokens[300_000:380_000],
        shakespeare_tokens[380_000:400_000],
    )
    base = tiny_llama()
    train(base, torch.optim.AdamW(base.parameters(), lr=3e-3), pretraining, 100, seed=0)
    held_out = windows(validation, torch.Generator().manual_seed(5), 64)

    def fine_tuned(lr, **options):
        model = tiny_llama()
        model.load_state_dict(base.state_dict())
        optimizer = slimopt.build_optimizer(
            model, "taco", lr=lr, fallback_lr=1e-3, weight_decay=0.0, **options
        )
        train(model, optimizer, adaptation, 60, seed=1)
        with torch.no_grad():
            return float(model(input_ids=held_out, labels=held_out).loss)

    frozen, sketch, oracle = fine_tuned(0.0), fine_tuned(3e-3, k=16), fine_tuned(3e-3, history="dense")
    assert abs(sketch - oracle) <= ORACLE_BOUND * oracle, (sketch, oracle)
    assert max(sketch, oracle) <= (1 - GAIN_OVER_FROZEN) * frozen, (sketch, oracle, frozen)


# ----------------------------------------------------------------------------- the benchmark


def test_the_taco_benchmark_measures_every_variant(tmp_path) -> None:
    """``python -m benchmarks.taco --tiny`` on the pretraining row: every variant trains, TACO's
    measured state per column is the sketch's documented size, layer-wise peaks are measured."""
    from benchmarks import taco as benchmark

    results = benchmark.main(["--tiny", "--tasks", "llama", "--out", str(tmp_path)])
    (row,) = results["rows"]
    expected = [v.name for v in benchmark.variants() if not v.lora] + list(
        benchmark.FALLBACK_VARIANTS.values()
    )
    assert list(row["variants"]) == expected
    for k in (0, 4, 16, 32):
        entry = row["variants"][f"TACO k={k}"]
        assert entry["bytes_per_column"] == (sketch_nbytes_per_column(64, k) if k else 0)
        assert entry["layerwise_peak_bytes"] > entry["state_bytes"] > 0
    assert row["variants"]["TACO dense oracle"]["bytes_per_column"] > 4 * 64
    assert all(entry["metric"] == entry["metric"] for entry in row["variants"].values())
    assert (tmp_path / "results.md").read_text().count("| TACO k=") == 7  # 4 sizes, β = 0.5, 2 fallbacks


# ------------------------------------------------------------------- by slices of rows


def test_column_extremes_by_slices_are_the_whole_columns(slices_of) -> None:
    """Ties included (small integers): the first row wins a tie, as one ``max`` over a column."""
    generator = torch.Generator().manual_seed(3)
    grad = torch.randint(-3, 4, (50, 7), generator=generator).to(torch.bfloat16)
    smooth = torch.randn(50, 7, generator=generator)
    slices_of(1 << 30)
    whole_top1, whole_extremes = taco.column_top1(grad), taco.column_extremes(smooth, 5)
    slices_of(7 * 6)  # slices of 6 rows
    assert all(torch.equal(a, b) for a, b in zip(taco.column_top1(grad), whole_top1, strict=True))
    extremes = taco.column_extremes(smooth, 5)
    assert all(torch.equal(a, b) for a, b in zip(extremes, whole_extremes, strict=True))
    rows, signs = whole_top1
    chosen = grad.float()[rows, torch.arange(7)]
    assert torch.equal(chosen.abs(), grad.float().abs().amax(dim=0))
    assert torch.equal(torch.sign(chosen), signs)
    assert torch.equal(rows, (grad.float() == chosen).float().argmax(dim=0))  # its first row


@pytest.mark.parametrize("options", [{"k": 16}, {"k": 0}, {"history": "dense"}, {"k": 4, "transposed": True}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_update_by_slices_of_rows_is_the_whole_matrix_update(slices_of, options, dtype) -> None:
    """A bf16 gradient read a slice at a time, the weights written a slice at a time: the same
    weights, bit for bit, as one pass over the whole matrix."""

    def train() -> list[torch.Tensor]:
        torch.manual_seed(0)
        weights = [torch.nn.Parameter(torch.randn(shape).to(dtype)) for shape in ((24, 16), (40, 8))]
        optimizer = slimopt.TACO(weights, lr=1e-2, weight_decay=0.1, **options)
        generator = torch.Generator().manual_seed(1)
        for _ in range(5):
            for weight in weights:
                weight.grad = torch.randn(weight.shape, generator=generator).to(dtype)
            optimizer.step()
        return [w.detach() for w in weights]

    slices_of(1 << 30)
    whole = train()
    slices_of(32)  # 2 to 4 rows a slice
    assert all(torch.equal(a, b) for a, b in zip(train(), whole, strict=True))


@pytest.mark.parametrize("weights", ["bf16", "int8"])
@pytest.mark.parametrize("k", [0, 16])
def test_an_update_keeps_its_temporaries_to_a_slice(weights, k) -> None:
    """One TACO step of a 2048×2048 matrix with a bf16 gradient: read whole, its fp32 copy and
    the weights' fp32 values are matrices; by slices of 2^16 elements, a few slices' worth, and
    with a sketch what merging its k×n slots takes (int64 rows and scores of 3k candidates, a
    2k×k×n comparison: under 160 bytes a slot), whatever the slice."""

    def make(params):
        return slimopt.TACO(params, lr=1e-3, k=k, weight_decay=0.1, param_rounding="stochastic")

    whole, sliced = steady_step_peak(make, weights, 1 << 30), steady_step_peak(make, weights, 1 << 16)
    matrix_bytes, slice_bytes = 2048 * 2048 * 4, (1 << 16) * 4
    assert whole > 3 * matrix_bytes
    assert sliced < 8 * slice_bytes + 160 * k * 2048 and sliced < whole / 10
