"""File-system steps that leave either the old or the new version of a directory or a file,
never a mix."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def move_into_place(staging: Path, final: Path) -> None:
    """Rename the finished directory ``staging`` to ``final``. An existing ``final`` is renamed
    aside first and deleted only once the new one is in place."""
    if final.exists():
        retired = final.parent / f".{final.name}.old"
        shutil.rmtree(retired, ignore_errors=True)
        final.rename(retired)
        staging.rename(final)
        shutil.rmtree(retired)
    else:
        staging.rename(final)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it: a reader (or a run
    killed halfway) finds the old content or the new, never a torn file."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
