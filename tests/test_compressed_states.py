"""Optimizers with compressed states against fp32 torch.optim.AdamW and bitsandbytes."""

from __future__ import annotations

import copy

import pytest
import torch

from slimopt import (
    AdamW4bit,
    AdamW8bit,
    AdamWTernary,
    GaLoreAdafactor,
    GaLoreAdamW,
    GaLoreAdamW8bit,
    decoded_state,
    state_nbytes,
)

from .support import gradient, relative_error

SHAPE = (1024, 96)


def decoded_moments(
    optimizer: GaLoreAdamW, param: torch.Tensor, shape: torch.Size
) -> dict[str, torch.Tensor]:
    moments = decoded_state(optimizer, param)
    assert moments["exp_avg"].shape == shape
    return moments


# Documented bounds of the lockstep protocol (50 steps, i.i.d. gradients, parameters re-synced
# every step): elements outside isclose(atol=3e-3, rtol=1e-3) per state, mean |Δp| per step,
# and the relative (Frobenius) error of the first and second moments after 50 steps. With i.i.d.
# gradients the true first moment is small noise, so the ternary one (unbiased, but each element
# is 0 or ±scale) is not bounded element by element; being unbiased, its regression coefficient on
# the true one, ⟨m, m_ref⟩ / ⟨m_ref, m_ref⟩, is 1 within 10% at every step for every format (a
# moment decoded as zeros gives 0, a flipped sign −1), and each step's parameter change correlates
# with the reference's (ternary: above 0.2; it measured 0.27–0.37).
LOCKSTEP_BOUNDS = {
    "int8": (20, 6e-5, 0.03, 0.03),
    "bf16": (20, 6e-5, 0.03, 0.03),
    "int4": (100, 3e-4, 0.5, 0.2),
    "ternary": (None, 1e-3, None, 0.3),
}


@pytest.mark.parametrize("states", list(LOCKSTEP_BOUNDS))
def test_lockstep_with_fp32_adamw(states: str) -> None:
    outside_bound, step_bound, first_bound, second_bound = LOCKSTEP_BOUNDS[states]
    torch.manual_seed(0)
    reference_param = (torch.randn(SHAPE) * 0.1).requires_grad_()
    param = reference_param.detach().clone().requires_grad_()
    reference = torch.optim.AdamW([reference_param], lr=1e-3, foreach=False)
    optimizer = GaLoreAdamW([param], lr=1e-3, states=states)
    for _ in range(50):
        grad = torch.randn(SHAPE) * 0.01
        reference_param.grad, param.grad = grad.clone(), grad.clone()
        start = param.detach().clone()
        reference.step()
        optimizer.step()
        assert (reference_param - param).abs().mean() < step_bound
        changes = torch.stack([(param - start).flatten(), (reference_param - start).flatten()]).detach()
        assert torch.corrcoef(changes)[0, 1] > 0.2
        moments = decoded_moments(optimizer, param, param.shape)
        first = reference.state[reference_param]["exp_avg"]
        assert 0.9 < (moments["exp_avg"] * first).sum() / first.square().sum() < 1.1
        for key in ("exp_avg", "exp_avg_sq"):
            expected = reference.state[reference_param][key]
            if outside_bound is not None:
                outside = ~torch.isclose(moments[key], expected, atol=3e-3, rtol=1e-3)
                assert outside.sum() < outside_bound
        with torch.no_grad():
            param.copy_(reference_param)
    if first_bound is not None:
        assert relative_error(moments["exp_avg"], reference.state[reference_param]["exp_avg"]) < first_bound
    assert (
        relative_error(moments["exp_avg_sq"], reference.state[reference_param]["exp_avg_sq"]) < second_bound
    )


def test_parity_with_bitsandbytes_adamw8bit() -> None:
    """Same map, block size and rounding as bitsandbytes: after 20 steps 98% of the codes are
    identical (the rest differ by one code), states agree to 1% and parameters to 1e-3."""
    bnb = pytest.importorskip("bitsandbytes")
    functional = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(0)
    reference_param = (torch.randn(SHAPE) * 0.1).requires_grad_()
    param = reference_param.detach().clone().requires_grad_()
    hyper = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
    reference = bnb.optim.AdamW8bit([reference_param], **hyper)
    optimizer = AdamW8bit([param], **hyper)
    for _ in range(20):
        grad = torch.randn(SHAPE) * 0.01
        reference_param.grad, param.grad = grad.clone(), grad.clone()
        reference.step()
        optimizer.step()
    theirs = reference.state[reference_param]
    ours = optimizer.state[param]
    moments = decoded_moments(optimizer, param, param.shape)
    for index, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
        same_codes = (ours[f"{key}.codes"].view(SHAPE) == theirs[f"state{index}"]).float().mean()
        assert same_codes > 0.95
        expected = functional.dequantize_blockwise(
            theirs[f"state{index}"],
            absmax=theirs[f"absmax{index}"],
            code=theirs[f"qmap{index}"],
            blocksize=256,
        )
        assert relative_error(moments[key], expected) < 0.01
    assert relative_error(param.detach(), reference_param.detach()) < 1e-3


