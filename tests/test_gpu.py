"""CUDA runs reproduce CPU runs (skipped where no GPU is present)."""

from __future__ import annotations

import pytest
import torch

from slimopt import GaLoreAdafactor, GaLoreAdamW

from .test_adamw import gradient, relative_error

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cls", [GaLoreAdamW, GaLoreAdafactor])
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


def test_planner_predicts_cuda_max_memory_allocated() -> None:
    from slimopt.planner import measure_memory, plan_memory

    setting = dict(
        model="llama_130m", optimizer="galore_adamw8bit", rank=128, layerwise=True, batch_size=4, seq_len=256
    )
    predicted = plan_memory(**setting).peak_bytes
    measured = measure_memory(**setting, device="cuda").cuda_max_memory_allocated
    assert abs(predicted - measured) <= 0.1 * measured
