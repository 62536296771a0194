"""The ternary diagnosis benchmark runs end to end on a few steps: its variants train, its table
has a row per variant, and the shadow measurement records every kind of matrix; its
round-to-nearest and rotation are what they say."""

from __future__ import annotations

import json

import torch

from benchmarks import ternary_diagnosis
from slimopt.codecs import moment_codec

from .support import relative_error


def test_the_diagnosis_runs_its_variants_and_tabulates_them(tmp_path) -> None:
    labels = ["adamw (fp32)", "ternary first moment only", "galore_adamw (fp32)", "galore ternary"]
    argv = ["--rows", "llama", "--steps", "3", "--sweep", "1", "--out", str(tmp_path)]
    results = ternary_diagnosis.main([*argv, "--variants", ";".join(labels)])
    assert list(results[0]["variants"]) == labels
    table = (tmp_path / "results.md").read_text().splitlines()
    assert [line.split(" | ")[0].removeprefix("| ") for line in table[2:]] == labels
    assert table[2].endswith("(+0.0%) |")  # the reference against itself


def test_the_shadow_measures_every_kind_of_matrix(tmp_path) -> None:
    records = ternary_diagnosis.main(["--shadow", "--steps", "10", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "shadow.json").read_text()) == records
    (record,) = records
    assert record["step"] == 10
    assert set(record) - {"step"} == set(ternary_diagnosis.LAYER_KINDS)
    for errors in (record[kind] for kind in ternary_diagnosis.LAYER_KINDS):
        assert 0 < errors["one_encoding"] < 1.5 and errors["accumulated"] > 0
        assert 0 < errors["one_encoding_rotated"] < 1.5
        assert all(errors[key] > 0 for key in ternary_diagnosis.SIMULATED)


def test_round_to_nearest_takes_the_nearest_of_minus_s_zero_and_s() -> None:
    value = torch.randn(128, 48) * torch.logspace(-3, 0, 48)  # over 4096 elements: stored ternary
    codec = moment_codec("ternary", "linear", value.shape)
    with ternary_diagnosis.round_to_nearest():
        decoded = [
            codec.decode(codec.encode(value, torch.Generator().manual_seed(s)), value.shape) for s in (0, 1)
        ]
    assert torch.equal(decoded[0], decoded[1])  # no draws left
    assert torch.equal(decoded[0], ternary_diagnosis._round_to_nearest(value))
    # Independently: each element's scale s is what its stored scales decode to with every digit
    # +1 (byte 242 = digits 2, 2, 2, 2, 2); the nearest of -s, 0, +s is ±s above s/2, else 0.
    stored = codec.encode(value, torch.Generator().manual_seed(0))
    scale = codec.decode({**stored, "trits": torch.full_like(stored["trits"], 242)}, value.shape)
    assert torch.equal(decoded[0], torch.where(value.abs() > scale / 2, value.sign() * scale, 0.0))
    nonzero = decoded[0] != 0
    scale = decoded[0].abs()[nonzero]
    assert (value.abs()[nonzero] > scale / 2).all() and (
        value[nonzero].sign() == decoded[0][nonzero].sign()
    ).all()
    # Stochastic rounding picks one of the same two levels (0 or sign(x)·s): never a nearer one.
    stochastic = codec.decode(codec.encode(value, torch.Generator().manual_seed(0)), value.shape)
    assert ((decoded[0] - value).abs() <= (stochastic - value).abs() + 1e-7).all()


def test_the_rotation_is_orthogonal_and_undone() -> None:
    rotation = ternary_diagnosis._hadamard_rotation()
    assert torch.allclose(rotation @ rotation.T, torch.eye(8), atol=1e-6)
    value = torch.randn(172, 64)  # 172 rows: the last block padded
    error = relative_error(ternary_diagnosis._encoded_rotated(value), value)
    assert 0.3 < error < 1.0


def test_rows_without_a_variant_show_a_dash_and_hidden_and_seed_reach_the_rows(tmp_path) -> None:
    results = ternary_diagnosis.diagnose(
        ["llama"], 2, 1, 4, ["adamw (fp32)"], seed=1, hidden=128, out=tmp_path
    )
    assert results[0]["task"] == "LLaMA LM, hidden 128"
    again = ternary_diagnosis.diagnose(["llama"], 2, 1, 4, ["adamw (fp32)"], seed=1, hidden=128, out=tmp_path)
    other = ternary_diagnosis.diagnose(["llama"], 2, 1, 4, ["adamw (fp32)"], seed=2, hidden=128, out=tmp_path)
    metric = results[0]["variants"]["adamw (fp32)"]["metric"]
    assert (
        again[0]["variants"]["adamw (fp32)"]["metric"]
        == metric
        != other[0]["variants"]["adamw (fp32)"]["metric"]
    )
    lora = {"task": "LoRA", "metric": "loss", "variants": {"adamw (fp32)": {"metric": 2.0}}}
    full = {
        "task": "full",
        "metric": "loss",
        "variants": {"adamw (fp32)": {"metric": 2.0}, "galore_adamw (fp32)": {"metric": 2.0}},
    }
    table = ternary_diagnosis.render([full, lora]).splitlines()
    assert table[-1] == "| galore_adamw (fp32) | 2.000 (+0.0%) | — |"


def test_lion_variants_train_with_their_states(tmp_path) -> None:
    argv = ["--rows", "llama", "--steps", "3", "--sweep", "2", "--out", str(tmp_path)]
    results = ternary_diagnosis.main([*argv, "--variants", "adamw (fp32);lion, ternary moment"])
    lion = results[0]["variants"]["lion, ternary moment"]
    adamw = results[0]["variants"]["adamw (fp32)"]
    assert list(lion["sweep"]) == list(adamw["sweep"]) == ["0.001", "0.003"]
    rated = ternary_diagnosis.main([*argv, "--variants", "lion (fp32)", "--rates", "3e-4"])
    assert list(rated[0]["variants"]["lion (fp32)"]["sweep"]) == ["0.0003"]
    assert lion["state_bytes"] < adamw["state_bytes"] / 10  # one ternary moment against two fp32


def test_one_scale_per_expert_is_the_layout_before_stacked_experts_had_row_and_column_scales() -> None:
    value = torch.randn(4, 48, 40)
    today = moment_codec("ternary", "linear", value.shape).encode(value)
    assert today["row"].shape == (4 * 48,) and today["col"].shape == (40,)
    with ternary_diagnosis.one_scale_per_expert():
        codec = moment_codec("ternary", "linear", value.shape)
        stored = codec.encode(value)
        decoded = codec.decode(stored, value.shape)
    assert "col" not in stored and torch.equal(stored["row"], value.abs().flatten(1).amax(dim=1))
    assert decoded.shape == value.shape and (decoded - value).norm() < value.norm()
