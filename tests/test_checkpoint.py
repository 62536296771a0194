"""Checkpoints: round trip, atomic saves, and refusal of partial, corrupt or foreign ones."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from slimopt import build_optimizer
from slimopt.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint

from .conftest import tiny_llama
from .support import train_language_model

# Rank 64 of the tiny LLaMA's 64 keeps projected states above the size under which they stay fp32,
# so compressed states are exercised; that rank saves no memory, which build_optimizer warns of.
pytestmark = pytest.mark.filterwarnings("ignore:rank 64 saves no optimizer state")


def trained(seed: int = 0, steps: int = 3):
    model = tiny_llama(seed)
    optimizer = build_optimizer(model, "galore_adamw_ternary", lr=1e-2, rank=64, update_proj_gap=2)
    train_language_model(model, optimizer, range(steps), shape=(2, 16))
    return model, optimizer


def trainer_state() -> dict:
    return {"step": 3, "rng": torch.get_rng_state(), "python_rng": random.getstate(), "position": 96}


def test_round_trip_restores_model_optimizer_and_trainer_state(tmp_path: Path) -> None:
    model, optimizer = trained()
    state = trainer_state()
    path = save_checkpoint(tmp_path, 3, model, optimizer, state)
    assert path.name == "step-00000003" and latest_checkpoint(tmp_path) == path
    fresh_model = tiny_llama(1)
    fresh_optimizer = build_optimizer(
        fresh_model, "galore_adamw_ternary", lr=1e-2, rank=64, update_proj_gap=2
    )
    restored = load_checkpoint(path, fresh_model, fresh_optimizer)
    assert restored["position"] == 96 and torch.equal(restored["rng"], state["rng"])
    assert restored["python_rng"] == state["python_rng"]
    for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    saved, loaded = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    for index, state in saved.items():
        for key, value in state.items():
            assert (
                torch.equal(value, loaded[index][key])
                if torch.is_tensor(value)
                else value == loaded[index][key]
            )
    for name in ("optimizer.pt", "trainer.pt"):
        torch.load(path / name, weights_only=True)


def test_an_interrupted_save_leaves_earlier_checkpoints_and_no_complete_looking_one(
    tmp_path, monkeypatch
) -> None:
    model, optimizer = trained()
    first = save_checkpoint(tmp_path, 1, model, optimizer, trainer_state())

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, model, optimizer, trainer_state())
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == first
    assert not (tmp_path / "step-00000002").exists()
    assert load_checkpoint(first, model, optimizer)["position"] == 96


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / "manifest.json").unlink(), "manifest.json is missing"),
        (lambda p: (p / "optimizer.pt").unlink(), "incomplete: optimizer.pt is missing"),
        (
            lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:-10]),
            "corrupt: model.safetensors does not match",
        ),
        (lambda p: (p / "manifest.json").write_text("{"), "manifest.json is corrupt"),
    ],
)
def test_partial_or_corrupt_checkpoints_are_refused_before_loading(tmp_path: Path, damage, message) -> None:
    model, optimizer = trained()
    path = save_checkpoint(tmp_path, 3, model, optimizer, trainer_state())
    damage(path)
    target, target_optimizer = trained(seed=5, steps=1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, target, target_optimizer)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    model, optimizer = trained()
    path = save_checkpoint(tmp_path, 3, model, optimizer, trainer_state())
    other = tiny_llama(0, (64, 172, 4, 3))
    other_optimizer = build_optimizer(other, "adamw", lr=1e-3)
    with pytest.raises(CheckpointError, match=r"from another model: it has no model\.layers\.2"):
        load_checkpoint(path, other, other_optimizer)
    wider = tiny_llama(0, (128, 172, 4, 2))
    with pytest.raises(
        CheckpointError, match=r"from another model: .* has shape \(256, 64\) there, \(256, 128\)"
    ):
        load_checkpoint(path, wider, build_optimizer(wider, "adamw", lr=1e-3))


def test_latest_checkpoint_needs_an_existing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        latest_checkpoint(tmp_path / "nowhere")
    assert latest_checkpoint(tmp_path) is None
