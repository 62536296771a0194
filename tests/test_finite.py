"""Non-finite gradients decided on the device (``slimopt.finite``): the fused path masks its
writes with a flag the host reads later, and ends up where the reference path, which reads it
at once, is: the same weights, moments, step counts, skip counts and warnings."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.profiler import profile

import slimopt
from slimopt import kernels
from slimopt.finite import Decisions, decisions, finite_flags

from .conftest import FusedBackend, like_cuda
from .support import relative_error

# The fused path's decisions stay on the device on the CPU in these tests, as they do on CUDA
# (``like_cuda(..., flags=True)``), unless a test says otherwise.


def _nonfinite_run(name: str, fused: bool, dtype: torch.dtype, backend: FusedBackend, **options):
    """Five steps of a small model; step 2 gives one matrix a NaN and the bias an inf gradient,
    step 3 gives the other matrix an overflowing one (finite, but inf once squared)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 80), torch.nn.Linear(80, 72, bias=False)).to(dtype)
    built = slimopt.build_optimizer(model, name, fused=fused, **{"lr": 1e-2, **options})
    optimizer = backend.configure(built, flags=True)
    generator = torch.Generator().manual_seed(1)
    caught = []
    for step in range(5):
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator).to(dtype)
        if step == 2:
            model[0].weight.grad[3, 4] = float("nan")
            model[0].bias.grad[0] = float("inf")
        if step == 3:
            model[1].weight.grad[0, 0] = 3e38 if dtype == torch.float32 else float("inf")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            optimizer.step()
            state = optimizer.state_dict()  # settles any decision still on the device
        caught += [str(w.message) for w in seen if "non-finite" in str(w.message)]
    params = [p.detach().float().clone() for p in model.parameters()]
    counts = [(s["step"], s["moment_step"], s["nonfinite_skips"]) for s in state["state"].values()]
    return params, counts, sorted(caught), optimizer


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("adamw", {}),
        ("adamw8bit", {}),
        ("adamw_ternary", {}),
        ("galore_adamw8bit", {"rank": 8}),
        ("adafactor", {"states": "int8", "beta1": 0.9}),
        ("galore_adafactor", {"rank": 8, "lr": None}),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_fused_path_skips_on_the_device_as_the_reference_path_skips(
    name, options, dtype, fused_backend
) -> None:
    if fused_backend.name == "triton" and "adafactor" in name:
        pytest.skip("Adafactor has no Triton kernel of its own: compiled only")
    reference, ref_counts, ref_warnings, _ = _nonfinite_run(name, False, dtype, fused_backend, **options)
    fused, counts, seen, optimizer = _nonfinite_run(name, True, dtype, fused_backend, **options)
    assert optimizer.fused_path == ["fused"] * len(optimizer.param_groups)
    assert counts == ref_counts and any(skips for _, _, skips in counts)
    assert seen == ref_warnings and seen
    for ours, theirs in zip(fused, reference, strict=True):
        assert torch.isfinite(ours).all()
        assert relative_error(ours, theirs) < (1e-5 if dtype == torch.float32 else 1e-4)
    fused_backend.check()


def test_a_skipped_update_changes_nothing_stored() -> None:
    """A NaN gradient on the fused path: every stored tensor and the weights stay bit for bit."""
    weight = torch.nn.Parameter(torch.randn(128, 64))
    optimizer = like_cuda(slimopt.AdamWTernary([weight], lr=1e-3, weight_decay=0.1, fused=True), flags=True)
    weight.grad = torch.randn(128, 64)
    optimizer.step()
    stored = {k: v.clone() for k, v in optimizer.state[weight].items() if isinstance(v, torch.Tensor)}
    before = weight.detach().clone()
    weight.grad = torch.full((128, 64), float("nan"))
    with pytest.warns(RuntimeWarning, match="non-finite gradient; update skipped"):
        optimizer.step()
    assert torch.equal(weight, before)
    for key, value in stored.items():
        assert torch.equal(optimizer.state[weight][key], value), key
    assert optimizer.state[weight]["step"] == 1 and optimizer.state[weight]["nonfinite_skips"] == 1


