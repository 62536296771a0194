"""Large matrices are updated and stored a slice of rows at a time: same results as the whole
matrix where the format allows, bounded temporaries, exact resume."""

from __future__ import annotations

import io

import pytest
import torch

from slimopt import AdamW8bit, AdamWTernary, GaLoreAdamW, state_nbytes
from slimopt.codecs import rows as row_storage
from slimopt.codecs import slicing
from slimopt.codecs.slicing import SLICE_NUMEL
from slimopt.memory import LiveBytes
from slimopt.optimizers import TERNARY_BETAS

from .support import gradient, relative_error, step_on_gradients


@pytest.fixture
def small_slices(monkeypatch: pytest.MonkeyPatch) -> int:
    """Slices of 4096 elements, so that a 128×128 matrix is cut into four."""
    monkeypatch.setattr(slicing, "SLICE_NUMEL", 4096)
    row_storage.row_sliced_storage.cache_clear()
    yield 4096
    row_storage.row_sliced_storage.cache_clear()


def _train(optimizer_cls, dtype=torch.float32, steps=12, **hyper):
    torch.manual_seed(0)
    param = torch.randn(128, 128).to(dtype).requires_grad_()
    optimizer = optimizer_cls([param], lr=1e-2, weight_decay=0.1, **hyper)
    for step in range(steps):
        param.grad = gradient(step, (128, 128)).to(dtype)
        optimizer.step()
    return param.detach(), optimizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliced_fp32_states_reproduce_torch_adamw(small_slices, dtype) -> None:
    ours, optimizer = _train(GaLoreAdamW, dtype)
    state = optimizer.state[next(iter(optimizer.state))]
    # Stored by slices, kept in the parameter's shape as torch.optim keeps it.
    assert state["exp_avg"].shape == state["exp_avg_sq"].shape == (128, 128)
    torch.manual_seed(0)
    reference = torch.randn(128, 128).to(dtype).float().requires_grad_()
    adamw = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.1)
    for step in range(12):
        reference.grad = gradient(step, (128, 128)).to(dtype).float()
        adamw.step()
        with torch.no_grad():
            reference.copy_(reference.to(dtype).float())
    assert relative_error(ours.float(), reference.detach()) <= 1e-6


def test_sliced_int8_equals_the_whole_matrix_when_blocks_align(small_slices, monkeypatch) -> None:
    sliced, optimizer = _train(AdamW8bit)
    sliced_bytes = state_nbytes(optimizer)
    monkeypatch.setattr(slicing, "SLICE_NUMEL", 1 << 30)
    whole, optimizer = _train(AdamW8bit)
    assert torch.equal(sliced, whole)
    assert sliced_bytes == state_nbytes(optimizer)


def test_sliced_update_keeps_temporaries_to_a_slice(monkeypatch) -> None:
    """One step of a 2048×2048 matrix with int8 states: the whole-matrix update holds several
    fp32 temporaries of the matrix's size (gradient copy, two decoded moments, direction; the
    codec's scratch comes in pieces of its own); by slices of 2^18 elements they are that many
    slices instead."""

    def update_workspace(slice_numel: int) -> int:
        monkeypatch.setattr(slicing, "SLICE_NUMEL", slice_numel)
        row_storage.row_sliced_storage.cache_clear()
        param = torch.zeros(2048, 2048, requires_grad=True)
        optimizer = AdamW8bit([param], lr=1e-3)
        param.grad = torch.randn(2048, 2048)
        optimizer.step()  # states exist from here on
        tracker = LiveBytes()
        with tracker:
            optimizer.step()
        return tracker.peak

    whole, sliced = update_workspace(1 << 30), update_workspace(1 << 18)
    row_storage.row_sliced_storage.cache_clear()
    matrix_bytes, slice_bytes = 2048 * 2048 * 4, (1 << 18) * 4
    assert whole > 3 * matrix_bytes
    assert sliced < 8 * slice_bytes and sliced < whole / 10


def test_sliced_ternary_trains_and_resumes_exactly(small_slices) -> None:
    def run(steps, state=None):
        torch.manual_seed(0)
        param = torch.randn(128, 128, requires_grad=True)
        optimizer = AdamWTernary([param], lr=1e-2)
        start = 0
        if state is not None:
            param.data.copy_(state["param"])
            optimizer.load_state_dict(state["optimizer"])
            start = state["step"]
        step_on_gradients([param], optimizer, range(start, steps))
        return param, optimizer

    whole, _ = run(10)
    param, optimizer = run(4)
    buffer = io.BytesIO()
    torch.save({"param": param.detach(), "optimizer": optimizer.state_dict(), "step": 4}, buffer)
    buffer.seek(0)
    resumed, _ = run(10, torch.load(buffer, weights_only=True))
    assert torch.equal(whole.detach(), resumed.detach())
    state = optimizer.state[param]
    assert state["exp_avg.col"].numel() == 4 * 128  # column scales per slice of 32 rows
    assert torch.isfinite(whole).all()


