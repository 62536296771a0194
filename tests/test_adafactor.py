"""GaLoreAdafactor: plain groups against Hugging Face's Adafactor; projected groups train."""

from __future__ import annotations

import pytest
import torch

from slimopt import GaLoreAdafactor

from .support import gradient, relative_error, steady_step_peak

transformers_optimization = pytest.importorskip("transformers.optimization")


@pytest.mark.parametrize(
    "hyper",
    [
        {"lr": None, "relative_step": True, "scale_parameter": True, "beta1": None, "weight_decay": 0.0},
        {"lr": 1e-2, "relative_step": False, "scale_parameter": True, "beta1": None, "weight_decay": 0.01},
        # Hugging Face averages lr-scaled updates, slimopt unscaled ones: equal for a constant lr.
        {"lr": 1e-2, "relative_step": False, "scale_parameter": False, "beta1": 0.9, "weight_decay": 0.0},
    ],
)
def test_unprojected_groups_match_hugging_face_adafactor(hyper) -> None:
    shapes = [(24, 40), (40,), (3, 5, 7)]
    torch.manual_seed(0)
    ours = [torch.randn(s, requires_grad=True) for s in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    optimizer = GaLoreAdafactor(ours, **hyper)
    reference = transformers_optimization.Adafactor(theirs, **hyper)
    for step in range(40):
        for p, q, shape in zip(ours, theirs, shapes, strict=True):
            p.grad = gradient(step, shape)
            q.grad = gradient(step, shape)
        optimizer.step()
        reference.step()
    for p, q in zip(ours, theirs, strict=True):
        assert relative_error(p.detach(), q.detach()) <= 1e-5


def test_projected_second_moment_is_whole_and_unprojected_is_factored() -> None:
    projected, plain = torch.randn(20, 12, requires_grad=True), torch.randn(20, 12, requires_grad=True)
    optimizer = GaLoreAdafactor([{"params": [projected], "rank": 3}, {"params": [plain]}], lr=1e-2, beta1=0.9)
    projected.grad, plain.grad = torch.randn(20, 12), torch.randn(20, 12)
    optimizer.step()
    assert optimizer.state[projected]["exp_avg_sq"].shape == (20, 3)
    assert optimizer.state[projected]["exp_avg"].shape == (20, 3)
    assert optimizer.state[plain]["exp_avg_sq_row"].shape == (20,)
    assert optimizer.state[plain]["exp_avg_sq_col"].shape == (12,)


def test_relative_step_follows_the_parameter_step_through_a_moment_reset() -> None:
    """With warmup_init the relative step grows as 1e-6·t; a "reset" at a refresh restarts the
    moments, not the schedule (Hugging Face's Adafactor counts the parameter's steps)."""
    torch.manual_seed(0)
    param = torch.randn(64, 48, requires_grad=True)
    optimizer = GaLoreAdafactor(
        [{"params": [param], "rank": 8, "update_proj_gap": 10}],
        warmup_init=True,
        scale_parameter=False,
        on_subspace_change="reset",
        stagger=False,
    )
    sizes = []
    for _ in range(22):
        before = param.detach().clone()
        param.grad = gradient(0, (64, 48))  # constant: every clipped Adafactor update has RMS 1
        optimizer.step()
        sizes.append((param.detach() - before).square().mean().sqrt().item())
    # RMS(Δ) ∝ lr_t = 1e-6 · t; steps 10 and 20 (0-based) come right after a reset.
    for step in (9, 10, 11, 20, 21):
        assert sizes[step] / sizes[step - 1] == pytest.approx((step + 1) / step, rel=1e-3), step


@pytest.mark.parametrize(
    "hyper",
    [
        {"lr": None, "relative_step": True, "scale_parameter": True, "beta1": None},
        {"lr": 1e-2, "relative_step": False, "scale_parameter": False, "beta1": 0.9},
    ],
)
def test_float64_parameters_match_hugging_face_adafactor_in_float64(hyper) -> None:
    """A float64 parameter used to raise in the RMS (``vector_norm`` will not narrow float64 to
    fp32); slimopt's fp32 arithmetic now follows the reference's float64 to fp32 precision."""
    shapes = [(24, 40), (40,)]
    torch.manual_seed(0)
    ours = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    optimizer = GaLoreAdafactor(ours, **hyper)
    reference = transformers_optimization.Adafactor(theirs, **hyper)
    for step in range(20):
        for p, q, shape in zip(ours, theirs, shapes, strict=True):
            p.grad = gradient(step, shape).double()
            q.grad = gradient(step, shape).double()
        optimizer.step()
        reference.step()
    for p, q in zip(ours, theirs, strict=True):
        assert p.dtype == torch.float64
        assert relative_error(p.detach(), q.detach()) <= 1e-5


@pytest.mark.parametrize("hyper", [
    {"lr": None, "relative_step": True, "scale_parameter": True},
    {"lr": 1e-2, "relative_step": False, "scale_parameter": False, "weight_decay": 0.01},
])  # fmt: skip
def test_a_factored_matrix_by_slices_of_rows_matches_hugging_face(slices_of, hyper) -> None:
    """Slices of 3 rows: the statistics, the clipping RMS and the weights' RMS combined slice by
    slice give Hugging Face's Adafactor on the whole matrix, fp32 rounding apart."""
    slices_of(3 * 40)
    torch.manual_seed(0)
    ours = torch.randn(24, 40, requires_grad=True)
    theirs = ours.detach().clone().requires_grad_()
    optimizer = GaLoreAdafactor([ours], beta1=None, **hyper)
    reference = transformers_optimization.Adafactor([theirs], beta1=None, **hyper)
    for step in range(40):
        ours.grad, theirs.grad = gradient(step, (24, 40)), gradient(step, (24, 40))
        optimizer.step()
        reference.step()
    assert relative_error(ours.detach(), theirs.detach()) <= 1e-5


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_an_update_keeps_its_temporaries_to_a_slice(weights) -> None:
    """One Adafactor step of a 2048×2048 matrix with a bf16 gradient (factored, no first
    moment): read whole, the fp32 gradient, its square, the update and the weights' fp32 values
    are matrices; by slices of 2^16 elements, a few slices' worth."""

    def make(params):
        return GaLoreAdafactor(params, lr=None, weight_decay=0.1, param_rounding="stochastic")

    whole, sliced = steady_step_peak(make, weights, 1 << 30), steady_step_peak(make, weights, 1 << 16)
    matrix_bytes, slice_bytes = 2048 * 2048 * 4, (1 << 16) * 4
    assert whole > 3 * matrix_bytes
    assert sliced < 8 * slice_bytes and sliced < whole / 10
