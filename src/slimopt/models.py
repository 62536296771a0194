"""LLaMA presets of the GaLore paper (hidden / intermediate / heads / layers) and a builder."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimopt.weight_formats import COMPUTE_DTYPES, quantize_weights, weight_dtype

LLAMA_PRESETS: dict[str, tuple[int, int, int, int]] = {
    "llama_9m": (128, 352, 4, 4),
    "llama_20m": (256, 688, 4, 4),
    "llama_35m": (384, 1024, 8, 6),
    "llama_60m": (512, 1376, 8, 8),
    "llama_130m": (768, 2048, 12, 12),
    "llama_350m": (1024, 2736, 16, 24),
    "llama_1b": (2048, 5461, 32, 24),
    "llama_7b": (4096, 11008, 32, 32),
    "llama_13b": (5120, 13824, 40, 40),
}


def build_llama(
    preset: str | tuple[int, int, int, int], vocab_size: int, max_seq_len: int = 1024, **config: Any
) -> nn.Module:
    """Return a randomly initialised ``transformers.LlamaForCausalLM``.

    ``preset`` is a name from ``LLAMA_PRESETS`` or an explicit (hidden, intermediate, heads, layers)
    tuple. Raises ``ValueError`` for an unknown name.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if isinstance(preset, str):
        if preset not in LLAMA_PRESETS:
            raise ValueError(f"unknown model preset {preset!r}; valid: {', '.join(LLAMA_PRESETS)}")
        preset = LLAMA_PRESETS[preset]
    hidden, intermediate, heads, layers = preset
    llama_config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        num_hidden_layers=layers,
        max_position_embeddings=max_seq_len,
        **config,
    )
    return LlamaForCausalLM(llama_config)


def build_model(
    model: str,
    vocab_size: int,
    seq_len: int,
    *,
    weights: str | None = None,
    checkpointing: bool = False,
) -> nn.Module:
    """The one model builder of the training loop, the planner and ``slimopt bench``: a Hugging
    Face config file or directory ``model`` (``AutoModelForCausalLM``), else a LLaMA preset name,
    randomly initialised with ``vocab_size`` tokens and room for ``seq_len``; with its weights
    stored as ``weights`` says (``slimopt.weight_formats``: built directly in the dtype it
    computes in, buffers too, then "int8" quantizes the linear weights; None: as built), with
    activation checkpointing if asked, in training mode. Raises ``ValueError`` for a name that
    is neither a path nor a preset, or an unknown ``weights``."""
    weights = None if weights is None else weight_dtype(weights)
    dtype = None if weights is None else COMPUTE_DTYPES[weights]
    with contextlib.nullcontext() if dtype is None else default_dtype(dtype):
        if Path(model).exists():
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(model)
            config.vocab_size = vocab_size
            built = AutoModelForCausalLM.from_config(config)
        else:
            built = build_llama(model, vocab_size, max_seq_len=seq_len)
    if dtype is not None:
        built.to(dtype)  # also the buffers Hugging Face makes in fp32 explicitly (rotary)
    if weights == "int8":
        quantize_weights(built, "int8")
    if checkpointing:
        enable_checkpointing(built)
    return built.train()


def enable_checkpointing(model: nn.Module) -> None:
    """Turn on activation checkpointing of a Hugging Face model (and off its KV cache, which
    checkpointed training cannot use), with the API of the installed transformers."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.config.use_cache = False


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create floating-point tensors in ``dtype`` inside the block: a bf16 model is then built in
    bf16 directly, without an fp32 copy twice its size (27 GB for LLaMA-7B)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
