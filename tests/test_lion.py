"""The Lion rule (``rule="lion"``) against independent references: bitsandbytes' 32-bit Lion for
plain groups, a float64 implementation of the paper's update inside GaLore's projection for
projected groups; its one moment in every storage format, resumed bit for bit."""

from __future__ import annotations

import pytest
import torch

from slimopt import GaLoreAdamW, state_nbytes

from .support import gradient, relative_error, step_on_gradients

HYPER = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}


def test_plain_groups_reproduce_bitsandbytes_lion() -> None:
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    shapes = [(24, 40), (40,), (3, 5, 7)]
    ours = [torch.randn(s).requires_grad_() for s in shapes]
    reference = [p.detach().clone().requires_grad_() for p in ours]
    optimizer = GaLoreAdamW(ours, rule="lion", **HYPER)
    bnb_optimizer = bnb.optim.Lion(reference, **HYPER)
    step_on_gradients(ours, optimizer, range(30))
    step_on_gradients(reference, bnb_optimizer, range(30))
    for p, q in zip(ours, reference, strict=True):
        assert relative_error(p, q) <= 1e-6
    assert set(optimizer.state[ours[0]]) >= {"exp_avg"} and "exp_avg_sq" not in optimizer.state[ours[0]]


def lion_galore_reference(shape, steps, rank, gap, policy, lr, betas, weight_decay, scale) -> torch.Tensor:
    """Lion (arXiv 2302.06675, Program 1) on GaLore's one-sided projection (arXiv 2403.03507,
    Algorithm 2: the basis is the top singular vectors of the gradient every ``gap`` steps), in
    float64; "rotate" carries the moment into the new basis, "keep" leaves its coordinates."""
    torch.manual_seed(0)
    weight = torch.randn(shape, dtype=torch.float64)
    rows, cols = shape
    left = rows < cols  # "std": the smaller side
    basis = m = None
    beta1, beta2 = betas
    for step in range(steps):
        g = gradient(step, shape).double()
        if step % gap == 0:
            u, _, vh = torch.linalg.svd(g, full_matrices=False)
            new = u[:, :rank] if left else vh[:rank]
            index = new.abs().argmax(dim=0 if left else 1, keepdim=True)  # slimopt's sign convention
            new = new * torch.sign(new.gather(0 if left else 1, index))
            if m is not None and policy == "rotate":
                m = (new.T @ basis) @ m if left else m @ (new @ basis.T).T
            basis = new
        r = basis.T @ g if left else g @ basis.T
        m = torch.zeros_like(r) if m is None else m
        direction = (beta1 * m + (1 - beta1) * r).sign()
        m = beta2 * m + (1 - beta2) * r
        update = basis @ direction if left else direction @ basis
        weight = weight * (1 - lr * weight_decay) - lr * scale * update
    return weight


@pytest.mark.parametrize("policy", ["keep", "rotate"])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_projected_groups_match_float64_algorithm(policy, shape) -> None:
    torch.manual_seed(0)
    weight = torch.randn(shape, dtype=torch.float64).float().requires_grad_()
    optimizer = GaLoreAdamW(
        [{"params": [weight], "rank": 6, "update_proj_gap": 10, "scale": 0.5}],
        rule="lion",
        proj_method="svd",
        on_subspace_change=policy,
        stagger=False,
        **HYPER,
    )
    step_on_gradients([weight], optimizer, range(30))
    expected = lion_galore_reference(shape, 30, 6, 10, policy, scale=0.5, **HYPER)
    assert relative_error(weight.detach(), expected) <= 1e-5


# The one moment of a 256×256 weight: fp32, bf16; int8 codes and one fp32 absmax per block of
# 256; ternary digits five to a byte and an exponent byte per block of 8, both down the columns,
# and an fp32 scale per row and per column.
MOMENT_BYTES = {
    "fp32": 4 * 256 * 256,
    "bf16": 2 * 256 * 256,
    "int8": 256 * 256 + 4 * 256,
    "ternary": (52 + 32) * 256 + 4 * (256 + 256),
}


@pytest.mark.parametrize("states", list(MOMENT_BYTES))
def test_the_one_moment_is_stored_in_each_format_and_resumes_bit_exact(states) -> None:
    def make(weights):
        return GaLoreAdamW(weights, rule="lion", states=states, **HYPER)

    torch.manual_seed(0)
    weights = [torch.randn(256, 256).requires_grad_()]
    optimizer = make(weights)
    step_on_gradients(weights, optimizer, range(5))
    assert state_nbytes(optimizer) == MOMENT_BYTES[states]
    copies = [w.detach().clone().requires_grad_() for w in weights]
    resumed = make(copies)
    resumed.load_state_dict(optimizer.state_dict())
    step_on_gradients(weights, optimizer, range(5, 10))
    step_on_gradients(copies, resumed, range(5, 10))
    assert torch.equal(weights[0], copies[0])


@pytest.mark.parametrize(
    ("betas", "message"),
    [((0.9, 1.5), r"betas\[1\] must be in \[0, 1\], got 1.5"), ((0.9,), r"betas must be a pair")],
)
def test_bad_betas_are_named(betas, message) -> None:
    with pytest.raises(ValueError, match=message):
        GaLoreAdamW([torch.zeros(4, requires_grad=True)], rule="lion", lr=1e-3, betas=betas)
