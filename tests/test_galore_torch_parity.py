"""Parity with the reference package galore-torch 1.0 (exact SVD, moments kept on refresh).

galore-torch leaves singular-vector signs to LAPACK while slimopt canonicalizes them (largest
entry positive); with moments kept across a refresh the sign matters, so the reference's bases
get the same sign rule. Everything else is galore-torch's own code. eps is 1e-12 because the two
place eps differently (galore-torch before bias correction, torch after it).

The learning rate warms up linearly from 0. At a refresh the two-sided ("full") projection of
the current gradient is diagonal up to fp32 round-off, and a first Adam step (m = v = 0) turns
that round-off into ±1 updates whose signs depend on the BLAS kernel; any later step averages it
away. Warm-up from 0, as most schedules do, keeps the comparison about the algorithm.
"""

from __future__ import annotations

import pytest
import torch

from slimopt import GaLoreAdamW
from slimopt.projection import canonicalize_signs

from .support import gradient, relative_error

galore_torch = pytest.importorskip("galore_torch")
from galore_torch.galore_projector import GaLoreProjector  # noqa: E402


@pytest.fixture
def canonical_reference_signs(monkeypatch: pytest.MonkeyPatch) -> None:
    original = GaLoreProjector.get_orthogonal_matrix

    def canonical(self, weights, rank, type):
        basis = original(self, weights, rank, type)
        if type == "full":
            return [canonicalize_signs(basis[0].clone(), 0), canonicalize_signs(basis[1].clone(), 1)]
        return canonicalize_signs(basis.clone(), 0 if type == "left" else 1)

    monkeypatch.setattr(GaLoreProjector, "get_orthogonal_matrix", canonical)


@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "left", "right", "full"])
def test_matches_galore_torch(proj_type: str, canonical_reference_signs: None) -> None:
    shapes = [(32, 48), (48, 32), (48,)]
    torch.manual_seed(0)
    initial = [torch.randn(s) for s in shapes]
    ours = [w.clone().requires_grad_() for w in initial]
    theirs = [w.clone().requires_grad_() for w in initial]
    galore = {"rank": 8, "update_proj_gap": 12, "scale": 0.25, "proj_type": proj_type}
    hyper = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-12, "weight_decay": 0.0}
    optimizer = GaLoreAdamW(
        [{"params": ours[:2], **galore}, {"params": ours[2:]}],
        proj_method="svd",
        on_subspace_change="keep",
        stagger=False,
        **hyper,
    )
    reference = galore_torch.GaLoreAdamW([{"params": theirs[:2], **galore}, {"params": theirs[2:]}], **hyper)
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(o, lambda t: min(t / 5, 1.0)) for o in (optimizer, reference)
    ]
    for step in range(30):  # refreshes at steps 0, 12 and 24
        for p, q, shape in zip(ours, theirs, shapes, strict=True):
            p.grad = gradient(step, shape)
            q.grad = gradient(step, shape)
        optimizer.step()
        reference.step()
        for schedule in schedules:
            schedule.step()
    for p, q in zip(ours, theirs, strict=True):
        assert relative_error(p.detach(), q.detach()) <= 1e-5
