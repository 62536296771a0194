"""When the fused step is taken: what ``fused=`` accepts, whether auto mode fuses on a device
(CUDA with Triton, until a fused step fails to compile in this process), and why
``torch.compile`` cannot build a step here."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil

import torch

# What ``fused=`` accepts: None chooses the fused path where it exists and runs on CUDA.
FUSED_CHOICES = (None, True, False)

# Why auto mode gave up the fused step in this process (a compile failure); empty while it has not.
_auto_failure: list[str] = []


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


def auto_available(device_type: str) -> bool:
    """Whether ``fused=None`` takes the fused step on ``device_type``: on CUDA, with Triton, as
    long as no fused step has failed to compile in this process."""
    return device_type == "cuda" and not _auto_failure and compiler_error(device_type) is None


def auto_failure() -> str | None:
    """Why auto mode gave up the fused step in this process, or None."""
    return _auto_failure[0] if _auto_failure else None


def give_up_auto(reason: str) -> None:
    """Stop taking the fused step in auto mode for the rest of the process (after ``reason``)."""
    _auto_failure.append(reason)


def resume_auto() -> None:
    """Take the fused step in auto mode again after ``give_up_auto`` (a process that fixed its
    compiler; tests that give it up on purpose)."""
    _auto_failure.clear()


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
