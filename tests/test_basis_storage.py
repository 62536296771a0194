"""Projection bases stored in bf16 or int8 (``basis_states``): size, accuracy, training, resume."""

from __future__ import annotations

import io

import pytest
import torch

from slimopt import GaLoreAdamW, state_nbytes

from .support import step_on_gradients
from .test_convergence import final_training_loss


def _optimizer(basis_states: str, shape=(128, 512), rank=32):
    torch.manual_seed(0)
    param = torch.randn(shape, requires_grad=True)
    optimizer = GaLoreAdamW(
        [{"params": [param], "rank": rank}], lr=1e-2, basis_states=basis_states, update_proj_gap=3
    )
    return param, optimizer


def _basis_bytes(optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for key, v in state.items()
        if key.startswith("basis_")
    )


def test_bases_take_half_or_a_quarter_of_fp32() -> None:
    sizes = {}
    for basis_states in ("fp32", "bf16", "int8"):
        param, optimizer = _optimizer(basis_states)
        step_on_gradients([param], optimizer, range(1))
        sizes[basis_states] = _basis_bytes(optimizer)
    assert sizes["fp32"] == 128 * 32 * 4  # left factor m×r of a 128×512 matrix
    assert sizes["bf16"] == sizes["fp32"] // 2
    assert sizes["int8"] == 128 * 32 + (128 * 32 // 256) * 4  # codes + one fp32 absmax per block


@pytest.mark.parametrize("basis_states", ["bf16", "int8"])
def test_stored_bases_stay_nearly_orthonormal(basis_states: str) -> None:
    param, optimizer = _optimizer(basis_states)
    step_on_gradients([param], optimizer, range(4))  # refreshed at step 1 and step 4
    basis = optimizer.engine.basis(param, optimizer.param_groups[0]).left
    assert (basis.T @ basis - torch.eye(32)).abs().max() < (0.01 if basis_states == "bf16" else 0.03)


@pytest.mark.slow  # two 300-step trainings: ~12 s each
@pytest.mark.parametrize("basis_states", ["bf16", "int8"])
def test_compressed_bases_train_as_well_as_fp32(shakespeare_tokens: torch.Tensor, basis_states: str) -> None:
    # Hidden size 256 and rank 32: every basis has 8192 entries, above the size below which
    # states stay fp32, so the bases really are compressed.
    options = {"lr": 1e-2, "rank": 32, "update_proj_gap": 20, "steps": 60, "dims": (256, 688, 4, 2)}
    reference = final_training_loss(shakespeare_tokens, "galore_adamw", **options)
    compressed = final_training_loss(shakespeare_tokens, "galore_adamw", basis_states=basis_states, **options)
    assert compressed <= 1.02 * reference


def test_small_bases_stay_fp32_and_large_ones_are_compressed() -> None:
    small, optimizer = _optimizer("int8", shape=(64, 512), rank=16)  # 64×16 = 1024 entries
    step_on_gradients([small], optimizer, range(1))
    assert optimizer.state[small]["basis_left"].dtype == torch.float32
    large, optimizer = _optimizer("int8")  # 128×32 = 4096 entries
    step_on_gradients([large], optimizer, range(1))
    assert optimizer.state[large]["basis_left.codes"].dtype == torch.uint8
    assert "basis_left" not in optimizer.state[large]


@pytest.mark.parametrize("basis_states", ["bf16", "int8"])
def test_resume_with_compressed_bases_is_exact(basis_states: str) -> None:
    param, optimizer = _optimizer(basis_states)
    step_on_gradients([param], optimizer, range(10))
    whole = param.detach().clone()
    param, optimizer = _optimizer(basis_states)
    step_on_gradients([param], optimizer, range(5))
    buffer = io.BytesIO()
    torch.save({"param": param.detach(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    param, optimizer = _optimizer(basis_states)
    param.data.copy_(saved["param"])
    optimizer.load_state_dict(saved["optimizer"])
    step_on_gradients([param], optimizer, range(5, 10))
    assert torch.equal(param.detach(), whole)
    assert state_nbytes(optimizer) > 0


def test_unknown_basis_states_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown basis_states 'int4'; valid: fp32, bf16, int8"):
        _optimizer("int4")
