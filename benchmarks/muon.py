"""Muon's quality benchmark: the architectures benchmark's rows (six language-model families
trained from scratch, T5, and full / LoRA / QLoRA fine-tuning of a LLaMA) with AdamW and the Muon
names, each at its best of the same learning-rate sweep (``benchmarks.architectures``' 1e-3,
3e-3 and 1e-2, and 3e-2 above them, where Muon's best rate often lies; the GaLore names three
times those), 400 steps of 16.

Goals: ``muon`` no worse than AdamW on the language-model rows; ``muon8bit`` within 1% of
``muon``, ``muon4bit`` within 2%, ``muon_ternary`` and ``galore_muon`` within 3% (a loss
relative, an accuracy in points). Where an optimizer lands within one point of its goal, its
best rate and its reference's are run again with a second seed and the two seeds' means
compared.

    python -m benchmarks.muon [--out runs/muon] [--rows llama,gpt2] [--optimizers ...] [--tiny]
                              [--sweep N] [--rates 1e-2,2e-2] [--set momentum=0.5 ...]

writes ``results.json`` and ``results.md`` (the table against the goals, then every rate's
metric) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import slimopt
from benchmarks.architectures import GALORE_FACTOR, LEARNING_RATES, relative, sweep, tasks, train_once

OPTIMIZERS = ("adamw", "muon", "muon8bit", "muon4bit", "muon_ternary", "galore_muon")
# Each name's reference and how much worse than it may be (a loss relative, accuracy points).
GOALS: dict[str, tuple[str, float]] = {
    "muon": ("adamw", 0.0),
    "muon8bit": ("muon", 0.01),
    "muon4bit": ("muon", 0.02),
    "muon_ternary": ("muon", 0.03),
    "galore_muon": ("muon", 0.03),
    "galore_muon8bit": ("muon", 0.03),
}
# The architectures benchmark's sweep and one rate above it: Muon's step, RMS-matched to AdamW's,
# was still improving at 1e-2 on most rows.
RATES = (*LEARNING_RATES, 3e-2)
ROWS = ("llama", "gpt2", "qwen2", "gpt_neox", "opt", "mixtral", "t5", "full", "lora", "qlora")
# Within this of its goal, a result is a close call: a second seed decides.
CLOSE = 0.01


def learning_rates(name: str, rates: tuple[float, ...] = RATES) -> list[float]:
    """``name``'s sweep: ``rates``, three times them for a GaLore name (as the architectures
    benchmark scales GaLore's)."""
    factor = GALORE_FACTOR if name.startswith("galore") else 1
    return [lr * factor for lr in rates]


def option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as an optimizer option: the value a number where it reads as one."""
    key, _, value = text.partition("=")
    try:
        return key, int(value)
    except ValueError:
        try:
            return key, float(value)
        except ValueError:
            return key, value


def applies(name: str, task_optimizers: tuple[str, ...]) -> bool:
    """Whether ``name`` runs on a row whose own optimizers are ``task_optimizers``: a row that
    projects nothing (LoRA's adapters) takes no GaLore name."""
    projects = any(n.startswith("galore") for n in task_optimizers)
    return projects or not name.startswith("galore")


def second_seed(task: Any, entry: dict[str, Any], name: str, args: argparse.Namespace) -> None:
    """Add ``name``'s seed-1 metric at its best rate to ``entry`` and the two seeds' mean."""
    if "seeds" in entry:
        return
    again = train_once(task, name, entry["best_lr"], args.steps, args.batch_size, args.set, seed=1)["metric"]
    entry["seeds"] = [entry["metric"], again]
    entry["mean"] = (entry["metric"] + again) / 2
    print(f"{task.name:34s} {name:30s} seed 1 {task.metric} {again:.4f}", flush=True)


def verdicts(row: dict[str, Any], task: Any, args: argparse.Namespace) -> None:
    """Each optimizer's distance to its goal on ``row``: close calls (by the first seed) run a
    second seed first, then every verdict compares means, so a reference that gained a second
    seed for another name's close call is read the same way by every name. Without ``task``
    the verdicts are read again from the metrics already there."""
    found = row["optimizers"]
    pairs = [(name, *GOALS[name]) for name in found if name in GOALS and GOALS[name][0] in found]
    for name, reference_name, goal in pairs if task is not None else []:
        worse = relative(row["metric"], found[name]["metric"], found[reference_name]["metric"])
        if abs(worse - goal) < CLOSE:
            second_seed(task, found[name], name, args)
            second_seed(task, found[reference_name], reference_name, args)
    for name, reference_name, goal in pairs:
        entry, reference = found[name], found[reference_name]
        value, against = entry.get("mean", entry["metric"]), reference.get("mean", reference["metric"])
        worse = relative(row["metric"], value, against)
        entry["against"] = {"reference": reference_name, "worse": worse, "goal": goal, "met": worse <= goal}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"setting": vars(args), "rows": []}
    for task in tasks(args.rows, out, args.pretrain_steps):
        row: dict[str, Any] = {"task": task.name, "metric": task.metric, "optimizers": {}}
        for name in args.optimizers:
            if applies(name, task.optimizers):
                lrs = learning_rates(name, args.rates)[: args.sweep]
                row["optimizers"][name] = sweep(task, name, lrs, args.steps, args.batch_size, args.set)
        verdicts(row, task, args)
        results["rows"].append(row)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    table = render(results)
    (out / "results.md").write_text(table + "\n")
    print(table)
    return results


