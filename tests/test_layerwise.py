"""Layer-wise mode against the stepping optimizer it wraps, and its accumulation, clipping,
schedule, checkpoints and bad input."""

from __future__ import annotations

import io

import pytest
import torch

import slimopt
from slimopt.projection import projected_shape
from tests.conftest import tiny_llama

STEPS = 20


def _batches(tokens: torch.Tensor, count: int, size: int = 4, seq: int = 32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(tokens) - seq, (count, size), generator=generator)
    return [torch.stack([tokens[s : s + seq] for s in row]) for row in starts]


def _optimizer(model: torch.nn.Module, name: str, **options) -> slimopt.SlimoptOptimizer:
    # A short gap with staggering: matrices refresh on different steps within the run.
    projection = {"rank": 8, "update_proj_gap": 5} if name.startswith("galore") else {}
    return slimopt.build_optimizer(model, name, lr=3e-3, **{**projection, **options})


def _backward(model: torch.nn.Module, batch: torch.Tensor, k: int) -> None:
    (model(input_ids=batch, labels=batch).loss / k).backward()


def _stepping(tokens, name, k, *, reverse=False, clip=None, schedule=None, dtype=torch.float32, **options):
    """Parameters after STEPS optimizer steps of the ordinary loop (backward × k, step)."""
    model = tiny_llama().to(dtype)
    optimizer = _optimizer(model, name, **options)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule) if schedule else None
    data = _batches(tokens, STEPS * k)
    for step in range(STEPS):
        for i in reversed(range(k)) if reverse else range(k):
            _backward(model, data[step * k + i], k)
        if clip is not None:
            for param in model.parameters():
                torch.nn.utils.clip_grad_norm_([param], clip)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler:
            scheduler.step()
    return [p.detach().float() for p in model.parameters()]


def _layerwise(tokens, name, k, *, clip=None, schedule=None, dtype=torch.float32, **options):
    model = tiny_llama().to(dtype)
    optimizer = _optimizer(model, name, **options)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule) if schedule else None
    data = _batches(tokens, STEPS * k)
    with slimopt.layerwise(optimizer, k, max_grad_norm=clip, scheduler=scheduler) as handle:
        for batch in data:
            _backward(model, batch, k)
        assert handle.optimizer_steps == STEPS
        assert all(p.grad is None for p in model.parameters())
    return [p.detach().float() for p in model.parameters()]


def _distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return sum(float((x - y).norm() ** 2) for x, y in zip(a, b, strict=True)) ** 0.5


NAMES = ["adamw", "galore_adamw", "galore_adamw8bit", "galore_adamw_ternary", "muon8bit", "galore_muon"]


@pytest.mark.parametrize("name", NAMES)
def test_without_accumulation_layerwise_equals_stepping(shakespeare_tokens, name):
    reference = _stepping(shakespeare_tokens, name, 1)
    for ours, theirs in zip(_layerwise(shakespeare_tokens, name, 1), reference, strict=True):
        assert torch.equal(ours, theirs)


def test_muons_fused_step_layerwise_equals_stepping(shakespeare_tokens):
    """Layer-wise, each matrix takes Muon's fused step alone, where a step batches those of one
    shape: the same bits."""
    reference = _stepping(shakespeare_tokens, "muon8bit", 1, fused=True)
    for ours, theirs in zip(
        _layerwise(shakespeare_tokens, "muon8bit", 1, fused=True), reference, strict=True
    ):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", NAMES)
def test_with_accumulation_layerwise_matches_stepping(shakespeare_tokens, name):
    """With k = 4 a projected matrix sums projected micro-batch gradients, P(g1) + … + P(g4),
    where the stepping optimizer projects the sum; the two differ by fp32 rounding. The bound is
    how far the stepping optimizer itself moves when the same micro-batches are summed in the
    reverse order, a change of the same (rounding) size: tiny for fp32 states, one quantization
    code here and there for int8, and the chaotic spread of stochastic rounding for ternary."""
    reference = _stepping(shakespeare_tokens, name, 4)
    ours = _layerwise(shakespeare_tokens, name, 4)
    if name == "adamw":  # nothing is projected: the very same sums
        assert all(torch.equal(a, b) for a, b in zip(ours, reference, strict=True))
        return
    rounding_spread = _distance(_stepping(shakespeare_tokens, name, 4, reverse=True), reference)
    moved = _distance(reference, [p.detach() for p in tiny_llama().parameters()])
    assert _distance(ours, reference) <= 2 * rounding_spread + 1e-6 * moved


