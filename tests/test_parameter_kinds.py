"""Parameters beyond plain contiguous real matrices: complex, channels_last, empty, and
gradients that overflow the second moment or vanish at a projection refresh."""

from __future__ import annotations

import warnings

import pytest
import torch

import slimopt
from slimopt import GaLoreAdafactor, GaLoreAdamW
from slimopt.codecs import STATE_FORMATS

from .support import gradient, relative_error, step_on_gradients


def test_complex_parameters_train_as_torch_adamw_does() -> None:
    """torch.optim.AdamW updates a complex parameter as independent real and imaginary parts."""
    torch.manual_seed(0)
    ours = [torch.randn(24, 40, dtype=torch.complex64, requires_grad=True)]
    ours.append(torch.randn(40, dtype=torch.complex64, requires_grad=True))
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    hyper = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    optimizer = GaLoreAdamW(ours, **hyper)
    reference = torch.optim.AdamW(theirs, **hyper, foreach=False)
    for step in range(10):
        for a, b in zip(ours, theirs, strict=True):
            grad = torch.complex(gradient(step, a.shape), gradient(step + 50, a.shape))
            a.grad, b.grad = grad.clone(), grad.clone()
        optimizer.step()
        reference.step()
    for a, b in zip(ours, theirs, strict=True):
        assert a.imag.abs().sum() > 0
        assert relative_error(torch.view_as_real(a.detach()), torch.view_as_real(b.detach())) < 1e-6
    # The state is the real pairs' (torch.view_as_real of torch's complex moments).
    moment = slimopt.decoded_state(optimizer, ours[0])["exp_avg"]
    assert torch.allclose(moment, torch.view_as_real(reference.state[theirs[0]]["exp_avg"]), atol=1e-7)


