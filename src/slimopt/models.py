"""LLaMA presets (the GaLore paper's shapes, LLaMA-2-70B's and LLaMA-3-8B's) and a builder."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from slimopt.weight_formats import COMPUTE_DTYPES, is_int8, quantize_weights, weight_dtype


class LlamaShape(NamedTuple):
    """A LLaMA model's shape: hidden and MLP widths, attention heads, layers, the key/value heads
    of grouped-query attention (None: one per head) and the vocabulary it has of its own."""

    hidden: int
    intermediate: int
    heads: int
    layers: int
    kv_heads: int | None = None
    vocab: int = 32000


LLAMA_PRESETS: dict[str, LlamaShape] = {
    "llama_9m": LlamaShape(128, 352, 4, 4),
    "llama_20m": LlamaShape(256, 688, 4, 4),
    "llama_35m": LlamaShape(384, 1024, 8, 6),
    "llama_60m": LlamaShape(512, 1376, 8, 8),
    "llama_130m": LlamaShape(768, 2048, 12, 12),
    "llama_350m": LlamaShape(1024, 2736, 16, 24),
    "llama_1b": LlamaShape(2048, 5461, 32, 24),
    "llama_7b": LlamaShape(4096, 11008, 32, 32),
    "llama_13b": LlamaShape(5120, 13824, 40, 40),
    # LLaMA-2-70B: grouped-query attention, 8 key/value heads for 64.
    "llama_70b": LlamaShape(8192, 28672, 64, 80, kv_heads=8),
    # LLaMA-3-8B: 128,256 tokens, the embedding and head a tenth of its parameters.
    "llama3_8b": LlamaShape(4096, 14336, 32, 32, kv_heads=8, vocab=128256),
}


def build_llama(
    preset: str | tuple[int, ...], vocab_size: int | None = None, max_seq_len: int = 1024, **config: Any
) -> nn.Module:
    """Return a randomly initialised ``transformers.LlamaForCausalLM``.

    ``preset`` is a name from ``LLAMA_PRESETS`` or an explicit ``LlamaShape`` (or its first four
    fields: hidden, intermediate, heads, layers); ``vocab_size`` replaces its own vocabulary
    (None: the shape's). Raises ``ValueError`` for an unknown name.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if isinstance(preset, str):
        if preset not in LLAMA_PRESETS:
            raise ValueError(f"unknown model preset {preset!r}; valid: {', '.join(LLAMA_PRESETS)}")
        preset = LLAMA_PRESETS[preset]
    shape = LlamaShape(*preset)
    llama_config = LlamaConfig(
        vocab_size=shape.vocab if vocab_size is None else vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads or shape.heads,
        num_hidden_layers=shape.layers,
        max_position_embeddings=max_seq_len,
        **config,
    )
    return LlamaForCausalLM(llama_config)


def build_model(
    model: str,
    vocab_size: int | None,
    seq_len: int,
    *,
    weights: str | None = None,
    checkpointing: bool = False,
) -> nn.Module:
    """The one model builder of the training loop, the planner and ``slimopt bench``: a Hugging
    Face config file or directory ``model`` (``AutoModelForCausalLM``), else a LLaMA preset name,
    randomly initialised with ``vocab_size`` tokens (None: the model's own vocabulary) and room
    for ``seq_len``; with its weights
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
            config.vocab_size = config.vocab_size if vocab_size is None else vocab_size
            built = AutoModelForCausalLM.from_config(config)
        else:
            built = build_llama(model, vocab_size, max_seq_len=seq_len)
    if dtype is not None:
        built.to(dtype)  # also the buffers Hugging Face makes in fp32 explicitly (rotary)
    if weights is not None and is_int8(weights):
        quantize_weights(built, weights)
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
