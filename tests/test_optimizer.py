"""Optimizer shell behaviour: refresh schedule, non-finite input, shapes, dtypes, closures."""

from __future__ import annotations

import pytest
import torch

import slimopt
import slimopt.projection
import slimopt.rules
from slimopt import GaLoreAdafactor, GaLoreAdamW


def projected_optimizer(params, cls=GaLoreAdamW, **options):
    return cls([{"params": params, "rank": 2, "update_proj_gap": 4}], lr=1e-2, **options)


def test_nan_gradient_skips_the_update_keeps_the_basis_and_warns() -> None:
    weight = torch.randn(8, 6, requires_grad=True)
    bias = torch.randn(6, requires_grad=True)
    optimizer = GaLoreAdamW(
        [{"params": [weight], "rank": 2, "update_proj_gap": 1}, {"params": [bias]}], lr=1e-2
    )
    weight.grad, bias.grad = torch.randn(8, 6), torch.randn(6)
    optimizer.step()
    basis = optimizer.state[weight]["basis_right"].clone()
    before = weight.detach().clone(), bias.detach().clone()
    weight.grad = torch.full((8, 6), float("nan"))
    bias.grad = torch.tensor([float("inf")] * 6)
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        optimizer.step()
    assert torch.equal(weight, before[0]) and torch.equal(bias, before[1])
    assert torch.equal(optimizer.state[weight]["basis_right"], basis)
    assert optimizer.state[weight]["nonfinite_skips"] == 1 and optimizer.state[bias]["nonfinite_skips"] == 1
    assert optimizer.state[weight]["step"] == 1
    weight.grad, bias.grad = torch.randn(8, 6), torch.randn(6)
    optimizer.step()
    assert torch.isfinite(weight).all() and not torch.equal(weight, before[0])


