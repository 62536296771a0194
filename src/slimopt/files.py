"""File-system steps that leave either the old or the new version of a directory, never a mix."""

from __future__ import annotations

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
