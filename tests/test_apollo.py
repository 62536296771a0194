"""APOLLO and APOLLO-Mini (``APOLLOAdamW``, ``apollo_adamw``, ``apollo_mini``) against the
reference package apollo-torch 1.0.3, and what slimopt adds: projections drawn from a seed,
every storage format, layer-wise updates, checkpoints, Hugging Face's names.

apollo-torch places eps before the bias correction and torch after it, so the comparisons run
at eps = 1e-12, as the galore-torch ones do; weight decay is 0 because apollo-torch decays the
weights after the update and torch.optim before it. Its SVD projector's singular vectors get
slimopt's sign rule (moments are kept across a refresh, so signs matter). Its random projector
is given slimopt's draws: apollo-torch seeds by parameter index and its own seed chain, slimopt
by parameter, step and device, so only the draws themselves can be shared.
"""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch
from torch import nn

import slimopt
from slimopt import APOLLOAdamW, GaLoreAdamW, state_nbytes
from slimopt.codecs import STATE_FORMATS
from slimopt.projection import canonicalize_signs

from .configurations import loss_of, make_net, train
from .support import gradient, relative_error

apollo_torch = pytest.importorskip("apollo_torch")
from apollo_torch.random_projector import GradientProjector  # noqa: E402
from apollo_torch.svd_projector import GaLoreProjector  # noqa: E402

SHAPES = [(32, 48), (48, 32), (48,)]
HYPER = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-12, "weight_decay": 0.0}
CASES = [(scale_type, limiter) for scale_type in ("channel", "tensor") for limiter in (True, False)]


def _compare(proj: str, scale_type: str, limiter: bool, monkeypatch: pytest.MonkeyPatch) -> float:
    """30 steps of both on the same gradients (refreshes at steps 0, 12, 24); the largest
    relative distance of a parameter."""
    torch.manual_seed(0)
    initial = [torch.randn(shape) for shape in SHAPES]
    ours = [w.clone().requires_grad_() for w in initial]
    theirs = [w.clone().requires_grad_() for w in initial]
    apollo = {"rank": 8, "update_proj_gap": 12, "scale": 4.0, "scale_type": scale_type}
    limit = {"norm_growth_limit": 1.01 if limiter else None}
    optimizer = APOLLOAdamW(
        [{"params": ours[:2], **apollo, **limit}, {"params": ours[2:]}], proj_method=proj, **HYPER
    )
    reference = apollo_torch.APOLLOAdamW(
        [{"params": theirs[:2], **apollo, "proj": proj, "proj_type": "std"}, {"params": theirs[2:]}],
        disable_nl=not limiter,
        **HYPER,
    )
    if proj == "svd":
        original = GaLoreProjector.get_orthogonal_matrix

        def canonical(self, weights, rank, type):
            return canonicalize_signs(original(self, weights, rank, type).clone(), 0 if type == "left" else 1)

        monkeypatch.setattr(GaLoreProjector, "get_orthogonal_matrix", canonical)
    else:
        by_shape = {tuple(p.shape): p for p in ours[:2]}

        def ours_drawn(self, weights, rank, type, seed):
            basis = optimizer.engine.basis(by_shape[tuple(weights.shape)], optimizer.param_groups[0])
            return basis.left if type == "left" else basis.right

        monkeypatch.setattr(GradientProjector, "get_orthogonal_matrix", ours_drawn)
    for step in range(30):
        for p, q, shape in zip(ours, theirs, SHAPES, strict=True):
            p.grad = gradient(step, shape)
            q.grad = gradient(step, shape)
        optimizer.step()  # first: the reference's random projector reads our draw of this step
        reference.step()
    return max(relative_error(p.detach(), q.detach()) for p, q in zip(ours, theirs, strict=True))


@pytest.mark.parametrize(("scale_type", "limiter"), CASES)
def test_matches_apollo_torch_with_its_svd_projector(scale_type, limiter, monkeypatch) -> None:
    assert _compare("svd", scale_type, limiter, monkeypatch) <= 1e-5