def test_the_host_learns_a_skip_only_later_and_the_step_reads_nothing(monkeypatch) -> None:
    """As on CUDA, where the flags' copy to the host completes after the step: the step counts
    optimistically and reads no value from a tensor; the next step (or state_dict) reads the
    flags, takes the skipped step back and warns."""
    monkeypatch.setattr(Decisions, "on_host", lambda self: False)
    weight = torch.nn.Parameter(torch.randn(96, 80))
    optimizer = like_cuda(slimopt.AdamW8bit([weight], lr=1e-2, fused=True), flags=True)
    weight.grad = torch.randn(96, 80)
    optimizer.step()
    optimizer.step()  # the first step decides on the host (it creates the state); this one does not
    weight.grad = torch.full((96, 80), float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with profile() as prof:
            optimizer.step()
    reads = [e.name for e in prof.events() if e.name in ("aten::_local_scalar_dense", "aten::item")]
    assert reads == []
    assert optimizer.state[weight]["step"] == 3  # not known yet
    weight.grad = torch.randn(96, 80)
    with pytest.warns(RuntimeWarning, match="at step 2: non-finite gradient; update skipped"):
        optimizer.step()
    assert optimizer.state[weight]["step"] == 3 and optimizer.state[weight]["nonfinite_skips"] == 1
    weight.grad = torch.full((96, 80), float("inf"))
    optimizer.step()
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        state = optimizer.state_dict()
    assert state["state"][0]["step"] == 3 and state["state"][0]["nonfinite_skips"] == 2


def test_flags_are_exact_where_a_norm_would_overflow() -> None:
    """Where a sum (the CPU's vote) or a 2-norm would overflow, the flag is still exact: 1e30
    everywhere, and 3e38 beside 3e38 (a sum of inf), are finite."""
    big = torch.full((64, 64), 1e30)
    huge = torch.full((2,), 3e38)
    assert finite_flags([huge, -huge, huge.bfloat16()], [None] * 3) == [True] * 3
    nan = torch.zeros(5)
    nan[4] = float("nan")
    grads = [big, nan, torch.tensor([float("-inf")]), torch.zeros(0), big.bfloat16()]
    flags = finite_flags(grads, [None] * len(grads))
    assert decisions(flags, [False] * len(flags)) == [True, False, False, True, True]
    assert decisions(flags, [True] * len(flags))[1] is flags[1]  # left on the device
    assert flags[3] is None


def test_on_the_cpu_the_fused_path_reads_its_decision_before_the_step(monkeypatch) -> None:
    """By default the CPU reads its flags at once (masking the writes would cost more than
    reading): a NaN step is skipped and warned about inside that ``step()``, and the fused step
    itself runs without a mask."""
    masks = []
    fused_step = kernels.adamw_step

    def recording(*args, **kwargs):
        masks.append(args[-1])
        return fused_step(*args, **kwargs)

    monkeypatch.setattr(kernels, "adamw_step", recording)
    weight = torch.nn.Parameter(torch.randn(96, 80))
    optimizer = slimopt.AdamW8bit([weight], lr=1e-2, fused=True)
    for _ in range(2):
        weight.grad = torch.randn(96, 80)
        optimizer.step()
    before = weight.detach().clone()
    weight.grad = torch.full((96, 80), float("nan"))
    with pytest.warns(RuntimeWarning, match="at step 2: non-finite gradient; update skipped"):
        optimizer.step()
    assert torch.equal(weight, before) and optimizer.state[weight]["step"] == 2
    assert masks == [None, None] and optimizer.fused_path == ["fused"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_small_tensors_updated_together_skip_one_by_one(dtype, monkeypatch, fused_backend) -> None:
    """The biases and the norm share one compiled call or one launch of the multi-tensor Triton
    kernel per step (``kernels.adamw_steps``); an inf gradient in one of them skips that tensor
    alone, as the reference path does."""
    calls = []
    together = kernels.adamw_steps

    def counting(*args, **kwargs):
        calls.append(len(args[0]))
        return together(*args, **kwargs)

    monkeypatch.setattr(kernels, "adamw_steps", counting)

    def run(fused: bool) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        torch.manual_seed(0)
        layers = (torch.nn.Linear(96, 80), torch.nn.LayerNorm(80), torch.nn.Linear(80, 72))
        model = torch.nn.Sequential(*layers).to(dtype)
        built = slimopt.build_optimizer(model, "adamw8bit", lr=1e-2, fused=fused)
        optimizer = fused_backend.configure(built, flags=True)
        generator = torch.Generator().manual_seed(1)
        for step in range(4):
            for param in model.parameters():
                param.grad = torch.randn(param.shape, generator=generator).to(dtype)
            if step == 1:
                model[1].weight.grad[5] = float("inf")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                optimizer.step()
        state = optimizer.state_dict()
        counts = [(s["step"], s["nonfinite_skips"]) for s in state["state"].values()]
        return [p.detach().float().clone() for p in model.parameters()], counts

    reference, reference_counts = run(False)
    fused, counts = run(True)
    assert calls == [4] * 4  # three biases and the norm's weight, every step
    if fused_backend.name == "triton":  # the two matrices one by one, the small tensors together
        assert fused_backend.launches == [4, 1, 1] * 4
    assert counts == reference_counts and sum(skips for _, skips in counts) == 1
    for ours, theirs in zip(fused, reference, strict=True):
        assert relative_error(ours, theirs) < (1e-5 if dtype == torch.float32 else 1e-4)
    fused_backend.check()