def test_bf16_model_accumulates_in_bf16_within_the_rounding_of_bf16_grad_accumulation(shakespeare_tokens):
    """A bf16 model's buffers are bf16 between micro-batches, as its .grad would be; the result
    stays within the spread that the order of bf16 .grad accumulation itself causes."""
    reference = _stepping(shakespeare_tokens, "galore_adamw", 4, dtype=torch.bfloat16)
    ours = _layerwise(shakespeare_tokens, "galore_adamw", 4, dtype=torch.bfloat16)
    spread = _distance(
        _stepping(shakespeare_tokens, "galore_adamw", 4, reverse=True, dtype=torch.bfloat16), reference
    )
    assert 0 < _distance(ours, reference) <= 2 * spread
    model = tiny_llama().to(torch.bfloat16)
    optimizer = _optimizer(model, "galore_adamw")
    with slimopt.layerwise(optimizer, 2, refresh_from="micro_batch") as handle:
        first, second = _batches(shakespeare_tokens, 2)
        _backward(model, first, 2)
        assert {b.dtype for b in handle.accumulation_buffers.values()} == {torch.bfloat16}
        _backward(model, second, 2)


def test_projected_matrices_accumulate_in_rank_r_buffers(shakespeare_tokens):
    model = tiny_llama()
    optimizer = _optimizer(model, "galore_adamw8bit", update_proj_gap=50)
    data = _batches(shakespeare_tokens, 8)
    projected = optimizer.param_groups[0]["params"]
    with slimopt.layerwise(optimizer, 4) as handle:
        for batch in data[:4]:  # step 1 refreshes every basis from the whole gradient
            _backward(model, batch, 4)
        state_bytes = slimopt.state_nbytes(optimizer)
        _backward(model, data[4], 4)
        buffers = handle.accumulation_buffers
        assert set(buffers) == set(projected)
        for param, buffer in buffers.items():
            basis = optimizer.engine.basis(param, optimizer.param_groups[0])
            assert buffer.shape == projected_shape(param.shape, basis) and buffer.dtype == torch.float32
            assert min(buffer.shape) == 8 and param.grad is None
        unprojected = [p for g in optimizer.param_groups[1:] for p in g["params"]]
        assert all(p.grad is not None for p in unprojected)  # accumulate as usual
        assert slimopt.state_nbytes(optimizer) == state_bytes
        with pytest.raises(RuntimeError, match="micro-batch 1 of 4"):
            optimizer.state_dict()
        for batch in data[5:8]:
            _backward(model, batch, 4)
        assert not handle.accumulation_buffers and handle.optimizer_steps == 2
        assert all(p.grad is None for p in model.parameters())


def test_refresh_from_micro_batch_never_keeps_a_projected_gradient_whole(shakespeare_tokens):
    """The first step computes every basis; with refresh_from="micro_batch" it does so from the
    first micro-batch's gradient, which is the one the stepping optimizer would see alone."""
    data = _batches(shakespeare_tokens, 4)
    reference = tiny_llama()
    stepping = _optimizer(reference, "galore_adamw8bit")
    _backward(reference, data[0], 4)
    stepping.step()
    model = tiny_llama()
    optimizer = _optimizer(model, "galore_adamw8bit")
    projected = optimizer.param_groups[0]["params"]
    with slimopt.layerwise(optimizer, 4, refresh_from="micro_batch") as handle:
        _backward(model, data[0], 4)
        assert set(handle.accumulation_buffers) == set(projected)
        assert all(p.grad is None for p in projected)
        for param, theirs in zip(projected, stepping.param_groups[0]["params"], strict=True):
            group = optimizer.param_groups[0]
            ours = optimizer.engine.basis(param, group)
            assert all(
                torch.equal(a, b)
                for a, b in zip(ours, stepping.engine.basis(theirs, stepping.param_groups[0]), strict=True)
                if a is not None
            )
            assert handle.accumulation_buffers[param].shape == projected_shape(param.shape, ours)
        for batch in data[1:]:
            _backward(model, batch, 4)
        assert handle.optimizer_steps == 1 and not handle.pending