@pytest.mark.parametrize(("scale_type", "limiter"), CASES)
def test_matches_apollo_torch_given_the_same_random_draws(scale_type, limiter, monkeypatch) -> None:
    assert _compare("random", scale_type, limiter, monkeypatch) <= 1e-5


def test_the_limiter_is_what_tells_the_runs_apart() -> None:
    """The comparisons above would notice a missing limiter: it changes the run by far more."""
    runs = []
    for limit in (1.01, None):
        torch.manual_seed(0)
        weight = torch.randn(48, 32, requires_grad=True)
        optimizer = APOLLOAdamW([{"params": [weight], "rank": 8, "norm_growth_limit": limit}], **HYPER)
        for step in range(30):
            weight.grad = gradient(step, (48, 32)) * (1 + step)  # a growing gradient
            optimizer.step()
        runs.append(weight.detach().clone())
    assert relative_error(runs[0], runs[1]) > 1e-3


def test_a_zero_first_gradient_does_not_freeze_the_limiter() -> None:
    """Limiting starts from the first non-zero scaled gradient (a deliberate difference from
    apollo-torch, which starts from the first step): a matrix whose first gradient is zero, as
    LoRA's A is while B is zero, used to be held to 1e-8 · 1.01^t and stayed put for ~1800
    steps. After a zero step it moves as a matrix whose first gradient is its second does."""
    runs = []
    for leading_zero in (True, False):
        torch.manual_seed(0)
        weight = torch.randn(48, 32, requires_grad=True)
        start = weight.detach().clone()
        optimizer = APOLLOAdamW([{"params": [weight], "rank": 8}], **HYPER)
        if leading_zero:
            weight.grad = torch.zeros(48, 32)
            optimizer.step()
            assert torch.equal(weight.detach(), start)
        for step in range(10):
            weight.grad = gradient(step, (48, 32))
            optimizer.step()
        runs.append(weight.detach() - start)
    frozen, moving = runs
    assert frozen.norm() > 0.5 * moving.norm() and relative_error(frozen, moving) < 0.5


def test_peft_lora_a_trains_under_apollo() -> None:
    """build_optimizer(peft_model, "apollo_adamw") trained lora_B only: lora_A's first gradient
    is zero (lora_B starts at zero), which froze its limiter."""
    peft = pytest.importorskip("peft")
    from .conftest import tiny_llama
    from .support import train_language_model

    model = peft.get_peft_model(
        tiny_llama(), peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    optimizer = slimopt.build_optimizer(model, "apollo_adamw", lr=1e-2, rank=4)
    factors = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}
    train_language_model(model, optimizer, range(6))
    moved = [relative_error(p.detach(), factors[n]) for n, p in model.named_parameters() if n in factors]
    assert min(moved) > 1e-2


def test_the_random_projection_is_drawn_from_its_seed_and_never_stored() -> None:
    weights = [torch.zeros(256, 64, requires_grad=True), torch.zeros(64, 256, requires_grad=True)]
    optimizer = APOLLOAdamW([{"params": weights, "rank": 16, "update_proj_gap": 4}], lr=1e-3)
    group = optimizer.param_groups[0]
    drawn = []
    for step in range(5):
        for weight in weights:
            weight.grad = gradient(step, tuple(weight.shape))
        optimizer.step()
        drawn.append([optimizer.engine.basis(w, group) for w in weights])
        assert all(
            not any(k.startswith("basis_left") or k.startswith("basis_right") for k in optimizer.state[w])
            for w in weights
        )
    tall, wide = drawn[0]
    # std: the basis on the smaller side, r×64 for both; N(0, 1/r) entries
    assert tall.left is None and tall.right.shape == (16, 64)
    assert wide.right is None and wide.left.shape == (64, 16)
    assert tall.right.std().item() == pytest.approx(1 / math.sqrt(16), rel=0.1)
    assert not torch.equal(tall.right, wide.left.T)  # each matrix draws its own
    for step in (1, 2, 3):  # the same draw until the refresh at step 4, drawn again each time
        assert torch.equal(drawn[step][0].right, tall.right)
    assert not torch.equal(drawn[4][0].right, tall.right)
    assert optimizer.state[weights[0]]["basis_draw"] == 4