def test_projected_int8_states_follow_fp32_galore() -> None:
    torch.manual_seed(0)
    initial = torch.randn(256, 384) * 0.1
    signal = torch.randn(256, 8) @ torch.randn(8, 384)
    runs = {}
    for states in ("fp32", "int8"):
        weight = initial.clone().requires_grad_()
        optimizer = GaLoreAdamW(
            [{"params": [weight], "rank": 32, "update_proj_gap": 10}], lr=1e-3, states=states
        )
        for step in range(30):
            generator = torch.Generator().manual_seed(step)
            noise = torch.randn(256, 8, generator=generator) @ torch.randn(8, 384, generator=generator)
            weight.grad = signal + 0.5 * noise
            optimizer.step()
        runs[states] = weight.detach() - initial
    assert relative_error(runs["int8"], runs["fp32"]) < 0.05


@pytest.mark.parametrize("states", ["fp32", "int8", "int4", "ternary"])
@pytest.mark.parametrize("policy", ["keep", "reset", "rotate"])
def test_subspace_policies_transform_compressed_moments(policy: str, states: str) -> None:
    """At a refresh the stored projected first moment is decoded, kept / zeroed / rotated into
    the new basis and re-encoded: after the step it is β·T(m_old) + (1-β)·U_newᵀ G for the
    policy's T, within the codec's error, and closer to it than to the other policies' results.
    Ternary rounding is stochastic (unbiased): its moment is averaged over 64 draws of the step."""
    codec_error = {"fp32": 1e-5, "int8": 0.03, "int4": 0.25, "ternary": 0.2}[states]
    torch.manual_seed(0)
    weight = (torch.randn(256, 384) * 0.1).requires_grad_()
    signal = torch.randn(256, 8) @ torch.randn(8, 384)
    optimizer = GaLoreAdamW(
        [{"params": [weight], "rank": 32, "update_proj_gap": 5}],
        lr=1e-3,
        states=states,
        on_subspace_change=policy,
        stagger=False,
        proj_method="svd",  # the same basis whatever the seed of the rounding draws
    )

    def gradient(step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(step)
        return signal + 2.0 * torch.randn(256, 8, generator=generator) @ torch.randn(
            8, 384, generator=generator
        )

    for step in range(5):
        weight.grad = gradient(step)
        optimizer.step()
    state, shape = optimizer.state[weight], torch.Size((32, 384))
    old_basis = state["basis_left"].clone()
    old_moment = decoded_moments(optimizer, weight, shape)["exp_avg"].clone()
    saved, start = copy.deepcopy(optimizer.state_dict()), weight.detach().clone()
    draws = []
    for draw in range(256 if states == "ternary" else 1):
        optimizer.load_state_dict(copy.deepcopy(saved))
        optimizer.state[weight]["seed"] += 1000 * draw  # another stream of rounding draws
        with torch.no_grad():
            weight.copy_(start)
        weight.grad = gradient(5)
        optimizer.step()  # refreshes the basis first
        draws.append(decoded_moments(optimizer, weight, shape)["exp_avg"])
    state = optimizer.state[weight]
    new_basis = state["basis_left"]
    moment = torch.stack(draws).mean(0)
    carried = {
        "keep": old_moment,
        "reset": torch.zeros_like(old_moment),
        "rotate": new_basis.T @ old_basis @ old_moment,
    }
    errors = {
        name: relative_error(moment, 0.9 * value + 0.1 * new_basis.T @ weight.grad)
        for name, value in carried.items()
    }
    assert errors[policy] < codec_error
    assert errors[policy] == min(errors.values())


def test_nonfinite_gradients_never_reach_the_codes() -> None:
    weight = torch.randn(128, 64, requires_grad=True)
    optimizer = AdamWTernary([weight], lr=1e-3)
    weight.grad = torch.randn(128, 64)
    optimizer.step()
    stored = {k: v.clone() for k, v in optimizer.state[weight].items() if isinstance(v, torch.Tensor)}
    weight.grad = torch.full((128, 64), float("nan"))
    with pytest.warns(RuntimeWarning, match="non-finite"):
        optimizer.step()
    for key, value in stored.items():
        assert torch.equal(optimizer.state[weight][key], value), key
    assert torch.isfinite(weight).all()


def test_small_tensors_keep_fp32_states() -> None:
    small, large = torch.randn(63, 64, requires_grad=True), torch.randn(64, 64, requires_grad=True)
    optimizer = AdamW4bit([small, large], lr=1e-3)
    small.grad, large.grad = torch.randn(63, 64), torch.randn(64, 64)
    optimizer.step()
    assert optimizer.state[small]["exp_avg"].dtype == torch.float32
    assert optimizer.state[large]["exp_avg.codes"].dtype == torch.uint8


def test_adafactor_first_moment_is_compressed() -> None:
    weight = torch.randn(128, 96, requires_grad=True)
    optimizer = GaLoreAdafactor([{"params": [weight], "rank": 64}], lr=1e-2, beta1=0.9, states="int8")
    for _ in range(3):
        weight.grad = torch.randn(128, 96)
        optimizer.step()
    state = optimizer.state[weight]
    assert state["exp_avg.codes"].dtype == torch.uint8 and state["exp_avg_sq.codes"].dtype == torch.uint8
    assert torch.isfinite(weight).all()


def test_named_classes_choose_their_storage() -> None:
    for cls, codes in (
        (GaLoreAdamW8bit, "exp_avg.codes"),
        (AdamW4bit, "exp_avg.codes"),
        (AdamWTernary, "exp_avg.row"),
    ):
        weight = torch.randn(128, 64, requires_grad=True)
        optimizer = cls([weight], lr=1e-3)
        weight.grad = torch.randn(128, 64)
        optimizer.step()
        assert codes in optimizer.state[weight]
    assert AdamW8bit is GaLoreAdamW8bit


def test_state_nbytes_counts_every_stored_tensor() -> None:
    weight = torch.randn(512, 256, requires_grad=True)
    optimizer = GaLoreAdamW8bit([{"params": [weight], "rank": 64}], lr=1e-3)
    weight.grad = torch.randn(512, 256)
    optimizer.step()
    projected = 512 * 64  # std projection of a 512×256 matrix keeps the 512 side
    blocks = projected // 256
    expected = 2 * projected + 2 * blocks * 4 + 64 * 256 * 4  # codes, fp32 absmax, fp32 basis
    assert state_nbytes(optimizer) == expected


@pytest.mark.parametrize("shape", [(1, 16384), (16384, 1), (16384,), (2, 8192), (8192, 2)])
def test_ternary_states_of_thin_matrices_cost_what_a_vector_does(shape) -> None:
    """Row or column statistics as long as the matrix would cost 4 bytes per element: a thin
    matrix gets the vector layout (one scale, int4 second moment)."""
    weight = torch.randn(shape, requires_grad=True)
    optimizer = AdamWTernary([weight], lr=1e-3)
    weight.grad = torch.randn(shape)
    optimizer.step()
    vector = torch.randn(16384, requires_grad=True)
    reference = AdamWTernary([vector], lr=1e-3)
    vector.grad = torch.randn(16384)
    reference.step()
    assert state_nbytes(optimizer) <= state_nbytes(reference) + 64  # a few more scales at most
    assert state_nbytes(optimizer) / weight.numel() < 0.9
    decoded = decoded_state(optimizer, weight)["exp_avg"]
    assert decoded.shape == weight.shape
    assert torch.corrcoef(torch.stack([decoded.flatten(), weight.grad.flatten()]))[0, 1] > 0.1


@pytest.mark.parametrize(("states", "exact"), [("ternary/fp32", "exp_avg_sq"), ("fp32/ternary", "exp_avg")])
def test_each_moment_takes_the_format_named_for_it(states: str, exact: str) -> None:
    """``states="first/second"``: the moment named fp32 is torch.optim.AdamW's to fp32 round-off
    (gradients given, so neither moment depends on the other's storage), the other is stored as
    the single format stores it, and the bytes are the two formats' own."""
    weight = torch.nn.Parameter(torch.zeros(SHAPE))
    reference = torch.nn.Parameter(torch.zeros(SHAPE))
    ternary = torch.nn.Parameter(torch.zeros(SHAPE))
    mixed = GaLoreAdamW([weight], lr=1e-3, states=states)
    torch_adamw = torch.optim.AdamW([reference], lr=1e-3)
    whole = GaLoreAdamW([ternary], lr=1e-3, states="ternary")
    for step in range(5):
        for param in (weight, reference, ternary):
            param.grad = gradient(step, SHAPE)
        for optimizer in (mixed, torch_adamw, whole):
            optimizer.step()
    ours = decoded_state(mixed, weight)[exact]
    assert relative_error(ours, torch_adamw.state[reference][exact]) < 1e-6
    compressed = "exp_avg" if exact == "exp_avg_sq" else "exp_avg_sq"
    stored = {key for key in mixed.state[weight] if key.split(".")[0] == compressed}
    assert stored == {key for key in whole.state[ternary] if key.split(".")[0] == compressed}
    ternary_bytes = sum(
        value.nbytes for key, value in whole.state[ternary].items() if key.split(".")[0] == compressed
    )
    assert state_nbytes(mixed) == ternary_bytes + 4 * weight.numel()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"states": "int2"}, "param group 0: unknown states 'int2'; valid: fp32, bf16, int8, int4, ternary"),
        (
            {"states": "ternary/fp8"},
            "unknown states 'ternary/fp8'; valid: .* or one for each moment as 'first/second'",
        ),
        ({"states": "int8/int8/int8"}, "unknown states 'int8/int8/int8'"),
        ({"states": "int8", "block_size": 100}, "param group 0: block_size must be a power of two >= 4"),
        ({"states": "int8", "block_size": 0}, "block_size must be a power of two >= 4"),
    ],
)
def test_bad_storage_options(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        GaLoreAdamW([torch.randn(64, 64)], lr=1e-3, **options)
