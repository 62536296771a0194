"""Muon (``slimopt.Muon``, registry names ``muon``, ``muon8bit``, ``muon4bit``, ``muon_ternary``):
``torch.optim.Muon``'s steps with fp32 momentum, its momentum stored in fewer bytes, the groups
``build_optimizer`` makes (matrices Muon, the rest AdamW at one learning rate), and bad input
refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slimopt
from slimopt.rules.muon import NS_COEFFICIENTS, orthogonalized

from .conftest import tiny_llama
from .support import relative_error

SHAPES = [(64, 32), (32, 96), (48, 48)]


def _steps(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], steps: int = 20) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()


@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_steps_as_torch_optim_muon(adjust_lr_fn: str | None, nesterov: bool) -> None:
    """With fp32 momentum, 20 steps of three matrices (tall, wide, square) end where
    torch.optim.Muon's do, within the order of a product's rounding (torch scales the step's
    learning rate by the shape, slimopt the direction): 1e-8 measured, 1e-6 required."""
    torch.manual_seed(0)
    theirs = [nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    ours = [nn.Parameter(p.detach().clone()) for p in theirs]
    options = {"lr": 0.02, "weight_decay": 0.1, "nesterov": nesterov, "adjust_lr_fn": adjust_lr_fn}
    _steps(torch.optim.Muon(theirs, **options), theirs)
    _steps(slimopt.Muon(ours, **options), ours)
    assert relative_error(ours, theirs) < 1e-6


def test_the_momentum_is_stored_in_fewer_bytes() -> None:
    """Bytes of state per parameter of a 2048×2048 matrix: torch's fp32 momentum, and the same
    momentum in int8, int4 and ternary codes."""
    bytes_per_parameter = {}
    for cls in (slimopt.Muon, slimopt.Muon8bit, slimopt.Muon4bit, slimopt.MuonTernary):
        weight = nn.Parameter(torch.zeros(2048, 2048))
        optimizer = cls([weight], lr=0.02)
        weight.grad = torch.randn(2048, 2048, generator=torch.Generator().manual_seed(0))
        optimizer.step()
        bytes_per_parameter[cls.__name__] = slimopt.state_nbytes(optimizer) / weight.numel()
    assert bytes_per_parameter["Muon"] == 4.0
    assert bytes_per_parameter["Muon8bit"] <= 1.02
    assert bytes_per_parameter["Muon4bit"] <= 0.52
    assert bytes_per_parameter["MuonTernary"] <= 0.34


@pytest.mark.parametrize("name", ["muon", "muon8bit", "muon4bit", "muon_ternary"])
def test_build_optimizer_gives_matrices_muon_and_the_rest_adamw_at_one_rate(name: str) -> None:
    """Moonlight's recipe: the attention and MLP matrices Muon, with the update's RMS matched
    to AdamW's so that one learning rate serves both; embeddings, the head, norms and biases
    AdamW (its betas and eps); it trains."""
    model = tiny_llama()
    optimizer = slimopt.build_optimizer(model, name, lr=3e-3)
    groups = {group["name"]: group for group in optimizer.param_groups}
    assert list(groups) == ["muon", "adamw", "no_decay"]
    assert all(p.dim() == 2 for p in groups["muon"]["params"]) and len(groups["muon"]["params"]) == 14
    assert groups["muon"].get("rule") is None and groups["muon"]["adjust_lr_fn"] == "match_rms_adamw"
    assert groups["adamw"]["rule"] == groups["no_decay"]["rule"] == "adamw"
    assert groups["adamw"]["betas"] == (0.9, 0.999) and groups["adamw"]["eps"] == 1e-8
    assert {group["lr"] for group in groups.values()} == {3e-3}
    assert groups["no_decay"]["weight_decay"] == 0.0 and groups["muon"]["weight_decay"] == 0.1
    tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        loss = model(input_ids=tokens, labels=tokens).loss
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert losses[-1] < losses[0] - 0.5
    with pytest.raises(
        ValueError, match=f"{name} does not project gradients; remove rank or choose one of: galore_muon"
    ):
        slimopt.build_optimizer(model, name, lr=3e-3, rank=8)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"adjust_lr_fn": "rms"}, "unknown adjust_lr_fn 'rms'; valid: original, match_rms_adamw or None"),
        ({"ns_steps": 0}, "ns_steps must be an integer from 1 to 99, got 0"),
        ({"ns_coefficients": (1.0, float("nan"), 2.0)}, "ns_coefficients must be three finite numbers"),
        ({"ns_coefficients": (1.0, 2.0)}, "ns_coefficients must be three finite numbers"),
        ({"momentum": 1.0}, r"momentum must be a number in \[0, 1\), got 1.0"),
        ({"momentum": -0.1}, r"momentum must be a number in \[0, 1\), got -0.1"),
        ({"nesterov": "yes"}, "nesterov must be True or False"),
        ({"transposed": 1}, "transposed must be True or False, got 1"),
        ({"eps": 0.0}, "eps must be a finite number > 0"),
    ],
)
def test_bad_hyperparameters_are_refused_in_one_line(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        slimopt.Muon([nn.Parameter(torch.zeros(8, 8))], lr=0.02, **options)


def test_what_is_not_a_matrix_needs_an_adamw_group() -> None:
    """torch.optim.Muon refuses anything but 2-D parameters; slimopt names the way out, a group
    with rule="adamw" (AdamW's betas and eps, Muon's lr and weight decay), which trains."""
    bias = nn.Parameter(torch.zeros(8))
    refused = r"parameters \[\(8,\)\] are not 2-D: give them a group with rule='adamw'"
    with pytest.raises(ValueError, match=refused):
        slimopt.Muon([nn.Parameter(torch.zeros(8, 8)), bias], lr=0.02)
    groups = [{"params": [nn.Parameter(torch.zeros(8, 8))]}, {"params": [bias], "rule": "adamw"}]
    optimizer = slimopt.Muon(groups)
    assert optimizer.param_groups[1]["betas"] == (0.9, 0.999) and optimizer.param_groups[1]["eps"] == 1e-8
    assert optimizer.param_groups[0]["ns_coefficients"] == NS_COEFFICIENTS
    bias.grad = torch.ones(8)
    optimizer.step()
    assert torch.all(bias < 0)


def test_the_trainer_gives_its_adamw_settings_to_the_adamw_groups(tmp_path) -> None:
    """SlimoptTrainer with a Muon name: TrainingArguments' adam_beta1/2 and adam_epsilon are the
    AdamW groups', Muon's eps stays its iteration's, learning_rate and weight_decay are all
    groups'."""
    import transformers

    from slimopt.integrations.transformers import create_optimizer

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), learning_rate=2e-3, weight_decay=0.05, adam_beta2=0.95,
        adam_epsilon=1e-6, use_cpu=True, report_to=[],
    )  # fmt: skip
    optimizer = create_optimizer(tiny_llama(), args, "muon8bit")
    groups = {group["name"]: group for group in optimizer.param_groups}
    assert groups["adamw"]["betas"] == (0.9, 0.95) and groups["adamw"]["eps"] == 1e-6
    assert groups["no_decay"]["eps"] == 1e-6 and groups["muon"]["eps"] == 1e-7
    assert {group["lr"] for group in groups.values()} == {2e-3}
    assert groups["muon"]["weight_decay"] == groups["adamw"]["weight_decay"] == 0.05


