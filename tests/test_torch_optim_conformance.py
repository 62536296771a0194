"""torch.optim's generic optimizer contract (PyTorch's ``test/test_optim.py``, the tests every
``OptimizerInfo`` of ``common_optimizers.py`` runs), re-expressed for every configuration of
``tests/configurations.py``. Where slimopt deliberately differs (flags it refuses, complex
parameters where no exact update exists, sparse gradients) the test asserts the documented error
instead; docs/conformance.md lists them."""

from __future__ import annotations

import copy
import gc
import io
import weakref

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from slimopt.registry import OPTIMIZERS
from slimopt.rules import MuonRule

from .configurations import CONFIGURATIONS, Configuration, batch, loss_of, train
from .support import relative_error

EVERY = [pytest.param(c, id=c.label) for c in CONFIGURATIONS]
# A deliberate difference from torch.optim: the test asserts slimopt's documented error.
deliberate = pytest.mark.deliberate
every_configuration = pytest.mark.parametrize("configuration", EVERY)
pytestmark = [
    # The rank of 32 on 64-wide matrices saves no state; the point here is the contract.
    pytest.mark.filterwarnings("ignore:rank 32 saves no optimizer state"),
    # An all-zero gradient finds no basis: the step is skipped with a warning (tested).
    pytest.mark.filterwarnings("ignore:slimopt.*no projection basis"),
]


