"""Muon's fused step (``fused=True``; auto mode on CUDA): same-shaped matrices in batches, their
momentum and weights in compiled loops, the Newton–Schulz iteration matrix by matrix on the CPU,
batched elsewhere, and in Triton kernels (run here in Triton's interpreter) on CUDA; against the
reference path and ``torch.optim.Muon``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import slimopt
from slimopt import kernels
from slimopt.core import update as core_update
from slimopt.core.state import SKIPS
from slimopt.rules.muon import NS_COEFFICIENTS, iterated, normalized_wide, orthogonalized

from .conftest import tiny_llama
from .support import relative_error

# Three of each shape (tall, wide, square), so that each batch holds several matrices.
SHAPES = [(64, 32), (32, 96), (48, 48)] * 3


def _train(params: list[nn.Parameter], optimizer: torch.optim.Optimizer, steps: int = 20) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()


def _matrices() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(shape)) for shape in SHAPES]


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_the_fused_step_is_the_reference_step(adjust_lr_fn: str | None, nesterov: bool) -> None:
    """With fp32 momentum, 20 fused steps end where the reference path's and torch.optim.Muon's
    do. The compiled Nesterov average may round one element's fp32 value differently (a
    contracted multiply-add), which can move the bf16 the iteration starts from by one bf16
    step; the iteration carries it into its matrix: within bf16 round-off, not bit for bit."""
    options = {"lr": 0.02, "weight_decay": 0.1, "nesterov": nesterov, "adjust_lr_fn": adjust_lr_fn}
    runs = {}
    for fused in (False, True):
        params = _matrices()
        optimizer = slimopt.Muon(params, fused=fused, **options)
        _train(params, optimizer)
        runs[fused] = params
    theirs = _matrices()
    _train(theirs, torch.optim.Muon(theirs, **options))
    assert optimizer.fused_path == ["fused"]
    assert relative_error(runs[True], runs[False]) < 2e-3
    assert relative_error(runs[True], theirs) < 2e-3
    assert relative_error(runs[False], theirs) < 1e-6


@pytest.mark.parametrize("name", ["muon8bit", "muon4bit", "muon_ternary"])
def test_low_bit_momentum_takes_the_fused_step(name: str) -> None:
    """Every stored momentum (int8 and int4 blocks, ternary codes) and bf16 weights rounded
    stochastically: the test LLaMA's matrices fused, its other parameters AdamW's fused step,
    within bf16 round-off of the reference path after 4 steps."""
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = tiny_llama().bfloat16()
        optimizer = slimopt.build_optimizer(model, name, lr=1e-2, fused=fused, param_rounding="stochastic")
        generator = torch.Generator().manual_seed(1)
        for _ in range(4):
            for param in model.parameters():
                param.grad = torch.randn(param.shape, generator=generator).bfloat16()
            optimizer.step()
        results.append([p.detach().float() for p in model.parameters()])
    assert optimizer.fused_path == ["fused"] * len(optimizer.param_groups)
    assert relative_error(results[1], results[0]) < 1e-2


@pytest.mark.parametrize(
    ("limit", "calls"),
    [(1, [1] * 9), (2**24, [3, 3, 3]), (2 * 32 * 96, [3, 2, 1, 2, 1])],
    ids=["cpu", "a-shape-per-call", "two-of-the-largest"],
)
def test_matrices_are_batched_by_shape_within_the_batch_limit(limit, calls, monkeypatch) -> None:
    """On the CPU one matrix per call; with a GPU's limit one call per shape; with a limit of two
    of the largest matrices' elements, two calls for each shape of which fewer than three fit.
    The same parameters every way."""
    counted: list[int] = []
    step = kernels.muon_step

    def counting(grads, *args, **kwargs):
        counted.append(len(grads))
        return step(grads, *args, **kwargs)

    monkeypatch.setattr(kernels, "muon_step", counting)
    monkeypatch.setitem(core_update.MUON_BATCH_ELEMENTS, "cpu", limit)
    params = _matrices()
    _train(params, slimopt.Muon(params, lr=0.02, fused=True), steps=2)
    assert sorted(counted) == sorted(calls * 2)
    reference = _matrices()
    monkeypatch.setitem(core_update.MUON_BATCH_ELEMENTS, "cpu", 1)
    _train(reference, slimopt.Muon(reference, lr=0.02, fused=True), steps=2)
    assert relative_error(params, reference) == 0


def test_a_non_finite_gradient_leaves_its_matrix_as_it_was() -> None:
    """A NaN in one matrix's gradient skips that matrix's step (weights and momentum), as the
    reference path does, also when its flag stays on the device and masks the batch's writes;
    the other matrices of its batch step as usual."""
    for flags in ((), ("cpu",)):
        params = _matrices()
        optimizer = slimopt.Muon(params, lr=0.02, fused=True)
        optimizer.engine.use_fused_policy(kernels.FusedPolicy(flags=flags))
        _train(params, optimizer, steps=2)
        before = [p.detach().clone() for p in params]
        buffer = optimizer.state[params[0]]["momentum_buffer"].clone()
        for param in params:
            param.grad = torch.randn(param.shape)
        params[0].grad[3, 4] = float("nan")
        optimizer.step()
        optimizer.state_dict()  # reads any flag left on the device
        assert torch.equal(params[0], before[0])
        assert torch.equal(optimizer.state[params[0]]["momentum_buffer"], buffer)
        assert all(not torch.equal(p, b) for p, b in zip(params[1:], before[1:], strict=True))
        assert optimizer.state[params[0]][SKIPS] == 1
        assert optimizer.state[params[1]][SKIPS] == 0


def test_stacked_experts_are_one_batch() -> None:
    """Each expert of a stacked weight is a matrix of its own: the experts orthogonalized as one
    batch, as the reference path steps them one at a time."""
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        stacked = nn.Parameter(torch.randn(4, 48, 16))
        optimizer = slimopt.Muon([{"params": [stacked], "experts": True}], lr=0.02, fused=fused)
        _train([stacked], optimizer, steps=5)
        results.append(stacked.detach().clone())
    assert relative_error(results[1], results[0]) < 2e-3


@settings(max_examples=12, deadline=None)
@example(batch=2, rows=2, columns=62, seed=567)
@example(batch=3, rows=55, columns=3, seed=22798)
@given(
    batch=st.integers(1, 4),
    rows=st.integers(1, 70),
    columns=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_a_stack_is_orthogonalized_as_each_matrix_alone(
    batch: int, rows: int, columns: int, seed: int
) -> None:
    """The batched iteration (on CUDA without Triton) gives each matrix of a stack what it gets
    alone (on the CPU, where both are measured), within the iteration's bf16 round-off: the
    batched products sum in another order, so a near-tie may round to the other bf16 neighbour,
    and the iteration carries it on (1,500 thin stacks of 1–3 rows: 20 differed, by at most
    0.95% relative; 400 stacks of any shape: none). A matrix mixed up with another, or
    normalized by the stack's norm, is off by far more."""
    stack = torch.randn(batch, rows, columns, generator=torch.Generator().manual_seed(seed))
    alone = torch.stack([orthogonalized(matrix, NS_COEFFICIENTS, 5, 1e-7) for matrix in stack])
    batched = orthogonalized(stack, NS_COEFFICIENTS, 5, 1e-7)
    for one, its_own in zip(batched.float(), alone.float(), strict=True):
        assert (one - its_own).norm() <= 2e-2 * its_own.norm()


