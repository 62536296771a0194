"""``slimopt compare``: the same model, data, seed and steps for several optimizers, then a
table (validation perplexity, ratio to the first optimizer, state bytes, peak memory, tokens/s),
``results.json`` and a PNG of the loss curves."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from slimopt.files import write_atomically
from slimopt.train import metrics
from slimopt.train.config import TrainConfig
from slimopt.train.data import Data, prepare_data
from slimopt.train.loop import check_optimizer, train
from slimopt.train.rundir import check_out, claim

# One style per optimizer, so that lines that overlap stay distinguishable.
LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def compare(
    configs: list[TrainConfig], out: Path, *, overwrite: bool = False, progress: bool = True
) -> list[dict[str, Any]]:
    """Train each configuration, write ``results.json`` and ``results.md`` under ``out``, print
    the table, then plot ``losses.png`` (a plot that fails is one warning line on stderr, the
    table kept) and return the summaries. A run interrupted by SIGINT ends the
    comparison (its summary is the last one returned) without writing the results.

    Everything is checked before anything on disk changes: ``out`` (``rundir.check_out``; an
    old comparison there is replaced only with ``overwrite``), the data (read once, shared by
    every run) and each optimizer's options (built on the model on the meta device). Raises
    ``ValueError`` naming the first problem."""
    check_out(out, overwrite=overwrite)
    data = prepare_data(configs[0])
    for config in configs:
        check_optimizer(config, data[0].vocab_size)
    lock = claim(out, overwrite=overwrite)
    names = ", ".join(config.optimizer for config in configs)
    print(f"comparing {names}; results in {out}", file=sys.stderr)
    try:
        return _train_each(configs, out, data, progress)
    finally:
        lock.release()


def _train_each(configs: list[TrainConfig], out: Path, data: Data, progress: bool) -> list[dict[str, Any]]:
    results = []
    for number, config in enumerate(configs, start=1):
        label = f"{config.optimizer} {number}/{len(configs)}"
        summary = train(config, progress=progress, label=label, data=data)
        history = metrics.read(Path(config.out) / metrics.NAME)
        results.append({**summary, "history": history})
        if summary["interrupted"]:
            print(
                f"comparison stopped; continue {config.optimizer}'s run with: slimopt train --resume "
                f"{shlex.quote(str(config.out))}",
                file=sys.stderr,
            )
            return results
    write_atomically(out / "results.json", json.dumps(results, indent=1))
    table = markdown_table(results)
    write_atomically(out / "results.md", table)
    print(table)
    files = "results.md, results.json"
    try:  # the table is printed and saved already: a plot that fails costs only the plot
        plot_losses(results, out / "losses.png")
        files += ", losses.png"
    except Exception as error:  # matplotlib fails in many ways; each is one line here
        print(f"warning: losses.png not written ({type(error).__name__}: {error})", file=sys.stderr)
    print(f"results in {out}: {files}; one run directory per optimizer")
    return results


def markdown_table(results: list[dict[str, Any]]) -> str:
    reference = results[0]["val_ppl"]
    lines = [
        "| optimizer | val loss | val ppl | ppl ratio | state MiB | peak memory MiB | tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cells = [
            r["optimizer"],
            f"{r['val_loss']:.4f}",
            f"{r['val_ppl']:.2f}",
            f"{r['val_ppl'] / reference:.3f}",
            f"{r['state_bytes'] / 2**20:.2f}",
            f"{r['peak_memory_bytes'] / 2**20:.1f}",
            f"{r['tokens_per_s']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def loss_figure(results: list[dict[str, Any]]) -> Any:
    """A matplotlib figure: training loss (left) and validation loss (right) against the step,
    one line style and marker per optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (train_axis, val_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for index, r in enumerate(results):
        style = {"linestyle": LINE_STYLES[index % len(LINE_STYLES)], "label": r["optimizer"]}
        marker = MARKERS[index % len(MARKERS)]
        steps = [h["step"] for h in r["history"]]
        train_axis.plot(steps, [h["loss"] for h in r["history"]], linewidth=1.2, **style)
        evaluated = [h for h in r["history"] if "val_loss" in h]
        val_axis.plot(
            [h["step"] for h in evaluated], [h["val_loss"] for h in evaluated], marker=marker, **style
        )
    for axis, title in ((train_axis, "training loss"), (val_axis, "validation loss")):
        axis.set_xlabel("optimizer step")
        axis.set_ylabel(f"{title} (nats per token)")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    return figure


def plot_losses(results: list[dict[str, Any]], path: Path) -> None:
    """Save ``loss_figure(results)`` as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    figure = loss_figure(results)
    figure.savefig(path, dpi=120)
    plt.close(figure)
