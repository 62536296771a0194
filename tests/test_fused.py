"""The fused step (``slimopt.kernels``, ``fused=True``) against the reference path it compiles:
the same codes for the same values, parameters within fp32 round-off, every layout the
reference path handles, and a clear refusal where no fused step exists."""

from __future__ import annotations

import io
import math

import pytest
import torch

import slimopt
from slimopt import kernels
from slimopt.codecs import moment_codec
from slimopt.codecs.draws import stream_seed
from slimopt.core.fused import fused_moment
from slimopt.rules import AdamWRule

from .configurations import CONFIGURATIONS
from .conftest import tiny_llama
from .support import relative_error


def _run(
    name: str,
    fused: bool | None,
    dtype: torch.dtype = torch.float32,
    steps: int = 4,
    configure=None,
    **options,
):
    """Four steps of ``name`` on a tiny LLaMA; ``configure(optimizer)`` runs before the first."""
    torch.manual_seed(0)
    model = tiny_llama().to(dtype)
    options = {"lr": 1e-2, **options}
    optimizer = slimopt.build_optimizer(model, name, fused=fused, **options)
    if configure is not None:
        configure(optimizer)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator).to(dtype)
        optimizer.step()
    return [p.detach().float().clone() for p in model.parameters()], optimizer


def _distance(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max(relative_error(a, b) for a, b in zip(ours, reference, strict=True))


def _inputs(kind: str) -> list:
    """Every (registry name, options) of the configurations' ``kind`` variants, as parameters."""
    return [
        pytest.param(c.name, options, id=f"{c.name}-{index}")
        for c in CONFIGURATIONS
        if c.label == c.name
        for index, options in enumerate(getattr(c, kind))
    ]


@pytest.mark.parametrize("configuration", [pytest.param(c, id=c.label) for c in CONFIGURATIONS])
def test_fused_true_is_taken_exactly_where_the_table_says(configuration) -> None:
    """``fused=True`` takes the fused step for every group of a configuration fused on the CPU,
    and is refused at construction, naming why, for the others (torch's ``supports_fused_on``)."""
    net = configuration.net()
    if "cpu" in configuration.fused_on:
        optimizer = configuration.build(net, fused=True)
        assert optimizer.fused_path == ["fused"] * len(optimizer.param_groups)
    else:
        with pytest.raises(ValueError, match="has no fused step"):
            configuration.build(net, fused=True)


@pytest.mark.parametrize(("name", "options"), _inputs("fused_inputs"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_step_matches_the_reference_path(name, options, dtype) -> None:
    """Four steps of the test LLaMA. The fused loops may contract a multiply and an add into one
    rounding: a 1-ulp difference in a moment that sometimes moves a value across a code's
    midpoint (int8: 1.3e-6 measured) or a bf16 weight across a rounding boundary (3.8e-5)."""
    reference, _ = _run(name, False, dtype, **options)
    fused, optimizer = _run(name, True, dtype, **options)
    assert optimizer.fused_path == ["fused"] * len(optimizer.param_groups)
    assert _distance(fused, reference) < (1e-5 if dtype == torch.float32 else 1e-4)


@pytest.mark.parametrize(("name", "options"), _inputs("triton_inputs"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fused_backend", ["triton"], indirect=True)
def test_triton_kernel_matches_the_reference_path(name, options, dtype, fused_backend) -> None:
    """Three steps of a small model through the hand-written Triton kernel (on CPU tensors in
    Triton's interpreter): parameters as the reference path's, to the tolerances of the compiled
    step (odd sizes: 6097- and 5025-element matrices, a bias, a norm), one launch per matrix and
    one for the three small tensors together (one per tensor where bf16 weights are rounded
    stochastically: the grouped kernel rounds to nearest)."""
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(91, 67), torch.nn.LayerNorm(67), torch.nn.Linear(67, 75, bias=False)
        ).to(dtype)
        optimizer = fused_backend.configure(
            slimopt.build_optimizer(model, name, lr=1e-2, fused=fused, **options)
        )
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            for param in model.parameters():
                param.grad = torch.randn(param.shape, generator=generator).to(dtype)
            optimizer.step()
        results.append([p.detach().float().clone() for p in model.parameters()])
    stochastic = options.get("param_rounding") == "stochastic" and dtype == torch.bfloat16
    assert fused_backend.launches == ([1] * 5 if stochastic else [3, 1, 1]) * 3
    assert _distance(results[1], results[0]) < (1e-5 if dtype == torch.float32 else 1e-4)


@pytest.mark.parametrize("states", ["int8", "int4"])
@pytest.mark.parametrize("numel", [4096 * 3, 5000], ids=["whole-blocks", "padded"])
def test_codes_are_the_reference_encoding(states, numel, fused_backend) -> None:
    """One step of stored moments through the fused step and through decode → rule → encode:
    the same codes (a code may differ by one where the fp32 value sits on a midpoint), the same
    block scales and direction to fp32 round-off."""
    generator = torch.Generator().manual_seed(0)
    shape = torch.Size((numel,))
    codecs = [moment_codec(states, kind, shape) for kind in ("linear", "square")]
    moments = [torch.randn(shape, generator=generator) * 1e-3, torch.rand(shape, generator=generator) * 1e-6]
    stored = [codec.encode(value) for codec, value in zip(codecs, moments, strict=True)]
    grad = torch.randn(shape, generator=generator) * 1e-3
    group = {"betas": (0.9, 0.999), "eps": 1e-8}
    decoded = {
        key: codec.decode(parts, shape)
        for key, codec, parts in zip(("exp_avg", "exp_avg_sq"), codecs, stored, strict=True)
    }
    direction = AdamWRule().direction(grad, decoded, 7, group)
    expected = [
        codec.encode(decoded[key]) for key, codec in zip(("exp_avg", "exp_avg_sq"), codecs, strict=True)
    ]
    ours = [{part: tensor.clone() for part, tensor in parts.items()} for parts in stored]
    cpu = torch.device("cpu")
    fused_moments = {
        key: fused_moment(codec, parts, cpu) for key, codec, parts in zip(decoded, codecs, ours, strict=True)
    }
    hyper = kernels.adamw.hyperparameters(1e-3, (0.9, 0.999), 1e-8, 0.0, 7, 1.0, "cpu")
    triton = fused_backend.triton
    fused_direction = kernels.adamw_step(grad.view(1, -1), fused_moments, hyper, None, triton=triton).view(-1)
    # fp32 round-off: one rounding of a multiply-add here and there, relative to the whole (an
    # element near zero after the moment's cancellation differs more in its own terms).
    assert relative_error(fused_direction, direction) < 1e-6
    for mine, theirs in zip(ours, expected, strict=True):
        assert relative_error(mine["absmax"], theirs["absmax"]) < 1e-6
        for low, high in ((15, 0), (4, 4)) if states == "int4" else ((255, 0),):
            a = (mine["codes"].int() >> high) & low
            b = (theirs["codes"].int() >> high) & low
            differ = a != b
            assert int(differ.sum()) <= max(1, numel // 10_000) and int((a - b).abs().max()) <= 1
    fused_backend.check()


def test_large_matrices_update_by_slices_as_the_reference_does() -> None:
    """A matrix above 2²² elements is stored and updated by slices of rows; the fused step runs
    slice by slice on the same stored layout."""
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(4099, 1025))
        optimizer = slimopt.AdamW8bit([weight], lr=1e-2, fused=fused)
        for step in range(3):
            weight.grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(step))
            optimizer.step()
        results.append(weight.detach().clone())
    assert relative_error(results[1], results[0]) < 1e-5


def test_channels_last_and_empty_parameters(fused_backend) -> None:
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        kernel = torch.nn.Parameter(torch.randn(64, 32, 3, 3).to(memory_format=torch.channels_last))
        empty = torch.nn.Parameter(torch.randn(0, 8))
        optimizer = fused_backend.configure(slimopt.AdamW8bit([kernel, empty], lr=1e-2, fused=fused))
        for step in range(3):
            kernel.grad = torch.randn(kernel.shape, generator=torch.Generator().manual_seed(step))
            empty.grad = torch.zeros_like(empty)
            optimizer.step()
        assert kernel.is_contiguous(memory_format=torch.channels_last)
        results.append(kernel.detach().clone())
    assert relative_error(results[1], results[0]) < 1e-5
    fused_backend.check()


@pytest.mark.parametrize("name", ["adamw8bit", "muon_ternary"])
def test_resume_is_bit_exact(name) -> None:
    """Two steps, state_dict through torch.save, a fresh optimizer loads it and takes two more:
    the parameters of four uninterrupted steps, bit for bit (Muon's fused step with its ternary
    momentum's stochastic rounding included)."""
    uninterrupted, _ = _run(name, True, steps=4)
    torch.manual_seed(0)
    model = tiny_llama()
    first = slimopt.build_optimizer(model, name, lr=1e-2, fused=True)
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        if step == 2:
            saved = io.BytesIO()
            torch.save(first.state_dict(), saved)
            first = slimopt.build_optimizer(model, name, lr=1e-2, fused=True)
            first.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        first.step()
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, model.parameters(), strict=True))


def test_fused_setting_is_the_loading_optimizers_own() -> None:
    _, fused = _run("adamw8bit", True, steps=1)
    model = tiny_llama()
    reference = slimopt.build_optimizer(model, "adamw8bit", lr=1e-2, fused=False)
    reference.load_state_dict(fused.state_dict())
    assert [group["fused"] for group in reference.param_groups] == [False] * len(reference.param_groups)


def test_auto_fuses_on_cuda_only_and_says_why() -> None:
    model = tiny_llama()
    optimizer = slimopt.build_optimizer(model, "adamw8bit", lr=1e-3)
    assert optimizer.fused_path[0] == "reference (auto fuses on CUDA, parameters on cpu)"
    taco = slimopt.build_optimizer(model, "taco", lr=None)
    assert "the TACO rule has no fused step (AdamW, Adafactor and Muon only)" in taco.fused_path[0]
    off = slimopt.build_optimizer(model, "adamw", lr=1e-3, fused=False)
    assert off.fused_path[0] == "reference (fused=False)"
    # A group without elements takes no path (it read "parameters on )").
    empty = slimopt.GaLoreAdamW([{"params": [torch.zeros(2, 2)]}, {"params": [torch.zeros(0, 3)]}])
    assert empty.fused_path[1] == "none (no elements to update)"


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda m: slimopt.GaLoreAdamW(
                [torch.nn.Parameter(torch.randn(64, 32, 3, 3))], states="ternary", fused=True
            ),
            "ternary states of tensors with more than 2 dimensions have no fused step",
        ),
        (
            lambda m: slimopt.build_optimizer(m, "taco", lr=None, fused=True),
            "the TACO rule has no fused step",
        ),
        (
            lambda m: slimopt.GaLoreAdafactor([torch.nn.Parameter(torch.randn(64, 32, 3, 3))], fused=True),
            "Adafactor's factored statistics of tensors with more than 2 dimensions have no fused step",
        ),
        (
            lambda m: slimopt.build_optimizer(m, "galore_muon", lr=1e-3, fused=True),
            "Muon in a projected subspace (galore_muon) has no fused step",
        ),
        (
            lambda m: slimopt.build_optimizer(m, "adamw", lr=1e-3, fused="yes"),
            "fused must be None (auto), True or False, got 'yes'",
        ),
    ],
)
def test_fused_true_without_a_fused_step_is_refused(build, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build(tiny_llama())


def test_hyperparameters_are_rounded_once_from_double() -> None:
    hyper = kernels.adamw.hyperparameters(1e-3, (0.9, 0.999), 1e-8, 0.1, 3, 0.25, "cpu")
    expected = [0.1, 0.999, 0.001, 1e-8, 1 - 0.9**3, math.sqrt(1 - 0.999**3), 1 - 1e-4, -2.5e-4]
    assert hyper.tolist() == torch.tensor(expected, dtype=torch.float32).tolist()


def test_fused_true_without_a_compiler_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ValueError, match=r"torch\.compile needs a C\+\+ compiler for the CPU"):
        slimopt.AdamW8bit([torch.nn.Parameter(torch.randn(64, 64))], lr=1e-3, fused=True)