# Bytes per parameter of both moments, from the formats' definitions (codecs/__init__.py): bf16
# 2 + 2; int8 1 + 1 codes and an fp32 scale per block of 256 each; int4 half a byte each and a
# scale per block of 128; ternary 5 digits a byte and a block-of-8 exponent byte, its scales and
# the factored second moment's row and column means (4 bytes per row and per column).
def _expected_bytes(states: str, rows: int, cols: int) -> float:
    numel = rows * cols
    per_element = {"bf16": 4.0, "int8": 2 * (1 + 4 / 256), "int4": 2 * (0.5 + 4 / 128)}
    if states in per_element:
        return per_element[states]
    return (-(-rows // 5) * cols + -(-rows // 8) * cols + 4 * (rows + cols) * 2) / numel


@pytest.mark.parametrize("states", ["bf16", "int8", "int4", "ternary"])
def test_a_small_last_slice_keeps_the_matrix_storage_format(states) -> None:
    """2049×2048 (a 49,153-token vocabulary's shape): slices of 2048 rows leave one row of 2048
    elements, under the size at which moments stay fp32. It used to be stored alone in fp32, at
    the whole matrix's size (bf16 8.00, int8 10.03, int4 9.06, ternary 8.33 bytes per parameter);
    it now joins the slice before it."""
    rows, cols = 2049, 2048
    assert rows * cols > SLICE_NUMEL
    param = torch.zeros(rows, cols, requires_grad=True)
    optimizer = GaLoreAdamW([param], lr=1e-3, states=states)
    param.grad = gradient(0, (rows, cols))
    optimizer.step()
    assert state_nbytes(optimizer) / param.numel() == pytest.approx(
        _expected_bytes(states, rows, cols), rel=2e-3
    )
    assert torch.isfinite(param).all()


def test_stacked_experts_ternary_moments_are_scaled_by_rows_and_columns_whole_or_sliced(
    small_slices, monkeypatch
) -> None:
    """A 3-D moment (experts × rows × columns) is scaled as its experts' rows and columns
    (``slimopt.codecs.ternary.scaled_shape``), whether it is stored whole or by slices of
    experts; its second moment is factored per expert either way."""
    experts, rows, cols = 4, 32, 128  # 16384 elements: slices of 4096 are one expert each

    def first_step(slice_numel: int) -> tuple[dict, torch.Tensor]:
        monkeypatch.setattr(slicing, "SLICE_NUMEL", slice_numel)
        row_storage.row_sliced_storage.cache_clear()
        torch.manual_seed(0)
        weight = torch.randn(experts, rows, cols, requires_grad=True)
        optimizer = AdamWTernary([weight], lr=1e-3)
        weight.grad = gradient(0, (experts, rows, cols))
        optimizer.step()
        return optimizer.state[weight], weight.grad

    whole, grad = first_step(1 << 30)
    sliced, _ = first_step(4096)
    for state, slices in ((whole, 1), (sliced, experts)):
        assert state["exp_avg.row"].numel() == experts * rows
        assert state["exp_avg.col"].numel() == cols * slices
        assert state["exp_avg_sq.row"].numel() == experts * rows  # factored: a mean per row …
        assert state["exp_avg_sq.col"].numel() == experts * cols  # … and per column of each expert
    # Row scales are the first moment's row maxima, (1 − β₁)·|g| at the first step.
    expected = ((1 - TERNARY_BETAS[0]) * grad).abs().amax(dim=2).flatten()
    assert torch.allclose(whole["exp_avg.row"], expected) and torch.allclose(sliced["exp_avg.row"], expected)


@pytest.mark.parametrize("slice_numel", [4096, 1 << 30])
def test_stacked_experts_ternary_moments_resume_bit_exact(small_slices, monkeypatch, slice_numel) -> None:
    monkeypatch.setattr(slicing, "SLICE_NUMEL", slice_numel)
    row_storage.row_sliced_storage.cache_clear()
    shape = (4, 32, 128)
    torch.manual_seed(0)
    weight = torch.randn(shape, requires_grad=True)
    optimizer = AdamWTernary([weight], lr=1e-2)
    step_on_gradients([weight], optimizer, range(3))
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    copy = weight.detach().clone().requires_grad_()
    resumed = AdamWTernary([copy], lr=1e-2)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    step_on_gradients([weight], optimizer, range(3, 6))
    step_on_gradients([copy], resumed, range(3, 6))
    assert torch.equal(weight, copy)


def test_a_sliced_convolution_kernel_keeps_its_matrix_slices(small_slices) -> None:
    """A 4-D kernel (out × in × kh × kw) is sliced as out × (in·kh·kw) matrices, as before
    stacked experts kept their dimensions: slices of 32 × 128 factor their second moment."""
    weight = torch.randn(128, 8, 4, 4, requires_grad=True)
    optimizer = AdamWTernary([weight], lr=1e-3)
    weight.grad = torch.randn(128, 8, 4, 4)
    optimizer.step()
    state = optimizer.state[weight]
    assert state["exp_avg_sq.row"].numel() == 128 and state["exp_avg_sq.col"].numel() == 4 * 128
