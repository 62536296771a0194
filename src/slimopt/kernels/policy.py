"""When the fused step is taken: what ``fused=`` accepts, whether auto mode fuses on a device
(``AutoFusing``: CUDA with Triton, until a fused step of the optimizer fails to compile), and
why ``torch.compile`` cannot build a step here."""

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


class AutoFusing:
    """Whether auto mode (``fused=None``) takes the fused step: on the ``devices`` (CUDA) where
    ``torch.compile`` can build it, until a fused step fails to compile (``give_up``). Each
    optimizer's engine owns one; a failure is that optimizer's to remember."""

    def __init__(self, devices: tuple[str, ...] = ("cuda",)) -> None:
        self.devices = devices
        self.failure: str | None = None  # why a fused step did not compile, or None

    def available(self, device_type: str) -> bool:
        """Whether auto mode takes the fused step on ``device_type`` now."""
        return device_type in self.devices and self.failure is None and compiler_error(device_type) is None

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