@pytest.mark.parametrize("step", ["adamw_step", "adamw_steps"])
def test_auto_mode_falls_back_to_the_reference_path_when_the_step_does_not_compile(step, monkeypatch) -> None:
    """On a GPU whose Triton cannot build the step (of one tensor, or of the small tensors
    together), fused=None trains on with the reference path (and says so once); fused=True
    raises the compiler's error. The failure is the optimizer's own: another one still fuses."""

    def broken(*args, **kwargs):
        raise kernels.CompileFailure(lambda: None, RuntimeError("triton: no kernel for this GPU"), None)

    def on_this_device(optimizer):  # auto mode fusing here, as it does on CUDA
        optimizer.engine.use_fused_policy(kernels.FusedPolicy(auto=("cuda", "cpu")))

    monkeypatch.setattr(kernels, "compiler_error", lambda device_type: None)
    reference, _ = _run("adamw8bit", False)
    working = _run("adamw8bit", None, configure=on_this_device)[1]
    monkeypatch.setattr(kernels, step, broken)
    with pytest.warns(
        RuntimeWarning, match="the fused step did not compile .*; fused=None uses the reference path"
    ):
        auto, optimizer = _run("adamw8bit", None, configure=on_this_device)
    assert all(torch.equal(a, b) for a, b in zip(auto, reference, strict=True))
    assert (
        optimizer.fused_path[0]
        == "reference (the fused step did not compile: triton: no kernel for this GPU)"
    )
    assert working.fused_path[0] == "fused"
    with pytest.raises(kernels.CompileFailure):
        _run("adamw8bit", True)