def test_complex_parameters_with_compressed_states_keep_their_imaginary_part() -> None:
    torch.manual_seed(0)
    param = torch.randn(128, 64, dtype=torch.complex64, requires_grad=True)
    start = param.detach().clone()
    optimizer = GaLoreAdamW([param], lr=1e-2, states="int8")
    param.grad = torch.complex(torch.zeros(128, 64), torch.ones(128, 64))
    optimizer.step()
    assert torch.equal(param.detach().real, start.real * (1 - 1e-2 * 1e-2))
    assert (param.detach().imag < start.imag).all()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: GaLoreAdamW([{"params": [p], "rank": 4}]), "cannot be updated by a projected group"),
        (lambda p: GaLoreAdafactor([p], lr=1e-3), "cannot be updated by GaLoreAdafactor"),
    ],
)
def test_complex_parameters_are_refused_where_the_update_would_not_be_exact(make, message) -> None:
    param = torch.randn(8, 8, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(ValueError, match=message):
        make(param)


@pytest.mark.parametrize("rank", [None, 4])
@pytest.mark.parametrize("states", ["fp32", "int8", "ternary"])
def test_channels_last_parameters_update_like_contiguous_ones(rank, states) -> None:
    torch.manual_seed(0)
    contiguous = torch.nn.Conv2d(16, 64, 3)
    channels_last = torch.nn.Conv2d(16, 64, 3).to(memory_format=torch.channels_last)
    channels_last.load_state_dict(contiguous.state_dict())
    assert not channels_last.weight.is_contiguous()
    results = []
    for model in (contiguous, channels_last):
        group = {"params": [model.weight]} if rank is None else {"params": [model.weight], "rank": rank}
        optimizer = GaLoreAdamW([group, {"params": [model.bias]}], lr=1e-2, states=states)
        for step in range(3):
            layout = model.weight.stride() != contiguous.weight.stride()
            grad = gradient(step, model.weight.shape)
            model.weight.grad = grad.contiguous(memory_format=torch.channels_last) if layout else grad
            model.bias.grad = gradient(step, model.bias.shape)
            optimizer.step()
        results.append(model.weight.detach())
    assert not results[1].is_contiguous()  # still channels_last
    assert torch.allclose(results[0], results[1], atol=1e-7, rtol=0)


def empty_model() -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: initializing zero elements is a no-op
        model = torch.nn.Linear(10, 0)  # weight (0, 10), bias (0,)
    model.register_parameter("empty_columns", torch.nn.Parameter(torch.zeros(10, 0)))
    return model


@pytest.mark.parametrize("name", slimopt.available_optimizers())
def test_empty_parameters_are_left_alone(name) -> None:
    model = empty_model()
    options = {"rank": 4, "target_modules": "all-linear"} if "galore" in name else {}
    optimizer = slimopt.build_optimizer(model, name, lr=1e-3, **options)
    for _ in range(2):
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        optimizer.step()
    fresh = slimopt.build_optimizer(empty_model(), name, lr=1e-3, **options)
    fresh.load_state_dict(optimizer.state_dict())


def test_empty_matrices_in_a_projected_group_are_not_projected() -> None:
    params = [torch.zeros(0, 10, requires_grad=True), torch.zeros(10, 0, requires_grad=True)]
    optimizer = GaLoreAdamW([{"params": params, "rank": 4}], lr=1e-3)
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    assert all("basis_left" not in state and "basis_right" not in state for state in optimizer.state.values())


@pytest.mark.parametrize("rank", [None, 16])
@pytest.mark.parametrize("states", STATE_FORMATS)
def test_a_huge_finite_gradient_never_makes_parameters_nan(states, rank) -> None:
    """(1 − β₂)·g² overflows fp32 for g = 1e21: compressed states saturate instead of decoding
    0 · inf, and the rotation at the following refresh does not multiply inf by 0 either."""
    torch.manual_seed(0)
    param = torch.randn(128, 64, requires_grad=True)
    group = {"params": [param]} if rank is None else {"params": [param], "rank": rank, "update_proj_gap": 2}
    optimizer = GaLoreAdamW([group], lr=1e-3, states=states, stagger=False)
    for step in range(5):
        param.grad = gradient(step, (128, 64))
        if step == 0:
            param.grad[0, 0] = 1e21
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a refresh from an overflowing sketch
            optimizer.step()
        assert torch.isfinite(param).all(), f"step {step}"
    assert (param.detach() != 0).all()


def test_an_all_zero_gradient_at_a_refresh_keeps_the_basis_and_the_moments() -> None:
    """Set-to-zero gradients (zero_grad(set_to_none=False), a layer unused that step) at a
    refresh: the basis and the rotated moments stay; the update is the moments' decay."""
    torch.manual_seed(0)
    param = torch.randn(64, 96, requires_grad=True)
    optimizer = GaLoreAdamW([{"params": [param], "rank": 8, "update_proj_gap": 3}], lr=1e-3, stagger=False)
    step_on_gradients([param], optimizer, range(3))
    state = optimizer.state[param]
    basis, first_moment = state["basis_left"].clone(), state["exp_avg"].clone()
    param.grad = torch.zeros(64, 96)
    message = "all-zero gradient at a projection refresh; keeping the old basis"
    with pytest.warns(RuntimeWarning, match=message):
        optimizer.step()
    assert torch.equal(state["basis_left"], basis)
    torch.testing.assert_close(state["exp_avg"], 0.9 * first_moment)


def test_an_all_zero_gradient_does_not_stop_a_fully_projected_matrix_from_learning() -> None:
    torch.manual_seed(0)
    param = torch.randn(64, 96, requires_grad=True)
    optimizer = GaLoreAdamW(
        [{"params": [param], "rank": 8, "update_proj_gap": 2, "proj_type": "full"}],
        lr=1e-3,
        weight_decay=0.0,
        stagger=False,
    )
    step_on_gradients([param], optimizer, range(2))
    param.grad = torch.zeros(64, 96)
    with pytest.warns(RuntimeWarning, match="all-zero gradient"):
        optimizer.step()
    assert optimizer.state[param]["basis_right"].abs().sum() > 0
    before = param.detach().clone()
    param.grad = gradient(3, (64, 96))
    optimizer.step()
    assert (param.detach() - before).abs().max() > 1e-5  # a zero right factor would leave it as is


def test_an_all_zero_first_gradient_waits_for_a_real_one() -> None:
    param = torch.randn(64, 96, requires_grad=True)
    optimizer = GaLoreAdamW([{"params": [param], "rank": 8}], lr=1e-3)
    param.grad = torch.zeros(64, 96)
    with pytest.warns(RuntimeWarning, match="no projection basis could be computed yet"):
        optimizer.step()
    assert optimizer.state[param]["nonfinite_skips"] == 0  # nothing was non-finite
    param.grad = gradient(0, (64, 96))
    optimizer.step()
    basis = optimizer.state[param]["basis_left"]
    exact = torch.linalg.svd(gradient(0, (64, 96)), full_matrices=False).U[:, :8]
    # The basis spans the gradient's top subspace: projecting onto it keeps exact's columns.
    assert torch.linalg.matrix_norm(basis.T @ exact) ** 2 > 8 * 0.99


def test_stochastic_bf16_rounding_is_unbiased_as_torchao_checks_it() -> None:
    """torchao's test of its bf16 stochastic rounding, with its tolerance."""
    from slimopt.codecs.plain import round_to_bf16_stochastically

    x = torch.rand(32) * 100
    rounded = round_to_bf16_stochastically(x.view(-1, 1).repeat(1, 100_000), torch.Generator().manual_seed(0))
    torch.testing.assert_close(rounded.float().mean(1), x, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("states", ["fp32", "int8"])
def test_bf16_parameters_keep_updates_smaller_than_their_rounding_step(states) -> None:
    """An AdamW step of lr = 1e-3 on weights of 1.0 (bf16 spacing 2⁻⁷): rounded to nearest it is
    lost every time; rounded stochastically the mean follows the fp32 trajectory."""
    runs = {}
    for rounding in ("nearest", "stochastic"):
        param = torch.ones(64, 128, dtype=torch.bfloat16, requires_grad=True)
        optimizer = GaLoreAdamW([param], lr=1e-3, weight_decay=0.0, states=states, param_rounding=rounding)
        for _ in range(10):
            param.grad = torch.ones_like(param)
            optimizer.step()
        runs[rounding] = param.detach().float()
    assert torch.equal(runs["nearest"], torch.ones(64, 128))
    # fp32 AdamW with a constant gradient moves every weight by exactly lr per step.
    spacing, draws = 2.0**-7, 64 * 128
    standard_error = spacing * 10**0.5 / 2 / draws**0.5
    assert abs(runs["stochastic"].mean().item() - (1 - 10 * 1e-3)) < 5 * standard_error


def test_stochastic_parameter_rounding_resumes_exactly() -> None:
    def train(optimizer, param, steps, start=0):
        for step in range(start, start + steps):
            param.grad = gradient(step, param.shape).bfloat16()
            optimizer.step()

    torch.manual_seed(0)
    initial = torch.randn(96, 64).bfloat16()
    options = {"lr": 1e-3, "param_rounding": "stochastic", "states": "ternary"}
    uninterrupted = initial.clone().requires_grad_()
    train(GaLoreAdamW([{"params": [uninterrupted], "rank": 16}], **options), uninterrupted, 6)
    first = initial.clone().requires_grad_()
    optimizer = GaLoreAdamW([{"params": [first], "rank": 16}], **options)
    train(optimizer, first, 3)
    resumed = first.detach().clone().requires_grad_()
    again = GaLoreAdamW([{"params": [resumed], "rank": 16}], **options)
    again.load_state_dict(optimizer.state_dict())
    train(again, resumed, 3, start=3)
    assert torch.equal(uninterrupted, resumed)


@pytest.mark.parametrize(
    ("dtype", "value", "message"),
    [
        (torch.bfloat16, "up", "unknown param_rounding 'up'; valid: nearest, stochastic"),
        (torch.float16, "stochastic", r"rounds to bf16, but parameters \[\(4, 4\)\] are float16"),
    ],
)
def test_bad_param_rounding(dtype, value, message) -> None:
    with pytest.raises(ValueError, match=message):
        GaLoreAdamW([torch.zeros(4, 4, dtype=dtype, requires_grad=True)], param_rounding=value)