def test_refresh_from_micro_batch_matches_stepping_when_micro_batches_agree(shakespeare_tokens):
    """When a step's micro-batches are one batch repeated, its first micro-batch's gradient spans
    the step's subspace: the run must then follow the stepping optimizer on that batch, within
    the rounding that summing four quarter-gradients brings (refresh_from="step" as the bound)."""
    data = [batch for batch in _batches(shakespeare_tokens, STEPS) for _ in range(4)]

    def run(refresh_from: str) -> list[torch.Tensor]:
        model = tiny_llama()
        with slimopt.layerwise(_optimizer(model, "galore_adamw"), 4, refresh_from=refresh_from):
            for batch in data:
                _backward(model, batch, 4)
        return [p.detach().clone() for p in model.parameters()]

    reference = _stepping(shakespeare_tokens, "galore_adamw", 1)
    rounding = _distance(run("step"), reference)
    moved = _distance(reference, [p.detach() for p in tiny_llama().parameters()])
    assert _distance(run("micro_batch"), reference) <= 2 * rounding + 1e-6 * moved


def test_per_tensor_clipping_equals_torch_clip_of_each_tensor(shakespeare_tokens):
    reference = _stepping(shakespeare_tokens, "adamw", 2, clip=0.05)
    ours = _layerwise(shakespeare_tokens, "adamw", 2, clip=0.05)
    assert all(torch.equal(a, b) for a, b in zip(ours, reference, strict=True))


def test_clipping_bounds_what_the_rule_sees_under_projection(shakespeare_tokens):
    """A loss spike (gradients × 1e4) would fill the first moment; clipped, its norm stays below
    the bound, since it is an average of clipped gradients."""
    data = _batches(shakespeare_tokens, 6)

    def first_moment_norms(clip):
        model = tiny_llama()
        optimizer = _optimizer(model, "galore_adamw")
        with slimopt.layerwise(optimizer, 1, max_grad_norm=clip):
            for i, batch in enumerate(data):
                loss = model(input_ids=batch, labels=batch).loss
                (loss * (1e4 if i == 3 else 1.0)).backward()
        return [float(optimizer.state[p]["exp_avg"].norm()) for p in optimizer.param_groups[0]["params"]]

    assert max(first_moment_norms(None)) > 10
    assert max(first_moment_norms(0.5)) <= 0.5 * (1 + 1e-5)


@pytest.mark.filterwarnings("error::UserWarning")  # and never warns that it steps before the optimizer
def test_schedule_steps_once_per_optimizer_step(shakespeare_tokens):
    def schedule(step):
        return 1.0 / (1 + step)

    reference = _stepping(shakespeare_tokens, "adamw", 4, schedule=schedule)
    ours = _layerwise(shakespeare_tokens, "adamw", 4, schedule=schedule)
    assert all(torch.equal(a, b) for a, b in zip(ours, reference, strict=True))


def test_resume_from_state_dict_is_bit_exact(shakespeare_tokens):
    data = _batches(shakespeare_tokens, 16)
    name = "galore_adamw_ternary"  # stochastic rounding and refreshes within the run

    def train(model, optimizer, batches):
        with slimopt.layerwise(optimizer, 2):
            for batch in batches:
                _backward(model, batch, 2)

    model = tiny_llama()
    optimizer = _optimizer(model, name)
    train(model, optimizer, data)
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    model = tiny_llama()
    optimizer = _optimizer(model, name)
    train(model, optimizer, data[:6])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model = tiny_llama(seed=1)
    model.load_state_dict(saved["model"])
    optimizer = _optimizer(model, name)
    optimizer.load_state_dict(saved["optimizer"])
    train(model, optimizer, data[6:])
    assert all(torch.equal(a, b.detach()) for a, b in zip(uninterrupted, model.parameters(), strict=True))


def test_step_ends_a_partial_accumulation_and_is_a_no_op_at_a_boundary(shakespeare_tokens):
    """As Trainer does at the end of an epoch: 3 micro-batches of an accumulation of 4, then
    optimizer.step(), equal the stepping optimizer after those 3 backward passes."""
    data = _batches(shakespeare_tokens, 3)
    model = tiny_llama()
    optimizer = _optimizer(model, "adamw")
    for batch in data:
        _backward(model, batch, 4)
    optimizer.step()
    reference = [p.detach().clone() for p in model.parameters()]

    model = tiny_llama()
    optimizer = _optimizer(model, "adamw")
    handle = slimopt.layerwise(optimizer, 4)
    for batch in data:
        _backward(model, batch, 4)
    optimizer.step()
    assert handle.optimizer_steps == 1 and handle.micro_step == 0 and not handle.pending
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference, strict=True))
    optimizer.step()  # at a boundary: nothing happens
    assert handle.optimizer_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference, strict=True))
    with pytest.raises(RuntimeError, match="closure"):
        optimizer.step(lambda: 0.0)
    with pytest.raises(RuntimeError, match="already in layer-wise mode"):
        slimopt.layerwise(optimizer)
    handle.remove()
    _backward(model, data[0], 1)
    assert all(p.grad is not None for p in model.parameters())
    optimizer.step()
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), reference, strict=True))


