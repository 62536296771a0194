"""What full-parameter training of each LLaMA preset takes, term by term: the memory planner's
peak for TACO, APOLLO-Mini and Adafactor with layer-wise updates, activation checkpointing, 1×256 tokens
and int8 weights (the input embedding int8 too), against the card each is meant to fit.

    python -m benchmarks.presets_memory [--out runs/presets-memory] [--plot PATH] [--dtype int8-embed]

writes ``results.json`` and ``results.md`` (a table of the terms at the peak, GiB) and a stacked
bar plot of the terms (``--plot``; default ``presets_memory.png`` in ``--out``). Each plan is a
dry run on the meta device (``slimopt memory``'s), 12 to 50 seconds on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from slimopt.planner import TERMS, plan_memory

# Each preset and the most GiB a plan of it may take: an 8 GB card with its CUDA context (7B),
# a 16 GB one (13B), LLaMA-3-8B's goal, one 80 GB card with room for its context (70B).
GOALS_GIB = {"llama_7b": 7.5, "llama3_8b": 9.0, "llama_13b": 14.0, "llama_70b": 70.0}
OPTIMIZERS = ("taco", "apollo_mini", "adafactor")
# How each term is named in the table and the plot.
LABELS = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer_states": "states",
    "projection_bases": "bases",
    "accumulation_buffers": "accumulation",
    "activations": "activations",
    "workspace": "workspace",
}
GIB = 2**30


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models:
        for optimizer in args.optimizers:
            plan = plan_memory(model, optimizer, layerwise=True, checkpointing=True, dtype=args.dtype)
            rows.append(
                {
                    "model": model,
                    "optimizer": optimizer,
                    "parameters": plan.parameters,
                    "peak_bytes": plan.peak_bytes,
                    "at_peak": plan.at_peak,
                    "goal_gib": GOALS_GIB.get(model),
                }
            )
            print(f"{model:10s} {optimizer:12s} {plan.peak_bytes / GIB:6.2f} GiB", flush=True)
    results = {"setting": vars(args), "rows": rows}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table = render(results)
    (out / "results.md").write_text(table + "\n")
    plot(results, Path(args.plot) if args.plot else out / "presets_memory.png")
    print(table)
    return results


def shown_terms(rows: list[dict[str, Any]]) -> list[str]:
    """The terms some plan holds at its peak, in ``TERMS``' order."""
    return [term for term in TERMS if any(row["at_peak"][term] for row in rows)]


def render(results: dict[str, Any]) -> str:
    """The terms at each plan's peak and the peak against its goal, in GiB."""
    rows = results["rows"]
    terms = shown_terms(rows)
    lines = [
        "| model | optimizer | peak GiB | goal GiB | " + " | ".join(LABELS[t] for t in terms) + " |",
        "|---|---|---|---|" + "---|" * len(terms),
    ]
    for row in rows:
        peak, goal = row["peak_bytes"] / GIB, row["goal_gib"]
        verdict = "" if goal is None else (" ✓" if peak <= goal else " ✗")
        values = " | ".join(f"{row['at_peak'][t] / GIB:.2f}" for t in terms)
        goal_text = "—" if goal is None else f"{goal:g}"
        lines.append(
            f"| {row['model']} | {row['optimizer']} | {peak:.2f}{verdict} | {goal_text} | {values} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """One stacked bar per plan (its terms at the peak), each model's goal marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    terms = shown_terms(rows)
    models = list(dict.fromkeys(row["model"] for row in rows))
    figure, axes = plt.subplots(1, len(models), figsize=(2.8 * len(models) + 1.2, 4.2), squeeze=False)
    for axis, model in zip(axes[0], models, strict=True):
        own = [row for row in rows if row["model"] == model]
        bottom = [0.0] * len(own)
        for term in terms:
            heights = [row["at_peak"][term] / GIB for row in own]
            axis.bar([row["optimizer"] for row in own], heights, bottom=bottom, label=LABELS[term])
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        goal = own[0]["goal_gib"]
        if goal is not None:
            axis.axhline(goal, color="black", linestyle="--", linewidth=1)
            axis.text(-0.45, goal, f"goal {goal:g} GiB", va="bottom", fontsize=8)
        axis.set_title(model)
        axis.set_ylim(0, max(max(bottom), goal or 0) * 1.12)
    axes[0][0].set_ylabel("GiB at the peak")
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles[::-1], labels[::-1], loc="center right", fontsize=8)
    setting = f"layer-wise, checkpointing, 1×256 tokens, {results['setting']['dtype']} weights"
    figure.suptitle(f"Planned peak by term: {setting}")
    figure.tight_layout(rect=(0, 0, 1 - 1.2 / (2.8 * len(models) + 1.2), 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/presets-memory")
    parser.add_argument("--plot", default=None, help="where the plot goes (default: in --out)")
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(GOALS_GIB))
    parser.add_argument("--optimizers", type=lambda s: s.split(","), default=list(OPTIMIZERS))
    parser.add_argument("--dtype", default="int8-embed")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