def test_conv1d_and_stacked_experts_step_as_torch_muon_on_each_matrix() -> None:
    """A weight stored in × out (GPT-2's Conv1D, ``transposed=True``) steps as torch.optim.Muon
    steps its out × in transpose (the "original" adjustment reads the shape reversed); each
    expert of a stacked 3-D weight (a group with ``experts``) as torch's Muon steps that expert
    as a matrix of its own."""
    torch.manual_seed(0)
    conv1d, stacked = nn.Parameter(torch.randn(32, 96)), nn.Parameter(torch.randn(3, 48, 16))
    theirs = [nn.Parameter(conv1d.detach().T.clone())] + [nn.Parameter(e.clone()) for e in stacked.detach()]
    options = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "original"}
    ours = slimopt.Muon(
        [{"params": [conv1d], "transposed": True}, {"params": [stacked], "experts": True}], **options
    )
    torch_muon = torch.optim.Muon(theirs, **options)
    generator = torch.Generator().manual_seed(1)
    for _ in range(10):
        conv1d.grad = torch.randn(conv1d.shape, generator=generator)
        stacked.grad = torch.randn(stacked.shape, generator=generator)
        theirs[0].grad = conv1d.grad.T.clone()
        for expert, grad in zip(theirs[1:], stacked.grad, strict=True):
            expert.grad = grad.clone()
        ours.step()
        torch_muon.step()
    assert relative_error([conv1d.T, *stacked.unbind(0)], theirs) < 1e-6