def test_failed_decomposition_keeps_the_old_basis(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(8, 6, requires_grad=True)
    optimizer = GaLoreAdamW([{"params": [weight], "rank": 2, "update_proj_gap": 1}], lr=1e-2)
    weight.grad = torch.randn(8, 6)
    optimizer.step()
    basis = optimizer.state[weight]["basis_right"].clone()

    def broken(*args, **kwargs):
        raise torch.linalg.LinAlgError("did not converge")

    monkeypatch.setattr(slimopt.projection, "compute_basis", broken)
    with pytest.warns(RuntimeWarning, match="did not converge"):
        optimizer.step()
    assert torch.equal(optimizer.state[weight]["basis_right"], basis)
    assert torch.isfinite(weight).all() and optimizer.state[weight]["step"] == 2


def refresh_steps(optimizer: GaLoreAdamW, params: list[torch.Tensor], steps: int) -> list[set[int]]:
    """For each parameter, the steps at which its basis changed."""
    changes: list[set[int]] = [set() for _ in params]
    previous: list[torch.Tensor | None] = [None] * len(params)
    for step in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
        for i, p in enumerate(params):
            basis = optimizer.state[p]["basis_right"]
            if previous[i] is None or not torch.equal(basis, previous[i]):
                changes[i].add(step)
            previous[i] = basis.clone()
    return changes


def test_staggered_refreshes_spread_over_the_gap() -> None:
    torch.manual_seed(0)
    params = [torch.randn(10, 8, requires_grad=True) for _ in range(4)]
    optimizer = GaLoreAdamW([{"params": params, "rank": 2, "update_proj_gap": 8}], lr=1e-2, stagger=True)
    changes = refresh_steps(optimizer, params, 17)
    assert changes == [{0, 8, 16}, {0, 2, 10}, {0, 4, 12}, {0, 6, 14}]
    optimizer = GaLoreAdamW([{"params": params, "rank": 2, "update_proj_gap": 8}], lr=1e-2, stagger=False)
    assert refresh_steps(optimizer, params, 17) == [{0, 8, 16}] * 4


def test_conv_kernels_are_flattened_and_vectors_never_projected() -> None:
    kernel = torch.randn(16, 3, 3, 3, requires_grad=True)
    bias = torch.randn(16, requires_grad=True)
    optimizer = projected_optimizer([kernel, bias])
    kernel.grad, bias.grad = torch.randn_like(kernel), torch.randn_like(bias)
    optimizer.step()
    assert optimizer.state[kernel]["basis_left"].shape == (16, 2)  # 16×27 after flattening
    assert optimizer.state[kernel]["exp_avg"].shape == (2, 27)
    assert "basis_left" not in optimizer.state[bias] and "basis_right" not in optimizer.state[bias]
    assert optimizer.state[bias]["exp_avg"].shape == (16,)


@pytest.mark.parametrize("cls", [GaLoreAdamW, GaLoreAdafactor])
def test_bf16_parameters_keep_fp32_state(cls) -> None:
    weight = torch.randn(12, 10).bfloat16().requires_grad_()
    optimizer = projected_optimizer([weight], cls=cls)
    start = weight.detach().clone()
    for _ in range(3):
        weight.grad = torch.randn(12, 10).bfloat16()
        optimizer.step()
    assert weight.dtype == torch.bfloat16 and not torch.equal(weight, start)
    tensors = [v for v in optimizer.state[weight].values() if isinstance(v, torch.Tensor)]
    assert tensors and all(t.dtype == torch.float32 for t in tensors)


def test_reset_policy_zeroes_moments_and_restarts_bias_correction() -> None:
    weight = torch.randn(10, 8, requires_grad=True)
    optimizer = GaLoreAdamW(
        [{"params": [weight], "rank": 2, "update_proj_gap": 3}], lr=1e-2, on_subspace_change="reset"
    )
    for _ in range(3):
        weight.grad = torch.randn(10, 8)
        optimizer.step()
    assert optimizer.state[weight]["moment_step"] == 3
    weight.grad = torch.randn(10, 8)
    optimizer.step()  # refresh at step 3: moments restart
    state = optimizer.state[weight]
    assert state["moment_step"] == 1 and state["step"] == 4
    projected = weight.grad @ state["basis_right"].T
    torch.testing.assert_close(state["exp_avg"], 0.1 * projected)


def test_closure_is_evaluated_with_gradients_enabled() -> None:
    weight = torch.randn(6, 4, requires_grad=True)
    optimizer = projected_optimizer([weight])

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = (weight**2).sum()
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert loss.item() > 0 and optimizer.state[weight]["step"] == 1


def test_parameters_without_gradients_are_left_alone() -> None:
    used, unused = torch.randn(6, 4, requires_grad=True), torch.randn(6, 4, requires_grad=True)
    optimizer = projected_optimizer([used, unused])
    used.grad = torch.randn(6, 4)
    optimizer.step()
    assert len(optimizer.state[unused]) == 0


def _twin_steps(first, second, params_first, params_second, steps=3, seed=0):
    for step in range(steps):
        for p, q in zip(params_first, params_second, strict=True):
            grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 10 * step))
            p.grad, q.grad = grad.to(p.dtype), grad.to(q.dtype)
        first.step()
        second.step()


def test_a_group_of_another_rule_takes_that_rules_defaults() -> None:
    """``rule="adafactor"`` inside TACO and ``rule="adamw"`` inside GaLoreAdafactor used to
    raise ``KeyError`` at construction (the rule's hyperparameters were never filled in); such a
    group now steps exactly as the rule's own optimizer does."""
    from slimopt import TACO

    torch.manual_seed(0)
    weight = torch.randn(24, 16, requires_grad=True)
    twin = weight.detach().clone().requires_grad_()
    mixed = TACO([{"params": [weight], "rule": "adafactor"}], lr=1e-2)
    own = GaLoreAdafactor([twin], lr=1e-2)
    assert mixed.param_groups[0]["eps"] == own.param_groups[0]["eps"] == (1e-30, 1e-3)
    _twin_steps(mixed, own, [weight], [twin])
    assert torch.equal(weight, twin)

    weight = torch.randn(24, 16, requires_grad=True)
    twin = weight.detach().clone().requires_grad_()
    mixed = GaLoreAdafactor([{"params": [weight], "rule": "adamw", "lr": 1e-3}])
    own = GaLoreAdamW([twin], lr=1e-3, weight_decay=0.0)  # GaLoreAdafactor's weight decay
    assert mixed.param_groups[0]["eps"] == 1e-8 and mixed.param_groups[0]["betas"] == (0.9, 0.999)
    _twin_steps(mixed, own, [weight], [twin])
    assert torch.equal(weight, twin)
    with pytest.raises(ValueError, match="param group 0: lr is required: AdamW has no relative step size"):
        GaLoreAdafactor([{"params": [weight], "rule": "adamw"}])