@pytest.mark.parametrize("name", ["apollo_adamw", "apollo_mini"])
def test_resume_is_bit_exact_across_a_redraw(name: str) -> None:
    options = {"lr": 3e-3, "update_proj_gap": 4, **({"rank": 8} if name == "apollo_adamw" else {})}
    net = make_net()
    optimizer = slimopt.build_optimizer(net, name, **options)
    train(net, optimizer, range(5))
    saved = io.BytesIO()
    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, saved)
    train(net, optimizer, range(5, 10))
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)
    resumed_net = make_net(seed=1)
    resumed_net.load_state_dict(checkpoint["model"])
    resumed = slimopt.build_optimizer(resumed_net, name, **options)
    resumed.load_state_dict(checkpoint["optimizer"])
    train(resumed_net, resumed, range(5, 10))
    for a, b in zip(net.parameters(), resumed_net.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("states", STATE_FORMATS)
def test_every_storage_format_trains_and_costs_galores_moments_without_the_basis(states: str) -> None:
    """APOLLO's state is GaLore's moments at the same rank, without the basis, plus the
    limiter's one number per matrix; and the toy regression's loss falls in every format."""
    net, galore_net = make_net(), make_net()
    optimizer = slimopt.build_optimizer(net, "apollo_adamw", lr=3e-3, rank=32, states=states)
    galore = slimopt.build_optimizer(galore_net, "galore_adamw", lr=3e-3, rank=32, states=states)
    first = loss_of(net, 0).item()
    train(galore_net, galore, range(40))
    train(net, optimizer, range(40))
    assert loss_of(net, 0).item() < 0.8 * first
    matrices = [p for p in galore_net.parameters() if p.dim() == 2]
    bases = sum(
        v.numel() * v.element_size()
        for p in matrices
        for k, v in galore.state[p].items()
        if k.startswith("basis_")
    )
    assert state_nbytes(optimizer) == state_nbytes(galore) - bases + 4 * len(matrices)


def test_apollo_mini_keeps_two_numbers_per_row_of_each_matrix() -> None:
    """Rank 1: each m×n matrix (m ≥ n) keeps m first and m second moments, and the limiter's norm."""
    layer = nn.Linear(1024, 4096, bias=False)
    optimizer = slimopt.build_optimizer(layer, "apollo_mini", lr=1e-3)
    layer.weight.grad = gradient(0, (4096, 1024))
    optimizer.step()
    assert state_nbytes(optimizer) == (2 * 4096 + 1) * 4
    group = optimizer.param_groups[0]
    assert (group["rank"], group["scale_type"], group["scale"]) == (1, "tensor", 128.0)


def _clipped_step_reference(net, optimizer, steps: range, accumulation: int, clip: float) -> None:
    for step in steps:
        for micro in range(accumulation):
            (loss_of(net, step * accumulation + micro) / accumulation).backward()
        for param in net.parameters():
            torch.nn.utils.clip_grad_norm_([param], clip)
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("accumulation", [1, 3])
def test_layerwise_equals_stepping_with_accumulation_and_per_tensor_clipping(accumulation: int) -> None:
    """APOLLO moves the weights by the raw gradient, so layer-wise mode accumulates and clips the
    whole gradient of its matrices, and the run is the stepping one's."""
    runs = []
    for layer_wise in (False, True):
        net = make_net()
        optimizer = slimopt.build_optimizer(net, "apollo_adamw", lr=3e-3, rank=16, update_proj_gap=3)
        if layer_wise:
            handle = slimopt.layerwise(optimizer, accumulation, max_grad_norm=0.05)
            for step in range(6):
                for micro in range(accumulation):
                    (loss_of(net, step * accumulation + micro) / accumulation).backward()
            assert all(p.grad is None for p in net.parameters())
            handle.remove()
        else:
            _clipped_step_reference(net, optimizer, range(6), accumulation, 0.05)
        runs.append([p.detach().clone() for p in net.parameters()])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_apply_update_of_an_apollo_group_needs_the_raw_gradient() -> None:
    weight = torch.zeros(32, 16, requires_grad=True)
    optimizer = APOLLOAdamW([{"params": [weight], "rank": 4}], lr=1e-3)
    group = optimizer.param_groups[0]
    grad, basis = optimizer.engine.gradient_in_space(weight, group, gradient(0, (32, 16)))
    with pytest.raises(ValueError, match="pass raw="):
        optimizer.engine.apply_update(weight, group, grad, basis)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"scale_type": "rows"}, "unknown scale_type 'rows'; valid: None, channel, tensor"),
        (
            {"norm_growth_limit": 0.5},
            "norm_growth_limit must be a finite number >= 1, or None for no limiter, got 0.5",
        ),
        ({"proj_type": "full"}, "scale_type='channel' scales the unprojected side's channels"),
        (
            {"on_subspace_change": "rotate"},
            "no rotation maps the moments into; use on_subspace_change='keep'",
        ),
        ({"basis_states": "int8"}, "proj_method='random' stores no basis"),
        ({"fused": True}, "APOLLO's gradient scaling (scale_type) has no fused step"),
    ],
)
def test_bad_apollo_options_are_refused_at_construction(options: dict, message: str) -> None:
    weight = torch.zeros(32, 16, requires_grad=True)
    with pytest.raises(ValueError, match=None) as raised:
        APOLLOAdamW([{"params": [weight], "rank": 4, **options}], lr=1e-3)
    assert message in str(raised.value)