def test_a_step_counted_by_live_bytes_leaves_the_next_ones_compiled() -> None:
    """slimopt train counts the first steps' memory under a dispatch mode, where dynamo cannot
    compile; had it tried, it would have run the step eagerly for the rest of the process."""
    from torch.profiler import profile

    from slimopt.memory import LiveBytes

    weight = torch.nn.Parameter(torch.randn(256, 128))
    optimizer = slimopt.AdamW8bit([weight], lr=1e-3, fused=True)
    weight.grad = torch.randn_like(weight)
    with LiveBytes() as tracker:
        optimizer.step()
    assert tracker.peak > 0
    optimizer.step()
    with profile() as prof:
        optimizer.step()
    assert any(event.name.startswith("Torch-Compiled Region") for event in prof.events())


@pytest.mark.parametrize(
    ("states", "shape"),
    [
        # 6097 elements: blocks of 8 and bytes of 5 padded; a factored second moment
        ("ternary", (67, 91)),
        ("ternary", (1031, 77)),  # several strips of rows and of columns, row means summed in chunks
        ("ternary", (3, 1999)),  # row scales only, a 4-bit second moment
        ("ternary", (140, 31)),  # column scales only
        ("bf16", (61, 83)),
    ],
)
def test_stochastic_formats_draw_what_the_reference_draws(states, shape, fused_backend) -> None:
    """One step of stochastically rounded moments through the fused step and through decode →
    rule → encode, each drawing from a generator seeded alike: the same codes, but where a value
    one fp32 rounding apart falls on the other side of its draw (at most 1 in 1000)."""
    if fused_backend.name == "triton" and states == "ternary" and min(shape) < 32:
        pytest.skip("ternary storage of thin matrices has no Triton kernel: the compiled step covers it")
    if fused_backend.name == "compiled" and shape == (1031, 77):
        pytest.skip("the strips of this shape are the Triton kernels' (compiling it again costs 20 s)")
    shape = torch.Size(shape)
    generator = torch.Generator().manual_seed(0)
    codecs = [moment_codec(states, kind, shape) for kind in ("linear", "square")]
    moments = [torch.randn(shape, generator=generator) * 1e-3, torch.rand(shape, generator=generator) * 1e-6]
    stored = [codec.encode(value, generator) for codec, value in zip(codecs, moments, strict=True)]
    grad = torch.randn(shape, generator=generator) * 1e-3
    keys = ("exp_avg", "exp_avg_sq")
    decoded = {
        key: codec.decode(parts, shape) for key, codec, parts in zip(keys, codecs, stored, strict=True)
    }
    direction = AdamWRule().direction(grad, decoded, 7, {"betas": (0.9, 0.999), "eps": 1e-8})
    rounding = torch.Generator().manual_seed(11)
    expected = [codec.encode(decoded[key], rounding) for key, codec in zip(keys, codecs, strict=True)]

    ours = [{part: tensor.clone() for part, tensor in parts.items()} for parts in stored]
    storages = tuple(codec.storage for codec in codecs)
    rounding = torch.Generator().manual_seed(11)
    seeds = tuple(stream_seed(rounding, torch.device("cpu")) for storage in storages if storage.stochastic)
    hyper = kernels.adamw.hyperparameters(1e-3, (0.9, 0.999), 1e-8, 0.0, 7, 1.0, "cpu")
    cpu = torch.device("cpu")
    fused_moments = {
        key: fused_moment(codec, parts, cpu) for key, codec, parts in zip(keys, codecs, ours, strict=True)
    }
    fused_direction = kernels.adamw_step(grad, fused_moments, hyper, None, seeds, triton=fused_backend.triton)
    assert relative_error(fused_direction, direction) < 1e-6
    for mine, theirs in zip(ours, expected, strict=True):
        assert mine.keys() == theirs.keys()
        for part, value in theirs.items():
            if value.is_floating_point() and value.dtype != torch.bfloat16:
                assert relative_error(mine[part], value) < 1e-6, part
            else:
                assert mine[part].shape == value.shape, part
                assert (mine[part] != value).float().mean().item() <= 1e-3, part
    fused_backend.check()
