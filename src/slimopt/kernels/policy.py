"""When and how the fused step is taken: what ``fused=`` accepts, an optimizer's choices by device
(``FusedPolicy``: auto mode, the Triton kernels, non-finite flags on the device), and why
``torch.compile`` cannot build a step here."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil

import torch

# What ``fused=`` accepts: None chooses the fused path where it exists and runs on CUDA.
FUSED_CHOICES = (None, True, False)


def compile_failure() -> type[Exception]:
    """What torch.compile raises when a backend (Inductor's C++ or Triton code) fails to build
    (``kernels.CompileFailure``). Looked up on use: importing torch._dynamo costs over a second."""
    import torch._dynamo.exc

    return torch._dynamo.exc.BackendCompilerFailed


def compile_failures() -> tuple[type[Exception], ...]:
    """What a fused step raises when its code fails to build: ``CompileFailure``, and Triton's
    compilation error for the hand-written kernel where Triton is installed."""
    failures: tuple[type[Exception], ...] = (compile_failure(),)
    if triton_installed():
        from triton.compiler.errors import CompilationError

        failures += (CompilationError,)
    return failures


class FusedPolicy:
    """How one optimizer's fused path runs, by device type: where auto mode (``fused=None``)
    takes it (``auto``: CUDA, where ``torch.compile`` can build it, until a fused step fails to
    compile: ``give_up``), where the hand-written Triton kernels take over from
    ``torch.compile`` (``triton``: CUDA, with Triton installed), and where a fused update's
    non-finite decision stays on the device as a flag instead of being read by the host
    (``flags``: CUDA; on the CPU reading a flag waits for nothing, while masking every write
    with it costs: docs/changes.md, the masked and the read-first int8 step), and where
    Muon's Newton–Schulz iteration runs in the Triton kernels of ``triton_newton_schulz``
    (``iteration``: nowhere by default, torch's batched products instead, until the kernels are
    measured against them on a GPU). Each optimizer's engine owns one (the tests give the CPU
    CUDA's choices to run the Triton kernels in Triton's interpreter)."""

    def __init__(
        self,
        auto: tuple[str, ...] = ("cuda",),
        triton: tuple[str, ...] = ("cuda",),
        flags: tuple[str, ...] = ("cuda",),
        iteration: tuple[str, ...] = (),
    ) -> None:
        self.auto, self.triton, self.flags, self.iteration = auto, triton, flags, iteration
        self.failure: str | None = None  # why a fused step did not compile, or None

    def available(self, device_type: str) -> bool:
        """Whether auto mode takes the fused step on ``device_type`` now."""
        return device_type in self.auto and self.failure is None and compiler_error(device_type) is None

    def triton_on(self, device_type: str) -> bool:
        """Whether the hand-written Triton kernels run the fused steps on ``device_type``."""
        return device_type in self.triton and triton_installed()

    def iteration_on(self, device_type: str) -> bool:
        """Whether Muon's Newton–Schulz iteration runs in the Triton kernels on ``device_type``."""
        return device_type in self.iteration and triton_installed()

    def flags_on(self, device_type: str) -> bool:
        """Whether fused updates on ``device_type`` leave their non-finite decisions on the device."""
        return device_type in self.flags

    def give_up(self, reason: str) -> None:
        """Take the reference path in auto mode from now on, after ``reason`` (the first one is kept)."""
        self.failure = self.failure or reason


def compiler_error(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot build the fused step for ``device_type`` here, or None: it
    needs a C++ compiler for the CPU and Triton for CUDA."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this Python"
    if device_type == "cuda" and not triton_installed():
        return "torch.compile needs Triton for CUDA, and it is not installed"
    if device_type == "cpu" and not any(
        shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "clang++", "c++") if c
    ):
        return "torch.compile needs a C++ compiler for the CPU (g++ or clang++), and none is on PATH"
    return None


@functools.cache
def triton_installed() -> bool:
    """Whether Triton can be imported here (it is not imported to find out)."""
    return importlib.util.find_spec("triton") is not None
