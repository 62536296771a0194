"""The embedding's and output head's moments: what storing them in int8 or ternary costs.

TACO and APOLLO-Mini keep tiny states for the linear layers' matrices (a sketch per column; a
rank-1 projection), and AdamW for the matrices they do not touch, the embedding and the head:
in fp32 that is most of their state (7.83 of APOLLO-Mini's 7.84 GiB at LLaMA-3-8B). Each cell
trains one of ``benchmarks.weight_formats``' rows (LLaMA, GPT-NeoX, Qwen2 with a tied
embedding, the demo's ``llama_9m``; bytes as tokens, fp32 weights) with the embedding's and
head's moments stored as ``fp32``, ``int8`` or ``ternary`` (TACO's ``fallback_states``,
APOLLO-Mini's ``unprojected_states``), at the optimizer's best fp32 rate, 400 steps of 16×64,
one seed; the table gives the validation loss and its change against fp32 moments.

    python -m benchmarks.embedding_states [--out runs/embedding-states] [--rows llama,demo]

writes ``results.json`` and ``results.md``; ``--merge DIR,DIR`` renders runs made in parts.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.architectures import corpus_bytes, lm_task, sweep
from benchmarks.weight_formats import LEARNING_RATES, ROWS, loss_with_change, stored

OPTIMIZERS = {"taco": "fallback_states", "apollo_mini": "unprojected_states"}
STATES = ("fp32", "int8", "ternary")


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = corpus_bytes()
    results: dict[str, Any] = {"setting": vars(args), "rows": []}
    for key in args.rows:
        label, build = ROWS[key]
        task = replace(lm_task("llama", label, corpus, build=build), build=stored(build, "fp32"))
        row: dict[str, Any] = {"task": label, "cells": {}}
        for name in args.optimizers:
            for states in args.states:
                options = {OPTIMIZERS[name]: states}
                rate = [LEARNING_RATES[name]]
                cell = sweep(task, name, rate, args.steps, 16, options, f"{name} {states}", args.seed)
                row["cells"][f"{name} / {states}"] = cell
        results["rows"].append(row)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    return _finish(results, out)


def _finish(results: dict[str, Any], out: Path) -> dict[str, Any]:
    table = render(results)
    (out / "results.md").write_text(table + "\n")
    print(table)
    return results


def render(results: dict[str, Any]) -> str:
    """Validation loss, and its change against fp32 moments, per row and optimizer."""
    states = results["setting"]["states"]
    lines = ["| row | optimizer | " + " | ".join(states) + " |", "|---|---|" + "---|" * len(states)]
    for row in results["rows"]:
        for name in results["setting"]["optimizers"]:
            reference = row["cells"].get(f"{name} / fp32")
            shown = []
            for kind in states:
                cell = row["cells"].get(f"{name} / {kind}")
                against = None if kind == "fp32" else reference
                shown.append("—" if cell is None else loss_with_change(cell, against))
            lines.append(f"| {row['task']} | {name} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def merge(parts: list[str], out: Path) -> dict[str, Any]:
    """The runs in ``parts`` (directories of rows made apart) as one."""
    runs = [json.loads((Path(part) / "results.json").read_text()) for part in parts]
    setting = {**runs[0]["setting"], "rows": [r["task"] for run in runs for r in run["rows"]]}
    results = {"setting": setting, "rows": [row for run in runs for row in run["rows"]]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return _finish(results, out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/embedding-states")
    parser.add_argument("--rows", type=lambda s: s.split(","), default=list(ROWS))
    parser.add_argument("--optimizers", type=lambda s: s.split(","), default=list(OPTIMIZERS))
    parser.add_argument("--states", type=lambda s: s.split(","), default=list(STATES))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--merge", type=lambda s: s.split(","), default=None)
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, Path(args.out))
    return run(args)


if __name__ == "__main__":
    main()
