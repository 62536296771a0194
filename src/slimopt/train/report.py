"""What a run tells the person watching it: messages that do not break the progress bar, the
bar itself, and the few lines that end a run."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def describe(summary: dict[str, Any]) -> str:
    """The end of a run in a few human lines: results, and where the files are."""
    done = "interrupted after" if summary["interrupted"] else "finished"
    lines = [
        f"{summary['optimizer']}: {done} {summary['steps']} of {summary['total_steps']} steps in "
        f"{_duration(summary['seconds'])} on {summary['device']}"
    ]
    if summary["final_train_loss"] is not None:
        results = f"training loss {summary['final_train_loss']:.4f}"
        if summary["val_loss"] is not None:
            results += f", validation loss {summary['val_loss']:.4f} (perplexity {summary['val_ppl']:.2f})"
        lines.append("  " + results)
    lines.append(
        f"  optimizer state {summary['state_bytes'] / 2**20:.2f} MiB, peak memory "
        f"{summary['peak_memory_bytes'] / 2**20:.1f} MiB, {summary['tokens_per_s']:.0f} tokens/s"
    )
    if "grad_sync" in summary:
        lines.append(
            f"  {summary['grad_sync']} gradient sync: {summary['grad_sync_bytes_per_step'] / 2**20:.2f} MiB "
            "all-reduced per step by each process"
        )
    lines.append(f"  files in {summary['out']}: config.json, metrics.jsonl, summary.json, checkpoints/")
    return "\n".join(lines)


def count(number: int) -> str:
    """``number`` in the short form of a start line: 39.8K, 1.2B."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if number >= scale:
            return f"{number / scale:.1f}{suffix}"
    return str(number)


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{seconds:.1f} s" if seconds < 60 else f"{minutes} min {rest} s"


def messenger(enabled: bool) -> Callable[[str], None]:
    """Prints a line to stderr without breaking a progress bar (nothing when not ``enabled``)."""
    from tqdm.auto import tqdm

    def say(message: str) -> None:
        if enabled:
            tqdm.write(message, file=sys.stderr)

    return say


def progress_bar(enabled: bool, total: int, initial: int, label: str) -> Any:
    """A tqdm bar over ``total`` steps from ``initial``, named ``label`` (shown when ``enabled``)."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True, desc=label
    )
