"""The ternary diagnosis benchmark runs end to end on a few steps: its variants train, its table
has a row per variant, and the shadow measurement records every kind of matrix."""

from __future__ import annotations

import json

from benchmarks import ternary_diagnosis


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
