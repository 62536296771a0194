"""State codecs: maps against bitsandbytes and torchao, round-trip error bounds, stochastic
rounding, and the staleness that stochastic rounding prevents."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slimopt.codecs import moment_codec, slicing, ternary
from slimopt.codecs.maps import dynamic_map, linear_map_without_zero

SHAPE = torch.Size((96, 160))


def sample(name: str, generator: torch.Generator) -> torch.Tensor:
    gaussian = torch.randn(SHAPE, generator=generator)
    if name == "gaussian":
        return gaussian
    if name == "heavy_tailed":  # Student-t with 2 degrees of freedom
        chi2 = torch.randn((2, *SHAPE), generator=generator).square().sum(0)
        return gaussian / (chi2 / 2).sqrt()
    if name == "outlier_columns":
        values = gaussian.clone()
        values[:, ::37] *= 1000.0
        return values
    if name == "tiny":  # log-uniform magnitudes 1e-12 … 1e-2, random signs
        exponent = torch.rand(SHAPE, generator=generator) * 10 - 12
        return torch.sign(gaussian) * 10.0**exponent
    raise ValueError(name)


SAMPLES = ["gaussian", "heavy_tailed", "outlier_columns", "tiny"]


def test_maps_equal_the_reference_libraries() -> None:
    functional = pytest.importorskip("bitsandbytes.functional")
    subclass_4bit = pytest.importorskip("torchao.optim.subclass_4bit")
    for signed in (True, False):
        assert torch.equal(dynamic_map(signed), functional.create_dynamic_map(signed=signed).sort().values)
    torchao_signed = torch.tensor(subclass_4bit.get_qmap_signed()).sort().values
    assert torch.equal(dynamic_map(True, total_bits=4, exponent_bits=3), torchao_signed)
    assert torch.equal(
        linear_map_without_zero(4), torch.tensor(subclass_4bit.get_qmap_unsigned()).sort().values
    )


def block_absmax(values: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block absmax, for flat blocks of ``block`` elements."""
    flat = values.reshape(-1)
    padded = torch.cat([flat, flat.new_zeros(-flat.numel() % block)]).view(-1, block)
    return padded.abs().amax(1, keepdim=True).expand(-1, block).reshape(-1)[: flat.numel()].view(values.shape)


@pytest.mark.parametrize("name", SAMPLES)
@pytest.mark.parametrize(
    ("states", "kind", "code_map", "block"),
    [
        ("int8", "linear", dynamic_map(True), 256),
        ("int8", "square", dynamic_map(False), 256),
        ("int4", "linear", dynamic_map(True, 4, 3), 128),
        ("int4", "square", linear_map_without_zero(4), 128),
    ],
)
def test_blockwise_round_trip_is_within_half_a_map_gap(name, states, kind, code_map, block) -> None:
    values = sample(name, torch.Generator().manual_seed(0))
    if kind == "square":
        values = values.square()
    codec = moment_codec(states, kind, SHAPE)
    decoded = codec.decode(codec.encode(values), SHAPE)
    gaps = code_map.diff()
    positive = code_map[code_map > 0]
    # Nearest rounding errs by at most half the widest gap; a second moment's positive values
    # may instead be lifted to the smallest positive code.
    # The signed maps end at min(code_map) > -1, which bounds the error at -absmax.
    tolerance = max(
        gaps.max().item() / 2,
        positive.min().item() if kind == "square" else 0.0,
        1 + code_map.min().item() if kind == "linear" else 0.0,
    )
    assert ((decoded - values).abs() <= tolerance * block_absmax(values, block) * (1 + 1e-4)).all()
    if kind == "square":
        assert (decoded[values > 0] > 0).all()


@pytest.mark.parametrize(
    ("states", "kind", "code_map"),
    [
        ("int8", "linear", dynamic_map(True)),
        ("int8", "square", dynamic_map(False)),
        ("int4", "linear", dynamic_map(True, 4, 3)),
        ("int4", "square", linear_map_without_zero(4)),
    ],
)
def test_table_lookup_gives_the_nearest_code_as_bucketize_does(states, kind, code_map) -> None:
    """Codes come from a lookup table by the top bits of each value; the reference is a binary
    search (``torch.bucketize``) over the midpoints, on random values, on every midpoint and
    its two fp32 neighbours (where a search is decided), on both ends of every bucket of the
    table (the fp32 numbers whose 15 low bits are all 0 or all 1, denormals included) and on ±0."""
    midpoints = (code_map[1:] + code_map[:-1]) / 2
    neighbours = [midpoints.nextafter(midpoints + 1), midpoints, midpoints.nextafter(midpoints - 1)]
    starts = torch.arange(2**17, dtype=torch.int64) << 15
    ends = torch.cat([starts, starts | (2**15 - 1)]).to(torch.int32).view(torch.float32)
    ends = ends[ends.abs() <= 1]
    generator = torch.Generator().manual_seed(0)
    spread = torch.rand(2**20, generator=generator) * 2 - 1
    spread = spread * torch.rand(2**20, generator=generator) ** 8  # many values near zero
    values = torch.cat([*neighbours, ends, spread, torch.tensor([0.0, -0.0])]).clamp(-1, 1)
    if kind == "square":
        values = values.abs()
    block = 128
    blocks = torch.nn.functional.pad(values, (0, -values.numel() % (block - 1))).view(-1, block - 1)
    blocks = torch.cat([torch.ones(len(blocks), 1), blocks], dim=1)  # absmax 1: codes see the values
    codec = moment_codec(states, kind, blocks.shape, block)
    decoded = codec.decode(codec.encode(blocks), blocks.shape)
    nearest = torch.bucketize(blocks, midpoints)
    if kind == "square":  # positive values never take the zero code
        zero = int((code_map == 0).nonzero()) if (code_map == 0).any() else -1
        nearest = torch.where((blocks > 0) & (nearest == zero), zero + 1, nearest)
    assert torch.equal(decoded, code_map[nearest])


