"""What an update path reports back to the dispatcher."""

from __future__ import annotations

from enum import Enum


class Outcome(Enum):
    """TAKEN: written. MASKED: written under the device flag ``Update.keep`` (counted later).
    SKIPPED: not written, the step taken back (a flag read on the host said non-finite)."""

    TAKEN = "taken"
    MASKED = "masked"
    SKIPPED = "skipped"


class NotCompiled(Exception):
    """Auto mode's fused step did not compile: nothing was written, the reference path takes over."""