def _twin(shape=(24, 16)):
    torch.manual_seed(0)
    weight = torch.randn(shape, requires_grad=True)
    return weight, weight.detach().clone().requires_grad_()


@pytest.mark.parametrize(
    ("make", "reference"),
    [
        (lambda p: GaLoreAdamW(p, rule="lion"), lambda p: GaLoreAdamW([{"params": p, "rule": "lion"}])),
        (
            lambda p: slimopt.AdamWTernary(p, rule="lion"),
            lambda p: slimopt.AdamWTernary([{"params": p, "rule": "lion"}]),
        ),
        (lambda p: GaLoreAdafactor(p, lr=1e-3, rule="adamw"), lambda p: GaLoreAdamW(p, weight_decay=0.0)),
        (
            lambda p: GaLoreAdamW(p, lr=None, rule="adafactor"),
            lambda p: GaLoreAdafactor(p, weight_decay=1e-2),
        ),
    ],
    ids=["galore-lion", "ternary-lion", "adafactor-adamw", "adamw-adafactor"],
)
def test_a_constructor_rule_takes_that_rules_defaults(make, reference) -> None:
    """A constructor's ``rule`` used to keep the class's own hyperparameters (Lion at AdamW's
    betas, or at the ternary optimizer's 0.7) or to raise ``KeyError``: it fills what the caller
    left out from that rule's defaults, as a param group's ``rule`` does, and keeps the class's
    ``lr`` and ``weight_decay``."""
    weight, twin = _twin()
    ours, theirs = make([weight]), reference([twin])
    rule = ours.param_groups[0]["rule"]
    keys = {"lr", "weight_decay", *slimopt.rules.RULES[rule].defaults}
    assert {k: ours.param_groups[0][k] for k in keys} == {k: theirs.param_groups[0][k] for k in keys}
    _twin_steps(ours, theirs, [weight], [twin])
    assert torch.equal(weight, twin)


def test_a_constructor_rule_keeps_what_the_caller_gave() -> None:
    """Given hyperparameters stay, even when they equal the class's own defaults; a group that
    names the class's own rule under a constructor ``rule`` takes that rule's defaults."""
    weight, other = _twin()
    optimizer = GaLoreAdamW(
        [{"params": [weight]}, {"params": [other], "rule": "adamw"}], rule="lion", betas=(0.9, 0.999)
    )
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    plain = GaLoreAdamW([{"params": [weight]}, {"params": [other], "rule": "adamw"}], rule="lion")
    assert plain.param_groups[0]["betas"] == (0.9, 0.99) and plain.param_groups[1]["betas"] == (0.9, 0.999)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    built = slimopt.build_optimizer(model, "adafactor", lr=1e-3, rule="adamw")
    assert built.param_groups[0]["betas"] == (0.9, 0.999) and built.param_groups[0]["eps"] == 1e-8


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_optimizer_steps_as_the_original(how) -> None:
    """``copy.deepcopy`` and pickle (``torch.save(optimizer)``) keep only torch.optim's
    attributes; the copy used to fail with ``AttributeError: _decisions`` at ``step()``."""
    import copy
    import pickle

    torch.manual_seed(0)
    params = [torch.randn(32, 24, requires_grad=True), torch.randn(24, requires_grad=True)]
    optimizer = GaLoreAdamW([{"params": params[:1], "rank": 4}, {"params": params[1:]}], states="int8")
    _twin_steps(optimizer, optimizer, params, params, steps=1)
    copied = (
        copy.deepcopy((params, optimizer))
        if how == "deepcopy"
        else pickle.loads(pickle.dumps((params, optimizer)))
    )
    copied_params, copied_optimizer = copied
    _twin_steps(optimizer, copied_optimizer, params, copied_params, steps=3, seed=5)
    for p, q in zip(params, copied_params, strict=True):
        assert torch.equal(p, q)
    assert copied_optimizer.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()