@pytest.mark.parametrize("shape", [(64, 32), (24, 80)])
def test_galore_muon_orthogonalizes_the_projected_momentum(shape: tuple[int, int]) -> None:
    """A GaLore subspace around Muon: between refreshes, each step is the Nesterov momentum of
    the projected gradients, orthogonalized in the rank-r space (the rule's shape adjustment
    read on the projected shape, so that the step has AdamW's RMS there), projected back and
    scaled by GaLore's scale, computed here in float64 from the optimizer's basis."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(shape, dtype=torch.float64).float())
    lr, scale, decay = 0.01, 0.25, 0.1
    optimizer = slimopt.Muon(
        [{"params": [weight], "rank": 8, "scale": scale}],
        lr=lr,
        weight_decay=decay,
        adjust_lr_fn="match_rms_adamw",
    )
    generator = torch.Generator().manual_seed(1)
    expected = weight.detach().double().clone()
    buffer = None
    for _ in range(6):
        grad = torch.randn(shape, generator=generator)
        weight.grad = grad.clone()
        optimizer.step()
        state = optimizer.state[weight]
        left = "basis_left" in state
        basis = (state["basis_left"] if left else state["basis_right"]).double()
        projected = basis.T @ grad.double() if left else grad.double() @ basis.T
        buffer = projected * 0.05 if buffer is None else buffer + 0.05 * (projected - buffer)
        nesterov = projected + 0.95 * (buffer - projected)
        ortho = orthogonalized(nesterov.float(), NS_COEFFICIENTS, 5, 1e-7).double()
        ortho *= 0.2 * max(ortho.shape) ** 0.5
        back = basis @ ortho if left else ortho @ basis
        expected = expected * (1 - lr * decay) - lr * scale * back
    assert relative_error([weight.detach().double()], [expected]) < 1e-5


def test_galore_muon_names_project_the_muon_groups_only() -> None:
    """galore_muon and galore_muon8bit: the attention and MLP matrices Muon in a rank-r
    subspace (default a quarter of their smaller side), embeddings, head and vectors AdamW
    unprojected; a fraction of muon's state."""
    states = {}
    for name in ("muon", "galore_muon", "galore_muon8bit"):
        model = tiny_llama()
        optimizer = slimopt.build_optimizer(model, name, lr=3e-3)
        groups = {group["name"]: group for group in optimizer.param_groups}
        assert list(groups) == ["muon", "adamw", "no_decay"]
        assert groups["muon"].get("rank") == (16 if name != "muon" else None)
        assert "rank" not in groups["adamw"] and "rank" not in groups["no_decay"]
        tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        states[name] = slimopt.state_nbytes(optimizer)
    assert states["galore_muon8bit"] < states["galore_muon"] < states["muon"]


def test_a_step_frees_each_matrixs_fp32_gradient_once_it_is_applied() -> None:
    """Muon reads a bf16 matrix's gradient as fp32 whole (it is not updated by slices of rows);
    the step lets each copy go once its matrix is updated, so the step's extra memory is about
    one matrix's, not every matrix's at once (at LLaMA-7B, 0.6 GiB, not 24.5 GiB)."""
    from slimopt.memory import LiveBytes

    count, side = 16, 128
    weights = [torch.randn(side, side, dtype=torch.bfloat16, requires_grad=True) for _ in range(count)]
    optimizer = slimopt.Muon(weights, lr=1e-3)
    for step in range(2):
        for weight in weights:
            weight.grad = torch.randn(side, side, generator=torch.Generator().manual_seed(step)).bfloat16()
        with LiveBytes() as counted:
            optimizer.step()
    every_fp32_gradient = count * side * side * 4
    assert counted.peak < every_fp32_gradient / 2, counted.peak