def test_a_limiter_without_scaling_is_refused() -> None:
    weight = torch.zeros(32, 16, requires_grad=True)
    with pytest.raises(ValueError, match="norm_growth_limit limits APOLLO's scaled gradient: set scale_type"):
        GaLoreAdamW([{"params": [weight], "rank": 4, "norm_growth_limit": 1.01}], lr=1e-3)


def test_hugging_face_optim_args_configure_apollo() -> None:
    from transformers import TrainingArguments

    from slimopt.integrations.transformers import create_optimizer

    args = TrainingArguments(
        output_dir="unused",
        optim="apollo_adamw",
        optim_args="rank=1,proj=random,scale_type=tensor,scale=128,update_proj_gap=50,proj_type=std",
        optim_target_modules=["up", "down"],
        learning_rate=1e-3,
        report_to=[],
    )
    optimizer = create_optimizer(make_net(), args)
    assert isinstance(optimizer, APOLLOAdamW)
    projected = optimizer.param_groups[0]
    assert {
        key: projected[key] for key in ("rank", "proj_method", "scale_type", "scale", "update_proj_gap")
    } == {
        "rank": 1,
        "proj_method": "random",
        "scale_type": "tensor",
        "scale": 128.0,
        "update_proj_gap": 50,
    }
    args.optim_args = "proj=orthogonal"
    with pytest.raises(ValueError, match="unknown proj_method 'orthogonal'"):
        create_optimizer(make_net(), args)


def test_a_comparison_keeps_apollo_minis_own_rank() -> None:
    """``slimopt compare --rank 64`` gives GaLore rank 64; APOLLO-Mini stays at rank 1 (at
    another rank it is not APOLLO-Mini), while ``slimopt train`` takes the rank it is given."""
    from slimopt.cli import make_config

    options = {"rank": 64, "model": "llama_9m"}
    assert make_config(options, "galore_adamw", strict=False).optimizer_options["rank"] == 64
    assert "rank" not in make_config(options, "apollo_mini", strict=False).optimizer_options
    assert make_config(options, "apollo_mini").optimizer_options["rank"] == 64


def test_reset_starts_the_moments_again_at_a_redraw() -> None:
    weight = torch.zeros(48, 32, requires_grad=True)
    optimizer = APOLLOAdamW(
        [{"params": [weight], "rank": 4, "update_proj_gap": 3}], lr=1e-3, on_subspace_change="reset"
    )
    for step in range(4):  # the redraw at step 3 zeroes the moments, then step 3 updates them
        weight.grad = gradient(step, (48, 32))
        optimizer.step()
    state = optimizer.state[weight]
    assert state["moment_step"] == 1 and state["step"] == 4
    grad = gradient(3, (48, 32))
    expected = 0.1 * optimizer.engine.gradient_in_space(weight, optimizer.param_groups[0], grad)[0]
    torch.testing.assert_close(state["exp_avg"], expected)