@pytest.mark.parametrize("name", SAMPLES)
def test_int8_relative_error_on_typical_values(name) -> None:
    """Above a tenth of the block maximum the map's codes are 0.0141 apart (64 per decade), so
    an element errs by at most 0.00705 / 0.1 of itself."""
    values = sample(name, torch.Generator().manual_seed(1))
    codec = moment_codec("int8", "linear", SHAPE)
    decoded = codec.decode(codec.encode(values), SHAPE)
    large = values.abs() >= 0.1 * block_absmax(values, 256)
    relative = ((decoded - values).abs() / values.abs())[large]
    assert relative.max() <= 0.0705 and relative.mean() <= 0.025


@pytest.mark.parametrize("name", SAMPLES)
def test_ternary_second_moment_never_decodes_positive_to_zero(name) -> None:
    values = sample(name, torch.Generator().manual_seed(2)).square()
    for shape in (SHAPE, torch.Size((SHAPE.numel(),))):
        codec = moment_codec("ternary", "square", shape)
        decoded = codec.decode(codec.encode(values.view(shape)), shape)
        assert (decoded.view(SHAPE)[values > 0] > 0).all()


def test_factored_second_moment_keeps_row_and_column_means() -> None:
    values = sample("heavy_tailed", torch.Generator().manual_seed(3)).square()
    codec = moment_codec("ternary", "square", SHAPE)
    decoded = codec.decode(codec.encode(values), SHAPE)
    torch.testing.assert_close(decoded.mean(1), values.mean(1), rtol=1e-5, atol=0)
    torch.testing.assert_close(decoded.mean(0), values.mean(0), rtol=1e-5, atol=0)


def rounding_step(states: str, codec, stored: dict, values: torch.Tensor) -> torch.Tensor:
    """Distance between the two values an element can be rounded to."""
    if states == "bf16":
        _, exponent = torch.frexp(values)  # |x| = mantissa · 2^exponent, mantissa in [0.5, 1)
        return torch.ldexp(torch.ones_like(values), exponent - 8)  # bf16 keeps 8 significant bits
    # Ternary: the element's scale, read by decoding a code of all +1 digits (byte 242).
    return codec.decode({**stored, "trits": torch.full_like(stored["trits"], 242)}, values.shape)


# Upper bounds on the rounding noise, Σ Var(decoded) / Σ x², from the formats alone (the
# per-element tolerance above uses the codec's own scale, so a scale too coarse would pass it):
# bf16 keeps 8 significant bits, so neighbours are at most 2⁻⁷·|x| apart and the variance at most
# a quarter of that squared; ternary promises at most the signal's own energy (it measured
# 0.08–0.64 on these samples). A ternary scale 16 times too coarse gives 21.
NOISE_BOUNDS = {"bf16": 2.0**-16, "ternary": 1.0}


@pytest.mark.parametrize("states", ["ternary", "bf16"])
@pytest.mark.parametrize("name", SAMPLES)
# The matrix, a vector, and a stack of 4 experts (scaled by their rows and columns).
@pytest.mark.parametrize("shape", [SHAPE, torch.Size((SHAPE.numel(),)), torch.Size((4, 24, 160))])
def test_stochastic_rounding_is_unbiased(states, name, shape) -> None:
    """The mean of N encodes is within 6 standard errors of the value, element by element:
    rounding to neighbours a step q apart has a standard deviation of at most q/2. The noise,
    measured from the draws, stays under the format's bound."""
    values = sample(name, torch.Generator().manual_seed(4)).view(shape)
    codec = moment_codec(states, "linear", shape)
    generator = torch.Generator().manual_seed(5)
    draws = []
    for _ in range(400):
        stored = codec.encode(values, generator)
        draws.append(codec.decode(stored, shape).double())
    decoded = torch.stack(draws)
    step = rounding_step(states, codec, stored, values).double()
    mean_error = (decoded.mean(0) - values.double()).abs()
    assert (mean_error <= 6 * step / (2 * len(draws) ** 0.5) + 1e-6 * values.abs().double()).all()
    assert decoded.var(0).sum() / values.double().square().sum() < NOISE_BOUNDS[states]