def test_last_grad_norm_is_the_global_norm_before_clipping(shakespeare_tokens):
    model = tiny_llama()
    batch = _batches(shakespeare_tokens, 1)[0]
    _backward(model, batch, 1)
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    model.zero_grad()
    optimizer = _optimizer(model, "adamw")
    with slimopt.layerwise(optimizer, max_grad_norm=1e-3) as handle:
        _backward(model, batch, 1)
        assert float(handle.last_grad_norm) == pytest.approx(float(expected), rel=1e-5)


def test_remove_mid_accumulation_warns_and_drops(shakespeare_tokens):
    model = tiny_llama()
    optimizer = _optimizer(model, "adamw")
    handle = slimopt.layerwise(optimizer, 2)
    _backward(model, _batches(shakespeare_tokens, 1)[0], 2)
    with pytest.warns(RuntimeWarning, match="1 of 2 micro-batches"):
        handle.remove()
    assert all(p.grad is None for p in model.parameters())


def test_bad_input_fails_at_construction():
    model = tiny_llama()
    optimizer = _optimizer(model, "galore_adamw")
    with pytest.raises(TypeError, match="needs a slimopt optimizer"):
        slimopt.layerwise(torch.optim.AdamW(model.parameters()))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="accumulation_steps must be a positive integer"):
            slimopt.layerwise(optimizer, bad)
    with pytest.raises(ValueError, match="max_grad_norm"):
        slimopt.layerwise(optimizer, max_grad_norm=0)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="scheduler of this optimizer"):
        slimopt.layerwise(optimizer, scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    with pytest.raises(TypeError, match="ReduceLROnPlateau"):
        slimopt.layerwise(optimizer, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer))
    with pytest.raises(ValueError, match="unknown refresh_from 'first'; valid: step, micro_batch"):
        slimopt.layerwise(optimizer, refresh_from="first")
    assert optimizer.layerwise_handle is None


def test_groups_replaced_by_load_state_dict_are_the_ones_used(shakespeare_tokens):
    """accelerate.prepare and a resume call load_state_dict after the hooks exist; the updates
    must then read the new groups (their learning rate), not the replaced ones."""
    model = tiny_llama()
    optimizer = _optimizer(model, "adamw")
    start = [p.detach().clone() for p in model.parameters()]
    with slimopt.layerwise(optimizer):
        state = optimizer.state_dict()
        state["param_groups"] = [{**g, "lr": 0.0} for g in state["param_groups"]]
        optimizer.load_state_dict(state)
        _backward(model, _batches(shakespeare_tokens, 1)[0], 1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), start, strict=True))


def _train_with_a_late_layer(tokens, layer_wise: bool, change: str) -> dict[str, torch.Tensor]:
    """10 steps; the second layer's MLP joins at step 5, by add_param_group or by unfreezing."""
    model = tiny_llama()
    late = list(model.model.layers[1].mlp.parameters())
    if change == "add_param_group":
        for param in late:
            param.requires_grad_(False)
    optimizer = _optimizer(model, "galore_adamw")
    if change == "unfreeze":
        for param in late:
            param.requires_grad_(False)
    handle = slimopt.layerwise(optimizer) if layer_wise else None
    for step, batch in enumerate(_batches(tokens, 10)):
        if step == 5:
            for param in late:
                param.requires_grad_(True)
            if change == "add_param_group":
                optimizer.add_param_group({"params": late, "rank": 8, "update_proj_gap": 5})
        _backward(model, batch, 1)
        if handle is None:
            optimizer.step()
            optimizer.zero_grad()
    assert all(param.grad is None for param in model.parameters())
    return {name: param.detach().clone() for name, param in model.named_parameters()}


@pytest.mark.parametrize("change", ["add_param_group", "unfreeze"])
def test_parameters_added_or_unfrozen_later_are_trained(shakespeare_tokens, change):
    stepping = _train_with_a_late_layer(shakespeare_tokens, False, change)
    layer_wise = _train_with_a_late_layer(shakespeare_tokens, True, change)
    for name, value in stepping.items():
        assert torch.equal(value, layer_wise[name]), name
    initial = dict(tiny_llama().named_parameters())["model.layers.1.mlp.gate_proj.weight"]
    assert not torch.equal(layer_wise["model.layers.1.mlp.gate_proj.weight"], initial)
