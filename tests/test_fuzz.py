"""Property-based tests (hypothesis) of the state codecs, their layouts and the fused step, over
shapes and values chosen to break them: 1×n and n×1 matrices, sizes around quantization
blocks, ternary digit bytes and the 32-row/column scale threshold, row slices past 2²² elements
(on the meta device), and values with ±0, denormals, huge magnitudes, all-equal blocks and rows
spanning 60 orders of magnitude. Each test has a fixed example budget and derandomized draws,
so CI runs the same examples every time.

Properties: decode ∘ encode is within each format's documented error and never NaN or infinite
from finite input; stochastic rounding is unbiased; the stored bytes are the storage page's formula
(and ``state_nbytes``); the fused step computes what the reference path does, skips included.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slimopt import GaLoreAdamW, state_nbytes
from slimopt.codecs import DEFAULT_BLOCK_SIZES, MIN_COMPRESSED_NUMEL, STATE_FORMATS, moment_codec
from slimopt.codecs.maps import dynamic_map, linear_map_without_zero
from slimopt.codecs.slicing import SLICE_NUMEL, matrix_shape, row_slices
from slimopt.codecs.ternary import MIN_SCALED_LENGTH

from .support import relative_error


def budget(examples: int) -> settings:
    """A fixed number of examples, drawn the same way every run (no example database)."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


# Sizes around the block sizes (256, 128, 8), the digit byte (5) and the compressed minimum.
EDGES = [1, 2, 4, 5, 7, 8, 9, 31, 32, 33, 127, 128, 129, 255, 256, 257]
shapes = st.one_of(
    st.sampled_from([4095, 4096, 4097, 5000, 6144, 8191]).map(lambda n: (n,)),
    st.tuples(st.just(1), st.integers(4096, 9000)),  # 1×n
    st.tuples(st.integers(4096, 9000), st.just(1)),  # n×1
    st.tuples(st.sampled_from(EDGES), st.sampled_from(EDGES)).filter(lambda s: s[0] * s[1] >= 256),
    st.tuples(st.integers(30, 70), st.integers(30, 160)),
)
SPECIALS = [0.0, -0.0, 1e-40, -1e-40, 1e-30, 3e38, -3e38, 1.0]


@st.composite
def moments(draw: st.DrawFn, nonnegative: bool) -> torch.Tensor:
    """A finite fp32 tensor: Gaussian rows scaled across 60 orders of magnitude, with special
    values scattered in and, sometimes, a run of equal values (an all-equal block)."""
    shape = draw(shapes)
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    rows, cols = matrix_shape(torch.Size(shape))
    value = torch.randn(rows, cols, generator=generator)
    exponents = torch.randint(-30, 30, (rows, 1), generator=generator).float()
    value = value * torch.pow(10.0, exponents) if draw(st.booleans()) else value
    flat = value.view(-1)
    for special in draw(st.lists(st.sampled_from(SPECIALS), max_size=6)):
        flat[torch.randint(0, flat.numel(), (1,), generator=generator)] = special
    if draw(st.booleans()):
        start = draw(st.integers(0, max(0, flat.numel() - 300)))
        flat[start : start + 300] = draw(st.sampled_from([0.0, 1e-3, 2.5e10]))
    value = value.clamp(-3e38, 3e38)
    return (value.abs() if nonnegative else value).reshape(shape)