def _parameters(net: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _roundtrip(state_dict: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@every_configuration
def test_it_is_printed_like_a_torch_optimizer(configuration: Configuration) -> None:
    optimizer = configuration.build(configuration.net())
    text = repr(optimizer)
    assert text.startswith(type(optimizer).__name__ + " (") and "Parameter Group 0" in text
    assert "lr: " in text


@every_configuration
def test_it_goes_the_right_direction(configuration: Configuration) -> None:
    net = configuration.net()
    losses = train(net, configuration.build(net), range(20))
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert sum(losses[-3:]) / 3 < 0.9 * losses[0]


@every_configuration
def test_a_tensor_lr_gives_what_a_float_lr_gives(configuration: Configuration) -> None:
    runs = []
    for lr in (configuration.lr, torch.tensor(configuration.lr)):
        net = configuration.net()
        optimizer = configuration.build(net, lr=lr)
        train(net, optimizer, range(5))
        runs.append(_parameters(net))
    if isinstance(OPTIMIZERS[configuration.name].cls.rule, MuonRule):
        # Muon's iteration runs in bf16, as torch's does: the AdamW groups' tensor-lr update,
        # rounded in another order, changes a last bit that turns into other bf16 values.
        assert relative_error(runs[0], runs[1]) < 1e-3
        return
    for ours, theirs in zip(*runs, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


@every_configuration
@pytest.mark.parametrize("scheduler", ["step", "exponential", "one_cycle", "plateau", "lambda"])
def test_lr_schedulers_drive_it(configuration: Configuration, scheduler: str) -> None:
    """A scheduler changes each group's lr (OneCycleLR also cycles AdamW's betas[0]) and the
    optimizer trains with what the scheduler set."""
    net = configuration.net()
    optimizer = configuration.build(net)
    schedulers = torch.optim.lr_scheduler
    make = {
        "step": lambda: schedulers.StepLR(optimizer, step_size=2, gamma=0.5),
        "exponential": lambda: schedulers.ExponentialLR(optimizer, gamma=0.8),
        "one_cycle": lambda: schedulers.OneCycleLR(
            optimizer, max_lr=configuration.lr, total_steps=10, cycle_momentum=configuration.adam_like
        ),
        "plateau": lambda: schedulers.ReduceLROnPlateau(optimizer, patience=0, factor=0.5),
        "lambda": lambda: schedulers.LambdaLR(optimizer, lambda step: 1 / (1 + step)),
    }
    schedule = make[scheduler]()
    lrs, betas = [], []
    for step in range(8):
        loss = train(net, optimizer, range(step, step + 1))[0]
        if scheduler == "plateau":
            schedule.step(loss)
        else:
            schedule.step()
        lrs.append(optimizer.param_groups[0]["lr"])
        betas.append(optimizer.param_groups[0].get("betas", (None,))[0])
    assert len(set(lrs)) > 1 and all(torch.isfinite(p).all() for p in net.parameters())
    if scheduler == "one_cycle" and configuration.adam_like:
        assert len(set(betas)) > 1


@every_configuration
def test_hooks_around_step_run_in_torch_order(configuration: Configuration) -> None:
    net = configuration.net()
    optimizer = configuration.build(net)
    calls: list[str] = []
    handles = [
        register_optimizer_step_pre_hook(lambda *_: calls.append("global pre")),
        register_optimizer_step_post_hook(lambda *_: calls.append("global post")),
        optimizer.register_step_pre_hook(lambda *_: calls.append("pre")),
        optimizer.register_step_post_hook(lambda *_: calls.append("post")),
    ]
    try:
        train(net, optimizer, range(2))
    finally:
        for handle in handles:
            handle.remove()
    assert calls == ["global pre", "pre", "post", "global post"] * 2
    calls.clear()
    train(net, optimizer, range(1))
    assert calls == []


@every_configuration
def test_state_dict_and_load_state_dict_hooks(configuration: Configuration) -> None:
    net = configuration.net()
    optimizer = configuration.build(net)
    train(net, optimizer, range(2))
    seen: list[str] = []
    optimizer.register_state_dict_pre_hook(lambda opt: seen.append("save pre"))

    def add_note(opt, state_dict):
        seen.append("save post")
        state_dict["note"] = "kept"

    optimizer.register_state_dict_post_hook(add_note)
    state_dict = optimizer.state_dict()
    assert state_dict["note"] == "kept" and seen == ["save pre", "save post"]
    loader = configuration.build(configuration.net())

    def halve_lr(opt, state_dict):
        seen.append("load pre")
        state_dict = copy.deepcopy(state_dict)
        for group in state_dict["param_groups"]:
            group["lr"] = group["lr"] / 2
        return state_dict

    loader.register_load_state_dict_pre_hook(halve_lr)
    loader.register_load_state_dict_post_hook(
        lambda opt: seen.append(f"load post {opt.param_groups[0]['lr']}")
    )
    loader.load_state_dict(state_dict)
    assert seen[2:] == ["load pre", f"load post {configuration.lr / 2}"]


def _saved_whole(value: object) -> object:
    """``torch.save`` of a whole object (pickled), loaded back. (Plain ``pickle`` cannot load
    fp8 tensors back, TACO's sketch values: a torch limitation; torch.save can.)"""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@every_configuration
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_has_every_public_attribute_and_steps_alike(configuration: Configuration, how: str) -> None:
    net = configuration.net()
    optimizer = configuration.build(net)
    train(net, optimizer, range(2))
    both = (net, optimizer)
    copied_net, copied = copy.deepcopy(both) if how == "deepcopy" else _saved_whole(both)
    public = {name for name in vars(optimizer) if not name.startswith("_")}
    assert public == {name for name in vars(copied) if not name.startswith("_")}
    train(net, optimizer, range(2, 5))
    train(copied_net, copied, range(2, 5))
    assert _equal(_parameters(net), _parameters(copied_net))


@every_configuration
def test_a_closure_is_evaluated_with_gradients_and_its_loss_returned(configuration: Configuration) -> None:
    net = configuration.net()
    optimizer = configuration.build(net)

    def closure() -> torch.Tensor:
        assert torch.is_grad_enabled()
        optimizer.zero_grad()
        loss = loss_of(net, 0)
        loss.backward()
        return loss

    with torch.no_grad():
        loss = optimizer.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0


@every_configuration
def test_parameters_without_gradients_are_left_alone_and_get_no_state(configuration: Configuration) -> None:
    net = configuration.net()
    optimizer = configuration.build(net)
    before = _parameters(net)
    optimizer.step()
    assert _equal(before, _parameters(net)) and not optimizer.state
    loss_of(net, 0).backward()
    net.up.weight.grad = None
    optimizer.step()
    assert torch.equal(net.up.weight, before[0]) and net.up.weight not in optimizer.state


@every_configuration
def test_zero_gradients_without_weight_decay_change_nothing(configuration: Configuration) -> None:
    net = configuration.net()
    optimizer = configuration.build(net, weight_decay=0.0)
    for group in optimizer.param_groups:
        group["weight_decay"] = 0.0  # TACO's fallback groups too
    before = _parameters(net)
    for param in net.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    assert _equal(before, _parameters(net))
    assert optimizer.state  # a step was taken: state exists


@every_configuration
def test_zero_grad_frees_or_zeroes_gradients(configuration: Configuration) -> None:
    net = configuration.net()
    optimizer = configuration.build(net)
    loss_of(net, 0).backward()
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in net.parameters())
    optimizer.zero_grad()
    assert all(p.grad is None for p in net.parameters())


@every_configuration
def test_add_param_group_trains_the_new_group_and_refuses_a_bad_one(configuration: Configuration) -> None:
    net = configuration.net()
    head = nn.Linear(64, 64)
    optimizer = configuration.build(net)
    train(net, optimizer, range(2))
    groups = len(optimizer.param_groups)
    with pytest.raises(ValueError, match="lr"):
        optimizer.add_param_group({"params": [head.bias], "lr": -1.0})
    assert len(optimizer.param_groups) == groups
    rule = {"rule": "adamw"} if configuration.matrices_only else {}
    optimizer.add_param_group({"params": list(head.parameters()), "lr": 1e-2, **rule})
    before = head.weight.detach().clone()
    optimizer.zero_grad()
    (loss_of(net, 3) + head(batch(3)[0]).square().mean()).backward()
    optimizer.step()
    assert not torch.equal(before, head.weight) and head.weight in optimizer.state


@every_configuration
def test_groups_keep_their_own_learning_rates(configuration: Configuration) -> None:
    net = configuration.net()
    optimizer = configuration.build(net)
    frozen = optimizer.param_groups[0]
    frozen["lr"] = 0.0
    before = [p.detach().clone() for p in frozen["params"]]
    train(net, optimizer, range(3))
    # lr 0 also leaves the decoupled weight decay out: w·(1 − 0·wd)
    assert all(torch.equal(a, b) for a, b in zip(before, frozen["params"], strict=True))


@every_configuration
def test_a_loaded_state_dict_continues_bit_for_bit(configuration: Configuration) -> None:
    """torch's test_state_dict_deterministic, through torch.save and weights_only loading."""
    net = configuration.net()
    optimizer = configuration.build(net)
    train(net, optimizer, range(3))
    twin = configuration.net(seed=1)
    twin.load_state_dict(net.state_dict())
    loader = configuration.build(twin)
    loader.load_state_dict(_roundtrip(optimizer.state_dict()))
    train(net, optimizer, range(3, 7))
    train(twin, loader, range(3, 7))
    assert _equal(_parameters(net), _parameters(twin))
    _assert_same_state_dict(optimizer.state_dict(), loader.state_dict())


def _assert_same_state_dict(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for param_id, state in a["state"].items():
        assert state.keys() == b["state"][param_id].keys(), param_id
        for key, value in state.items():
            other = b["state"][param_id][key]
            same = (
                torch.equal(value, other) and value.dtype == other.dtype
                if isinstance(value, torch.Tensor)
                else value == other
            )
            assert same, (param_id, key)


def _assert_continues_alike(
    configuration: Configuration, net: nn.Module, optimizer, state_dict: dict
) -> None:
    """A copy of ``net`` with an optimizer that loads ``state_dict`` (``optimizer``'s, edited)
    takes the next two steps exactly as ``optimizer`` does."""
    twin = configuration.net(seed=1)
    twin.load_state_dict(net.state_dict())
    loader = configuration.build(twin)
    loader.load_state_dict(state_dict)
    train(net, optimizer, range(3, 5))
    train(twin, loader, range(3, 5))
    assert _equal(_parameters(net), _parameters(twin))


@every_configuration
def test_an_older_state_dict_loads_with_the_options_it_lacks(configuration: Configuration) -> None:
    """torch's test_can_load_older_state_dict: keys added to param groups since (slimopt's
    newer options) missing from the saved groups take the loading optimizer's values."""
    net = configuration.net()
    optimizer = configuration.build(net)
    train(net, optimizer, range(3))
    state_dict = _roundtrip(optimizer.state_dict())
    newer = ("param_rounding", "experts", "rule", "fused", "stagger", "basis_states")
    for group in state_dict["param_groups"]:
        for key in newer:
            group.pop(key, None)
    _assert_continues_alike(configuration, net, optimizer, state_dict)


@every_configuration
def test_a_tensor_step_loads_as_torch_optim_saves_it(configuration: Configuration) -> None:
    """torch's test_load_nontensor_step, the other way round: torch.optim keeps ``step`` as a
    0-d tensor; slimopt keeps an int, and takes either."""
    net = configuration.net()
    optimizer = configuration.build(net)
    train(net, optimizer, range(3))
    state_dict = _roundtrip(optimizer.state_dict())
    for state in state_dict["state"].values():
        for key in [k for k in state if k == "step" or k.endswith(".step")]:
            state[key] = torch.tensor(float(state[key]))
    _assert_continues_alike(configuration, net, optimizer, state_dict)


@every_configuration
def test_parameters_of_several_dtypes_in_one_optimizer(configuration: Configuration) -> None:
    """fp32, bf16 and fp64 parameters together: each keeps its dtype and trains; fp64 is
    updated in fp32 arithmetic (slimopt's arithmetic is fp32 whatever the parameter dtype)."""
    nets = {dtype: configuration.net(dtype=dtype) for dtype in (torch.float32, torch.bfloat16, torch.float64)}
    union = nn.ModuleDict({f"in_{str(dtype).split('.')[1]}": net for dtype, net in nets.items()})
    optimizer = configuration.build(union)
    first = {dtype: loss_of(net, 0).item() for dtype, net in nets.items()}
    for step in range(15):
        optimizer.zero_grad()
        sum(loss_of(net, step) for net in nets.values()).backward()
        optimizer.step()
    for dtype, net in nets.items():
        assert all(p.dtype == dtype and torch.isfinite(p).all() for p in net.parameters())
        assert loss_of(net, 15).item() < first[dtype], dtype


def _complex_weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(128, 64, dtype=torch.complex64, requires_grad=True)


@pytest.mark.parametrize("configuration", [c for c in EVERY if c.values[0].complex_ok])
def test_complex_parameters_train_as_real_pairs(configuration: Configuration) -> None:
    """torch.optim updates a complex parameter as its real pairs; so do unprojected groups of an
    elementwise rule."""
    holder = nn.Module()
    holder.register_parameter("weight", nn.Parameter(_complex_weight()))
    optimizer = configuration.build(holder, weight_decay=0.1)
    reference_weight = _complex_weight()
    reference = torch.optim.AdamW([reference_weight], lr=configuration.lr, weight_decay=0.1)
    for step in range(5):
        grad = torch.randn(128, 64, dtype=torch.complex64, generator=torch.Generator().manual_seed(step))
        holder.weight.grad, reference_weight.grad = grad.clone(), grad.clone()
        optimizer.step()
        reference.step()
    tolerance = {"adamw": 1e-6}.get(configuration.name, 5e-2)  # compressed moments: their precision
    error = (holder.weight - reference_weight).abs().max() / reference_weight.abs().max()
    assert error.item() < tolerance


@deliberate
@pytest.mark.parametrize("configuration", [c for c in EVERY if not c.values[0].complex_ok])
def test_complex_parameters_are_refused_where_no_exact_update_exists(configuration: Configuration) -> None:
    """A projection, Adafactor's factored statistics and TACO's column maxima are not defined
    for real pairs: refused at construction, naming where complex parameters can go."""
    layer = nn.Linear(64, 128)
    layer.weight = nn.Parameter(_complex_weight().detach())
    with pytest.raises(ValueError, match=r"complex parameters .* cannot be updated by"):
        configuration.build(layer)


@pytest.mark.parametrize(
    "flag",
    [
        {"amsgrad": True},
        {"maximize": True},
        {"foreach": True},
        {"capturable": True},
        {"differentiable": True},
    ],
)
@every_configuration
@deliberate
def test_torch_only_flags_are_refused_naming_the_valid_options(
    configuration: Configuration, flag: dict
) -> None:
    """Deliberate: slimopt does not compute AMSGrad or maximize, and chooses its own update
    path (``fused``); these torch.optim flags are refused, not ignored."""
    with pytest.raises(TypeError, match=f"unknown option\\(s\\) {next(iter(flag))}; valid options: rank"):
        configuration.build(configuration.net(), **flag)


@every_configuration
def test_sparse_gradients_are_refused(configuration: Configuration) -> None:
    """As torch.optim.AdamW does: the moments are dense."""
    net = configuration.net()
    optimizer = configuration.build(net)
    loss_of(net, 0).backward()
    net.norm.weight.grad = net.norm.weight.grad.to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        optimizer.step()


@pytest.mark.parametrize("configuration", EVERY)
def test_deleting_it_frees_its_state_at_once(configuration: Configuration) -> None:
    """As a torch.optim optimizer's, its state goes as soon as the last reference does, not at
    the next garbage collection: nothing in it refers back to it (on a GPU a cycle would hold
    gigabytes of moments for nothing)."""
    import torch._dynamo

    net = configuration.net()
    optimizer = configuration.build(net)
    train(net, optimizer, range(2))
    stored = [
        weakref.ref(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    gc.disable()
    try:
        del optimizer
        assert stored and all(ref() is None for ref in stored)
    finally:
        gc.enable()