def test_triton_products_and_iteration_in_the_interpreter() -> None:
    """The Triton kernels' products (sizes that are not multiples of a tile): each within a bf16
    rounding of the fp32 product, the symmetric ones exactly symmetric; the whole iteration
    within bf16 round-off of torch's."""
    pytest.importorskip("triton")
    from slimopt.kernels import triton_newton_schulz as triton_ns

    generator = torch.Generator().manual_seed(0)
    ortho = torch.randn(2, 70, 130, generator=generator).bfloat16()
    gram = torch.empty(2, 70, 70, dtype=torch.bfloat16)
    triton_ns.product(ortho, ortho.mT, gram, alpha=1.0, symmetric=True)
    exact = ortho.float() @ ortho.float().mT
    assert torch.equal(gram, gram.mT)
    assert ((gram.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-3).all()
    update = torch.empty_like(gram)
    triton_ns.product(gram, gram, update, alpha=2.0, beta=-3.0, added=gram, symmetric=True)
    exact = 2.0 * gram.float() @ gram.float() - 3.0 * gram.float()
    assert torch.equal(update, update.mT)
    assert ((update.float() - exact).abs() <= exact.abs().amax() * 2**-7).all()
    start = normalized_wide(torch.randn(3, 40, 100, generator=generator), 1e-7)
    ours = triton_ns.iterated(start, NS_COEFFICIENTS, 5)
    assert relative_error(ours.float(), iterated(start, NS_COEFFICIENTS, 5).float()) < 2e-2


def test_the_triton_iteration_steps_a_model_in_the_interpreter() -> None:
    """The fused step with the Triton iteration (as on CUDA), on the CPU in Triton's interpreter:
    one iteration per batch, the parameters within bf16 round-off of the reference path's."""
    pytest.importorskip("triton")
    runs = []
    for fused in (False, True):
        params = _matrices()
        optimizer = slimopt.Muon(params, lr=0.02, fused=fused)
        optimizer.engine.use_fused_policy(kernels.FusedPolicy(iteration=("cpu",)))
        _train(params, optimizer, steps=2)
        runs.append(params)
    assert relative_error(runs[1], runs[0]) < 2e-2


def test_auto_mode_takes_the_reference_path_where_muons_step_does_not_compile(monkeypatch) -> None:
    """Where auto mode fuses (CUDA; the CPU given its choices here) and Muon's step does not
    compile, fused=None trains on with the reference path, saying so once; fused=True raises."""

    def broken(*args, **kwargs):
        raise kernels.CompileFailure(lambda: None, RuntimeError("triton: no kernel for this GPU"), None)

    reference = _matrices()
    _train(reference, slimopt.Muon(reference, lr=0.02, fused=False), steps=3)
    monkeypatch.setattr(kernels, "compiler_error", lambda device_type: None)
    monkeypatch.setattr(kernels, "muon_step", broken)
    params = _matrices()
    optimizer = slimopt.Muon(params, lr=0.02)
    optimizer.engine.use_fused_policy(kernels.FusedPolicy(auto=("cuda", "cpu")))
    with pytest.warns(RuntimeWarning, match="the fused step did not compile") as warned:
        _train(params, optimizer, steps=3)
    assert len([w for w in warned if "did not compile" in str(w.message)]) == 1  # not once per batch
    assert all(torch.equal(a, b) for a, b in zip(params, reference, strict=True))
    assert optimizer.fused_path == [
        "reference (the fused step did not compile: triton: no kernel for this GPU)"
    ]
    with pytest.raises(kernels.CompileFailure):
        _train(params, slimopt.Muon(params, lr=0.02, fused=True), steps=1)