def expected_bytes(states: str, kind: str, shape: torch.Size) -> int:
    """The bytes one moment is stored in, as the manual's storage table (docs/storage.md) describes it."""
    n = shape.numel()
    if states == "fp32" or n < MIN_COMPRESSED_NUMEL:
        return 4 * n
    if states == "bf16":
        return 2 * n
    rows, cols = matrix_shape(shape)
    if states == "ternary" and kind == "square":
        if len(shape) >= 2 and min(shape[-2:]) >= MIN_SCALED_LENGTH:
            return 4 * (rows + cols)  # factored row and column means
        states = "int4"
    if states in ("int8", "int4"):
        block = DEFAULT_BLOCK_SIZES[states]
        blocks = -(-n // block)
        return blocks * (block if states == "int8" else block // 2) + 4 * blocks
    tall = rows >= MIN_SCALED_LENGTH
    grid_rows, grid_cols = (rows, cols) if tall else (n, 1)
    row_scale, col_scale = cols >= MIN_SCALED_LENGTH or not tall, tall
    digits = -(-grid_rows // 5) * grid_cols
    exponents = -(-grid_rows // DEFAULT_BLOCK_SIZES["ternary"]) * grid_cols
    return digits + exponents + 4 * rows * row_scale + 4 * cols * col_scale


def _nearest_bound(value: torch.Tensor, decoded: torch.Tensor, code_map: torch.Tensor, block: int) -> None:
    """Every decoded element is a nearest multiple of its block's absmax by a map value (a
    positive one where the map's second-moment floor applies)."""
    flat, out = value.reshape(-1).double(), decoded.reshape(-1).double()
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % block)).view(-1, block)
    absmax = padded.abs().amax(dim=1).repeat_interleave(block)[: flat.numel()]
    candidates = absmax.unsqueeze(1) * code_map.double().unsqueeze(0)
    best = (candidates - flat.unsqueeze(1)).abs().min(dim=1).values
    floor = code_map[code_map > 0].min().double() * absmax
    allowed = torch.where(flat > 0, torch.maximum(best, floor - flat), best)
    # decoding rounds map value × absmax to fp32 once
    assert ((out - flat).abs() <= allowed + out.abs() * 2**-23 + 1e-45).all()


@budget(120)
@given(data=st.data(), states=st.sampled_from(STATE_FORMATS), kind=st.sampled_from(["linear", "square"]))
def test_decode_of_encode_is_within_the_formats_error_and_finite(data, states, kind) -> None:
    value = data.draw(moments(nonnegative=kind == "square"))
    shape = value.shape
    codec = moment_codec(states, kind, shape)
    stored = codec.encode(value, torch.Generator().manual_seed(0))
    decoded = codec.decode(stored, shape)
    assert decoded.shape == shape and decoded.dtype == torch.float32
    assert torch.isfinite(decoded).all()
    assert sum(t.numel() * t.element_size() for t in stored.values()) == expected_bytes(states, kind, shape)
    n = shape.numel()
    if states == "fp32" or n < MIN_COMPRESSED_NUMEL:
        assert torch.equal(decoded, value)
    elif states == "bf16":  # one of the two bf16 neighbours
        down = value.bfloat16().float()
        gap = (down.abs() * 2**-7).clamp(min=2**-133)
        assert ((decoded - value).abs() <= gap).all()
    elif states == "int8" or (states == "int4" and kind == "linear"):
        code_map = dynamic_map(
            signed=kind == "linear", **({} if states == "int8" else {"total_bits": 4, "exponent_bits": 3})
        )
        _nearest_bound(value, decoded, code_map, DEFAULT_BLOCK_SIZES[states])
    elif states == "int4" or (states == "ternary" and codec.parts == ("codes", "absmax")):
        _nearest_bound(value, decoded, linear_map_without_zero(4), DEFAULT_BLOCK_SIZES["int4"])
    elif kind == "square":  # factored: the row and column means are the stored ones
        rows, cols = matrix_shape(shape)
        means = value.reshape(rows, cols).double()
        out = decoded.reshape(rows, cols).double()
        torch.testing.assert_close(out.mean(dim=1), means.mean(dim=1), rtol=1e-4, atol=1e-30)
        torch.testing.assert_close(out.mean(dim=0), means.mean(dim=0), rtol=1e-4, atol=1e-30)
        assert (decoded[value > 0] > 0).all()
    else:  # ternary: 0 or ±scale with the value's sign, the scale at least the value's magnitude
        nonzero = decoded != 0
        assert (torch.sign(decoded[nonzero]) == torch.sign(value[nonzero])).all()
        assert (decoded.abs()[nonzero] >= value.abs()[nonzero] * (1 - 1e-5)).all()


@budget(15)
@given(data=st.data(), states=st.sampled_from(["bf16", "ternary"]))
def test_stochastic_rounding_is_unbiased(data, states) -> None:
    """Each element rounds to one of its two neighbours (bf16: the values around it; ternary:
    0 and ±its scale), and the mean of 400 independent roundings is the value within five
    standard errors of that two-point spread."""
    value = data.draw(
        moments(nonnegative=False).filter(lambda v: MIN_COMPRESSED_NUMEL <= v.numel() <= 10_000)
    )
    codec = moment_codec(states, "linear", value.shape)
    stored = codec.encode(value, torch.Generator().manual_seed(0))
    if states == "bf16":
        bits = value.view(torch.int32)
        low = (bits & -65536).view(torch.float32)  # toward zero
        high = ((bits & -65536) + 65536).view(torch.float32)  # the next bf16 away from zero
        exact = low == value
    else:  # every digit +1: each element's scale
        low = torch.zeros_like(value)
        high = codec.decode(
            {**stored, "trits": torch.full_like(stored["trits"], 242)}, value.shape
        ) * torch.sign(value)
        exact = value == 0
    draws = torch.stack(
        [codec.decode(codec.encode(value, torch.Generator().manual_seed(k)), value.shape) for k in range(400)]
    )
    on_neighbours = (draws == low) | (draws == high) | exact
    assert on_neighbours.all()
    gap = (high.double() - low.double()).abs()
    error = (draws.double().mean(dim=0) - value.double()).abs()
    assert (error <= 5 * gap / 2 / math.sqrt(400) + 1e-300).all()


@budget(25)
@given(
    rows=st.integers(2, 40_000),
    cols=st.sampled_from([1, 2, 1000, 2047, 2048, 4096, 4097, 65_536]),
    states=st.sampled_from(STATE_FORMATS),
)
def test_row_sliced_layouts_store_the_formula_bytes_on_the_meta_device(rows, cols, states) -> None:
    """A matrix over 2²² elements is stored by slices of rows (``codecs.rows``): what one step
    allocates on the meta device is each slice's formula bytes, and a small last slice joins
    the one before it instead of turning the matrix fp32 (bytes per parameter at most the
    format's own plus its scales)."""
    if rows * cols <= SLICE_NUMEL:
        rows = SLICE_NUMEL // cols + 1
    param = torch.empty(rows, cols, device="meta", requires_grad=True)
    optimizer = GaLoreAdamW([param], lr=1e-3, states=states)
    param.grad = torch.empty(rows, cols, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer.step()
    slices = [torch.Size((part.stop - part.start, cols)) for part in row_slices(rows, cols)]
    assert all(shape.numel() >= MIN_COMPRESSED_NUMEL for shape in slices) or len(slices) == 1
    formula = sum(expected_bytes(states, kind, shape) for shape in slices for kind in ("linear", "square"))
    assert state_nbytes(optimizer) == formula
    nominal = {"fp32": 8, "bf16": 4, "int8": 2.04, "int4": 1.07, "ternary": 0.34}[states]
    scales = 16 * (1 / cols + len(slices) / rows) if states == "ternary" else 0
    assert state_nbytes(optimizer) / param.numel() <= nominal + scales


def _step_twice(
    param: torch.Tensor, grads: list[torch.Tensor], **options
) -> tuple[torch.Tensor, GaLoreAdamW]:
    param = param.detach().clone().requires_grad_()
    optimizer = GaLoreAdamW([param], lr=1e-2, weight_decay=0.1, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a skipped non-finite step warns
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
    return param.detach(), optimizer


@st.composite
def gradients(draw: st.DrawFn, shape: tuple[int, ...]) -> list[torch.Tensor]:
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([1e-20, 1e-3, 1.0, 1e15]))
    grads = [torch.randn(shape, generator=generator) * scale for _ in range(2)]
    poison = draw(st.sampled_from([None, float("nan"), float("inf"), -float("inf")]))
    if poison is not None:  # the first step's gradient is not finite: both paths skip it
        grads[0].view(-1)[draw(st.integers(0, math.prod(shape) - 1))] = poison
    return grads


@budget(30)
@given(
    data=st.data(),
    states=st.sampled_from(["fp32", "bf16", "int8", "int4"]),
    shape=st.sampled_from([(4097,), (64, 65), (1, 5000), (5000, 1), (300, 17)]),
)
def test_the_fused_step_computes_what_the_reference_path_does(data, states, shape) -> None:
    """Elementwise formats (one compiled step for every size): after two steps, the first one
    possibly skipped for a non-finite gradient, the same skips and the same parameters within
    fp32 round-off; the stored codes agree but where a value lies within a rounding of a
    midpoint."""
    grads = data.draw(gradients(shape))
    start = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    reference, slow = _step_twice(start, grads, states=states, fused=False)
    fused, fast = _step_twice(start, grads, states=states, fused=True)
    assert torch.isfinite(fused).all() and torch.isfinite(reference).all()
    assert (
        fast.state_dict()["state"][0]["nonfinite_skips"] == slow.state_dict()["state"][0]["nonfinite_skips"]
    )
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-6)
    for key, value in slow.state_dict()["state"][0].items():
        if isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
            mismatch = (fast.state_dict()["state"][0][key] != value).float().mean().item()
            assert mismatch <= 1e-3, key


@pytest.mark.parametrize("shape", [(64, 96), (3, 2000)], ids=["scaled", "thin"])
@budget(5)
@given(data=st.data())
def test_the_fused_ternary_step_computes_what_the_reference_path_does(data, shape) -> None:
    """Ternary storage compiles per matrix shape, so two shapes (with row and column scales; a
    thin one with a 4-bit second moment) and values drawn widely."""
    grads = data.draw(gradients(shape))
    start = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    reference, slow = _step_twice(start, grads, states="ternary", fused=False)
    fused, fast = _step_twice(start, grads, states="ternary", fused=True)
    assert torch.isfinite(fused).all()
    assert (
        fast.state_dict()["state"][0]["nonfinite_skips"] == slow.state_dict()["state"][0]["nonfinite_skips"]
    )
    # The same draws, but a value one fp32 rounding from its draw may round the other way.
    assert relative_error(fused, reference) < 1e-3
