"""A run's log, ``metrics.jsonl``: one JSON record per step, appended as the run goes.

A process killed while appending can leave its last line torn; reading skips such a line (the
step it recorded is redone on resume, and logged again).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slimopt.files import write_atomically

NAME = "metrics.jsonl"


def append(path: Path, record: dict[str, Any]) -> None:
    """Add ``record`` to the log at ``path``."""
    with path.open("a") as stream:
        stream.write(json.dumps(record) + "\n")


def read(path: Path) -> list[dict[str, Any]]:
    """The records of the log at ``path`` (none when it does not exist), without a torn line."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def keep_until(path: Path, step: int) -> None:
    """Drop the records after ``step`` (a resumed run redoes those steps), atomically."""
    if path.exists():
        kept = [record for record in read(path) if record["step"] <= step]
        write_atomically(path, "".join(json.dumps(record) + "\n" for record in kept))