def _change(metric: str, worse: float) -> str:
    sign = "+" if worse >= 0 else "−"
    return f"{sign}{abs(worse) * 100:.1f}{'%' if metric == 'loss' else ' pts'}"


def render(results: dict[str, Any]) -> str:
    """The table (each optimizer's best metric, its change against its reference, ✗ where a
    goal is missed, † where two seeds decided), then every rate's metric."""
    names = list(results["setting"]["optimizers"])
    lines = ["| task | metric | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    sweeps = ["| task | optimizer | metric by learning rate |", "|---|---|---|"]
    for row in results["rows"]:
        cells = []
        for name in names:
            entry = row["optimizers"].get(name)
            if entry is None:
                cells.append("—")
                continue
            text = f"{entry.get('mean', entry['metric']):.3f}"
            verdict = entry.get("against")
            if verdict:
                text += f" ({_change(row['metric'], verdict['worse'])} vs {verdict['reference']})"
                text += "" if verdict["met"] else " ✗"
            text += " †" if "seeds" in entry else ""
            cells.append(f"{text}<br>state {entry['state_bytes'] / 1024:.0f} KiB, lr {entry['best_lr']:g}")
            rates = ", ".join(f"{float(lr):g}: {m:.3f}" for lr, m in entry["sweep"].items())
            sweeps.append(f"| {row['task']} | {name} | {rates} |")
        metric = "val loss" if row["metric"] == "loss" else "accuracy"
        lines.append(f"| {row['task']} | {metric} | " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", "Learning-rate sweep (metric per learning rate):", "", *sweeps])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/muon")
    parser.add_argument(
        "--rows", type=lambda s: s.split(","), default=list(ROWS), help="comma-separated row keys"
    )
    parser.add_argument("--optimizers", type=lambda s: s.split(","), default=list(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--sweep", type=int, default=len(RATES), help="how many of the rates to try, lowest first"
    )
    parser.add_argument(
        "--rates",
        type=lambda s: tuple(float(v) for v in s.split(",")),
        default=RATES,
        help="comma-separated learning rates (a GaLore name's three times these)",
    )
    parser.add_argument(
        "--set",
        type=option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an optimizer option for every run (repeatable), e.g. momentum=0.5",
    )
    parser.add_argument("--pretrain-steps", type=int, default=600, help="of the fine-tuning rows' base")
    parser.add_argument(
        "--tiny", action="store_true", help="a smoke run: two rows, three optimizers, 3 steps"
    )
    args = parser.parse_args(argv)
    args.set = dict(args.set)
    unknown = sorted(set(args.optimizers) - set(slimopt.available_optimizers()))
    if unknown:
        parser.error(f"unknown optimizers {unknown}; valid: {', '.join(slimopt.available_optimizers())}")
    if args.tiny:
        args.rows = ["gpt2", "mixtral"]
        args.optimizers, args.steps, args.batch_size, args.sweep = (
            ["adamw", "muon", "galore_muon8bit"],
            3,
            4,
            1,
        )
        args.pretrain_steps = 2
    return run(args)


if __name__ == "__main__":
    main()