def test_stacked_experts_are_scaled_each_as_its_own_matrix() -> None:
    """A 3-D stack in a group with ``experts=True`` (a mixture of experts): each expert is
    updated as a 2-D parameter of its own would be (svd projections: no seeds involved)."""
    torch.manual_seed(0)
    stack = torch.randn(3, 48, 32)
    stacked = stack.clone().requires_grad_()
    separate = [stack[e].clone().requires_grad_() for e in range(3)]
    options = {"rank": 4, "update_proj_gap": 5, "proj_method": "svd", "scale_type": "tensor"}
    optimizer = APOLLOAdamW([{"params": [stacked], "experts": True, **options}], lr=1e-2)
    reference = APOLLOAdamW([{"params": separate, **options}], lr=1e-2)
    for step in range(8):
        grads = [gradient(100 * e + step, (48, 32)) for e in range(3)]
        stacked.grad = torch.stack(grads)
        for param, grad in zip(separate, grads, strict=True):
            param.grad = grad
        optimizer.step()
        reference.step()
    for e in range(3):
        torch.testing.assert_close(stacked[e].detach(), separate[e].detach(), rtol=0, atol=0)


def test_a_rank_that_saves_nothing_warns_counting_no_basis_for_a_random_projection() -> None:
    """48×48 matrices: GaLore at rank 36 stores moments and a basis (2·48·36 + 36·48 numbers,
    more than AdamW's 2·48·48) and warns; APOLLO at that rank stores no basis and saves a
    quarter, quietly; at rank 48 it saves nothing and warns."""
    import warnings

    net = nn.Sequential(nn.Linear(48, 48), nn.Linear(48, 48))
    with pytest.warns(UserWarning, match="rank 36 saves no optimizer state"):
        slimopt.build_optimizer(net, "galore_adamw", lr=1e-3, rank=36)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        slimopt.build_optimizer(net, "apollo_adamw", lr=1e-3, rank=36)
    with pytest.warns(UserWarning, match="rank 48 saves no optimizer state"):
        slimopt.build_optimizer(net, "apollo_adamw", lr=1e-3, rank=48)


def test_a_checkpoint_loads_into_another_storage_format_without_storing_a_projection() -> None:
    """fp32 moments loaded into int8 APOLLO: re-encoded, the limiter's norm kept, and the random
    projection still drawn from its seed (no basis appears in the state)."""
    net = make_net()
    optimizer = slimopt.build_optimizer(net, "apollo_adamw", lr=3e-3, rank=32, update_proj_gap=3)
    train(net, optimizer, range(4))
    int8 = slimopt.build_optimizer(net, "apollo_adamw", lr=3e-3, rank=32, update_proj_gap=3, states="int8")
    int8.load_state_dict(optimizer.state_dict())
    weight = net.up.weight
    state = int8.state[weight]
    assert not any(key.startswith("basis_left") or key.startswith("basis_right") for key in state)
    assert torch.equal(state["limiter_norm"], optimizer.state[weight]["limiter_norm"])
    assert "exp_avg.codes" in state
    ours, theirs = int8.decoded_state(weight), optimizer.decoded_state(weight)
    assert relative_error(ours["exp_avg"], theirs["exp_avg"]) < 0.02


def test_switching_proj_method_mid_run_finds_a_basis_of_the_new_kind() -> None:
    """A group switched from a random projection to SVD (or back) gets a basis of its new kind at
    once, not a skipped update until the next refresh."""
    weight = torch.zeros(48, 32, requires_grad=True)
    optimizer = APOLLOAdamW([{"params": [weight], "rank": 4, "update_proj_gap": 50}], lr=1e-3)
    group = optimizer.param_groups[0]
    for step, method in enumerate(["random", "random", "svd", "svd", "random"]):
        group["proj_method"] = method
        weight.grad = gradient(step, (48, 32))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a skipped update would warn
            optimizer.step()
        assert optimizer.engine.basis(weight, group) is not None
    assert optimizer.state[weight]["step"] == 5
