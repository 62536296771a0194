"""CUDA runs reproduce CPU runs (skipped where no GPU is present)."""

from __future__ import annotations

import pytest
import torch

from slimopt import APOLLOAdamW, GaLoreAdafactor, GaLoreAdamW

from .support import gradient, relative_error

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cls", [GaLoreAdamW, GaLoreAdafactor, APOLLOAdamW])
@pytest.mark.parametrize("method", ["svd", "subspace"])
def test_cuda_matches_cpu(cls, method: str) -> None:
    shapes = [(48, 32), (32, 48), (48,)]
    torch.manual_seed(0)
    initial = [torch.randn(s) for s in shapes]
    runs = {}
    for device in ("cpu", "cuda"):
        params = [w.to(device).requires_grad_() for w in initial]
        optimizer = cls(
            [{"params": params[:2], "rank": 8, "update_proj_gap": 5}, {"params": params[2:]}],
            lr=1e-2,
            proj_method=method,
        )
        for step in range(12):
            for p, shape in zip(params, shapes, strict=True):
                p.grad = gradient(step, shape).to(device)
            optimizer.step()
        runs[device] = [p.detach().cpu() for p in params]
    for a, b in zip(runs["cpu"], runs["cuda"], strict=True):
        assert relative_error(b, a) <= 1e-4


def test_a_random_projection_is_drawn_on_the_device_from_its_seed() -> None:
    """APOLLO's projection is drawn by a CUDA generator on the parameter's device, the same at
    every call until its redraw, and the run stays finite."""
    weight = torch.zeros(256, 64, device="cuda", requires_grad=True)
    optimizer = APOLLOAdamW([{"params": [weight], "rank": 8, "update_proj_gap": 3}], lr=1e-2)
    group, engine = optimizer.param_groups[0], optimizer.engine
    for step in range(4):
        weight.grad = gradient(step, (256, 64)).cuda()
        optimizer.step()
        if step == 1:
            first = engine.basis(weight, group).right
            assert first.device.type == "cuda" and torch.equal(first, engine.basis(weight, group).right)
    assert not torch.equal(first, engine.basis(weight, group).right)  # redrawn at step 3
    assert torch.isfinite(weight).all()


def test_planner_predicts_cuda_max_memory_allocated() -> None:
    from slimopt.planner import measure_memory, plan_memory

    setting = dict(
        model="llama_130m", optimizer="galore_adamw8bit", rank=128, layerwise=True, batch_size=4, seq_len=256
    )
    predicted = plan_memory(**setting).peak_bytes
    measured = measure_memory(**setting, device="cuda").cuda_max_memory_allocated
    assert abs(predicted - measured) <= 0.1 * measured


@pytest.mark.parametrize("dtype", ["int8", "bf16+8"])
def test_the_planner_predicts_the_cuda_peak_of_compressed_weights(dtype: str) -> None:
    """int8 and bf16+8 weights on CUDA: training runs (the planner's two steps, for real), and
    the plan of the same steps predicts ``torch.cuda.max_memory_allocated``."""
    from slimopt.planner import measure_memory, plan_memory

    setting = dict(
        model="llama_130m", optimizer="taco", layerwise=True, checkpointing=True, dtype=dtype, batch_size=4
    )
    predicted = plan_memory(**setting).peak_bytes
    measured = measure_memory(**setting, device="cuda").cuda_max_memory_allocated
    assert abs(predicted - measured) <= 0.1 * measured


def test_int8_weights_train_on_cuda() -> None:
    import slimopt
    from slimopt.models import build_llama
    from slimopt.weight_formats import Int8Weight, quantize_weights

    torch.manual_seed(0)
    model = quantize_weights(build_llama((64, 172, 4, 2), 256).to("cuda", torch.bfloat16), "int8")
    optimizer = slimopt.build_optimizer(model, "apollo_mini", lr=1e-2, param_rounding="stochastic")
    tokens = torch.randint(0, 256, (4, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    losses = []
    for _ in range(10):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weight = model.model.layers[0].mlp.up_proj.weight
    assert isinstance(weight, Int8Weight) and weight.codes.is_cuda
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    ("optimizer_class", "states"),
    [
        (GaLoreAdamW, "fp32"),
        (GaLoreAdamW, "int8"),
        (GaLoreAdamW, "int4"),
        (GaLoreAdamW, "ternary"),
        (GaLoreAdafactor, "fp32"),
        (GaLoreAdafactor, "int8"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_auto_fuses_on_cuda_and_matches_the_reference(optimizer_class, states, dtype) -> None:
    """On CUDA ``fused=None`` takes the fused step (the hand-written Triton kernels, elementwise
    and ternary, or Triton kernels built by torch.compile for Adafactor); it ends within fp32
    round-off of the reference path (as on the CPU, tests/test_fused.py)."""
    shapes = [(4099, 1025), (512, 256), (1000,)]  # sliced by rows, whole, padded blocks
    torch.manual_seed(0)
    initial = [torch.randn(s).to(dtype) for s in shapes]
    runs = {}
    for fused in (None, False):
        params = [w.cuda().requires_grad_() for w in initial]
        optimizer = optimizer_class(params, lr=1e-2, states=states, fused=fused)
        assert optimizer.fused_path == ["fused" if fused is None else "reference (fused=False)"]
        for step in range(4):
            for p, shape in zip(params, shapes, strict=True):
                p.grad = gradient(step, shape).to(p)
            optimizer.step()
        runs[fused] = [p.detach().float().cpu() for p in params]
    # Adafactor's step size is a reduction (the weights' RMS), summed in another order by the
    # compiled loops: bf16 weights then cross rounding boundaries more often (1.05e-4 on the CPU
    # with these shapes, fused=True against False).
    bf16 = 2e-4 if optimizer_class is GaLoreAdafactor else 1e-4
    for a, b in zip(runs[None], runs[False], strict=True):
        assert relative_error(a, b) <= (1e-5 if dtype == torch.float32 else bf16)
