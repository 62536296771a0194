"""Shared fixtures: markers, the Shakespeare corpus and a tiny LLaMA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


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


@pytest.fixture
def private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokenizers cached under this test session's temporary directory, not the user's cache."""
    monkeypatch.setenv("SLIMOPT_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="session")
def shakespeare_tokens() -> torch.Tensor:
    """Byte tokens of ../shared/data/tinyshakespeare.txt (skips where the corpus is absent)."""
    if not SHAKESPEARE.exists():
        pytest.skip(f"corpus not found at {SHAKESPEARE}")
    from slimopt.train.data import read_bytes

    return read_bytes(SHAKESPEARE)


def tiny_llama(seed: int = 0, dims: tuple[int, int, int, int] = (64, 172, 4, 2)) -> torch.nn.Module:
    """A two-layer LlamaForCausalLM over bytes, deterministic for ``seed``."""
    from slimopt.train.data import BYTE_VOCAB
    from slimopt.train.models import build_llama

    torch.manual_seed(seed)
    return build_llama(dims, BYTE_VOCAB, max_seq_len=128)
