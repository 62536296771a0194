"""Running a Hugging Face training step on the meta device as a real device runs it: the
memory planner's forward and backward create every tensor a real step does, with shapes and
dtypes but no values."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode


class MetaRun(TorchFunctionMode):
    """What the meta device needs to run a Hugging Face training step like a real device.

    - ``scaled_dot_product_attention`` falls back to the math path on meta, which saves the whole
      attention matrix; CPU and CUDA run a flash kernel that saves only the output and the
      log-sum-exp. During a meta run the function is replaced by one that sends unmasked calls
      to the flash kernel's meta version (replaced, not intercepted by this mode, because
      activation checkpointing recomputes inside backward, where the mode is not active).
    - A meta tensor has no values, so ``bool()`` of one cannot be known. The library's
      data-dependent checks ask "is this input unusual?" (packed sequences, padding); the
      planner's input is the usual kind, so they get True, the answer real data would give.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.enabled = device.type == "meta"
        self.attention = torch.nn.functional.scaled_dot_product_attention

    def __enter__(self) -> MetaRun:
        if self.enabled:
            torch.nn.functional.scaled_dot_product_attention = _flash_attention
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.nn.functional.scaled_dot_product_attention = self.attention
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.enabled and func is Tensor.__bool__ and args[0].is_meta:
            return True
        return func(*args, **(kwargs or {}))


def _flash_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    if attn_mask is not None or not query.is_meta:
        return torch._C._nn.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return flash(query, key, value, dropout_p, is_causal, scale=scale)[0]