def ema_through_ternary(round_to_nearest: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[float, float]:
    """Run 200 small EMA steps m ← 0.99 m + 0.01 g through the ternary codec, starting from ±1.

    Returns the fraction of ternary digits that never changed and the mean distance from the
    exact (fp32) moving average at the end.
    """
    codec = moment_codec("ternary", "linear", SHAPE)
    generator = torch.Generator().manual_seed(6)
    target = 0.3 * torch.randn(SHAPE, generator=generator)
    exact = torch.randn(SHAPE, generator=generator).sign()
    moment = codec.decode(codec.encode(exact, generator), SHAPE)
    first = moment.sign()
    moved = torch.zeros(SHAPE, dtype=torch.bool)
    with monkeypatch.context() as patch:
        if round_to_nearest:  # every draw is 0.5: a value rounds away from 0 iff |x| > s/2
            patch.setattr(ternary, "uniform", lambda seed, count, start=0: torch.full((count,), 0.5))
        for _ in range(200):
            moment = codec.decode(codec.encode(0.99 * moment + 0.01 * target, generator), SHAPE)
            exact = 0.99 * exact + 0.01 * target
            moved |= moment.sign() != first
    return 1 - moved.float().mean().item(), (moment - exact).abs().mean().item()


def test_stochastic_rounding_keeps_ternary_moving_averages_moving(monkeypatch: pytest.MonkeyPatch) -> None:
    stale, distance = ema_through_ternary(False, monkeypatch)
    stale_nearest, distance_nearest = ema_through_ternary(True, monkeypatch)
    # With stochastic rounding only digits at a block's maximum (1 in 8) and a few others keep
    # their value; round-to-nearest freezes every digit and the average never leaves its start.
    assert stale < 0.3
    assert stale_nearest > 0.9
    assert distance < 0.5 * distance_nearest


def test_ternary_bytes_and_blocks_run_down_columns() -> None:
    """In a matrix of at least 32 rows byte (a, c) holds rows 5a … 5a+4 of column c (digit k:
    row 5a+k, least significant first) and block (b, c) covers rows 8b … 8b+7: values of
    exactly ±1 and 0 round deterministically, so the bytes follow from the layout alone."""
    rows, cols = 42, 33  # the last byte row holds two rows, the last block row two
    generator = torch.Generator().manual_seed(7)
    values = torch.randint(-1, 2, (rows, cols), generator=generator).float()
    values[:, 0] = 1.0  # every row's maximum is 1
    values[0, :] = 1.0  # every column's maximum is 1
    values[8:16, 3] = 0.5 * values[8:16, 3].sign().where(values[8:16, 3] != 0, 1.0)  # block (1, 3)
    stored = ternary.TernaryCodec(8, row_scale=True, col_scale=True).encode(values)
    digits = (values.sign() + 1).int()
    expected = torch.zeros(-(-rows // 5), cols, dtype=torch.int32)
    for row in range(rows):
        expected[row // 5] += digits[row] * 3 ** (row % 5)
    assert torch.equal(stored["trits"].view(-1, cols).int(), expected)
    exponents = torch.zeros(-(-rows // 8), cols, dtype=torch.uint8)
    for row in range(0, rows, 8):
        exponents[row // 8][(values[row : row + 8] == 0).all(dim=0)] = 255  # a block of zeros
    exponents[1, 3] = 4  # 0.5 = 2^(-4/4)
    assert torch.equal(stored["exponents"].view(-1, cols), exponents)


@settings(max_examples=12, deadline=None)
@given(
    states=st.sampled_from(["int8", "int4", "ternary"]),
    kind=st.sampled_from(["linear", "square"]),
    rows=st.integers(1, 1300),
    cols=st.integers(200, 700),
    seed=st.integers(0, 2**16),
)
def test_a_moment_encoded_in_pieces_is_the_one_encoded_whole(states, kind, rows, cols, seed) -> None:
    """On the CPU a codec goes through a large moment in pieces (``slicing.pieces``), on a GPU
    in one: the stored parts, the draws taken from the generator and the decoded values are
    the same bits either way (up to 1300 × 700: several pieces, a short last one)."""
    shape = torch.Size((rows, cols))
    value = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    value = value.square() if kind == "square" else value
    codec = moment_codec(states, kind, shape)

    def round_trip() -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        stored = codec.encode(value, generator)
        return stored, codec.decode(stored, shape), generator.get_state()

    in_pieces = round_trip()
    with slicing.as_on_a_gpu():
        whole = round_trip()
    assert in_pieces[0].keys() == whole[0].keys()
    assert all(torch.equal(in_pieces[0][part], whole[0][part]) for part in whole[0])
    assert torch.equal(in_pieces[1], whole[1]) and torch.equal(in_pieces[2], whole[2])
