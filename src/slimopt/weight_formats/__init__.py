"""The dtype a model's weights are stored in, chosen once: fp32, bf16, bf16 with an 8-bit
correction ("bf16+8", kept by the optimizer) or int8 weights that train: the linear layers'
("int8"), and the input embedding too ("int8-embed"), and the output head too ("int8-all").

``quantize_weights(model, "int8")`` turns every ``nn.Linear`` weight (but the output head's and
weights shared with an embedding) into an ``Int8Weight``: int8 codes with fp32 block scales,
updated by slimopt's optimizers with unbiased stochastic rounding; "int8-embed" and "int8-all"
add the embedding and the head (one tensor, quantized once, when they are tied). The model's ``state_dict``
then holds ``weight_codes`` and ``weight_scales`` for each such weight, and loads either those
or plain float weights (rounded to nearest). ``export_weights`` writes the dequantized weights
as a plain safetensors file that any model of the architecture loads.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from slimopt.targets import output_head
from slimopt.weight_formats.int8 import BLOCK_SIZE, Int8Weight, dequantize

WEIGHT_DTYPES = ("fp32", "bf16", "bf16+8", "int8", "int8-embed", "int8-all")
# The int8 dtypes, and what each makes int8 besides the linear layers' weights.
INT8_PARTS: dict[str, tuple[str, ...]] = {
    "int8": (),
    "int8-embed": ("embedding",),
    "int8-all": ("embedding", "head"),
}
# Clearer spellings, accepted everywhere a weight dtype is.
ALIASES = {"float32": "fp32", "bfloat16": "bf16", "bf16-corrected": "bf16+8", "int8-sr": "int8"}
# The dtype each is computed (and its gradient kept) in.
COMPUTE_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "bf16+8": torch.bfloat16,
    **dict.fromkeys(INT8_PARTS, torch.bfloat16),
}
# What the optimizer is told of each: bf16+8's correction is its state; with int8 linear weights
# (rounded stochastically always) the bf16 rest (embeddings, norms, head) is rounded so too.
OPTIMIZER_OPTIONS: dict[str, dict[str, Any]] = {
    "bf16+8": {"param_rounding": "corrected"},
    **{dtype: {"param_rounding": "stochastic"} for dtype in INT8_PARTS},
}
CODES, SCALES = "weight_codes", "weight_scales"

__all__ = [
    "ALIASES",
    "BLOCK_SIZE",
    "COMPUTE_DTYPES",
    "INT8_PARTS",
    "WEIGHT_DTYPES",
    "Int8Weight",
    "dequantized_state_dict",
    "export_weights",
    "is_int8",
    "lost_int8_weights",
    "optimizer_options",
    "quantize_weights",
    "stored_dtype",
    "weight_dtype",
]


def weight_dtype(name: str) -> str:
    """The canonical name of weight dtype ``name``, an alias resolved.

    Args:
        name: a weight dtype or one of its aliases.

    Returns:
        One of ``WEIGHT_DTYPES``.

    Raises:
        ValueError: an unknown name, naming the valid choices.
    """
    canonical = ALIASES.get(name, name)
    if canonical not in WEIGHT_DTYPES:
        valid = ", ".join([*WEIGHT_DTYPES, *ALIASES])
        raise ValueError(f"unknown weight dtype {name!r}; valid: {valid}")
    return canonical


def is_int8(dtype: str) -> bool:
    """Whether weight dtype ``dtype`` stores weights as int8 codes."""
    return weight_dtype(dtype) in INT8_PARTS


def stored_dtype(state: dict[str, Tensor]) -> str:
    """The weight dtype a model state dict holds: "int8" when it holds int8 codes, else that of
    most of its floating-point values ("fp32" or "bf16"; a correction is not in a model's state,
    so bf16+8 reads as bf16)."""
    if any(key.endswith(CODES) for key in state):
        return "int8"
    counts = {dtype: 0 for dtype in (torch.float32, torch.bfloat16)}
    for tensor in state.values():
        if tensor.dtype in counts:
            counts[tensor.dtype] += tensor.numel()
    return "bf16" if counts[torch.bfloat16] > counts[torch.float32] else "fp32"


def optimizer_options(dtype: str, options: dict[str, Any]) -> dict[str, Any]:
    """The optimizer options that weights stored as ``dtype`` need, not in ``options`` already.

    Args:
        dtype: a weight dtype (``WEIGHT_DTYPES``).
        options: the optimizer options given.

    Returns:
        The options to add, ``param_rounding="corrected"`` for ``"bf16+8"`` and ``"stochastic"``
        for the int8 dtypes; none for the others.

    Raises:
        ValueError: ``options`` contradict them.
    """
    needed = OPTIMIZER_OPTIONS.get(weight_dtype(dtype), {})
    for key, value in needed.items():
        if key in options and options[key] != value:
            raise ValueError(f"{dtype} weights take {key}={value!r}, not {options[key]!r}")
    return {key: value for key, value in needed.items() if key not in options}


def quantize_weights(
    model: nn.Module,
    dtype: str = "int8",
    *,
    block_size: int = BLOCK_SIZE,
    skip: Iterable[str] | None = None,
) -> nn.Module:
    """Store ``model``'s weights in ``dtype``, in place.

    "fp32" and "bf16" cast every floating-point parameter and buffer. "int8" casts the model to
    bf16 (unless it is fp32 or bf16 already) and stores every ``nn.Linear`` weight as an
    [Int8Weight][slimopt.weight_formats.Int8Weight] with one scale per ``block_size`` columns,
    except the modules ``skip`` names, weights shared with another module (a tied embedding) and
    empty weights; they stay as they are. "int8-embed" stores the input embedding
    (``get_input_embeddings()``, an ``nn.Embedding``) so too, "int8-all" the embedding and the
    output head (an ``nn.Linear``); a tied embedding and head are one tensor, quantized once, and
    need "int8-all". What each costs in quality: [weight formats](../results/weights.md).

    Args:
        model: the model, changed in place.
        dtype: one of ``WEIGHT_DTYPES``: ``"fp32"``, ``"bf16"``, ``"int8"``, ``"int8-embed"``,
            ``"int8-all"``. ``"bf16+8"`` raises: its correction is the optimizer's state (cast to
            bf16 and build the optimizer with ``param_rounding="corrected"``).
        block_size: columns per int8 scale.
        skip: names of modules left as they are: a module whose name is one of them or ends with
            ``.`` and one of them (None: the output head, the model's
            ``get_output_embeddings()`` or else its ``lm_head``).

    Returns:
        ``model`` itself.

    Raises:
        ValueError: a bad dtype or block size, a model already in int8 asked for another dtype, or
            an embedding or head the dtype cannot take (naming why).
    """
    dtype = weight_dtype(dtype)
    if dtype == "bf16+8":
        raise ValueError(
            "bf16+8 keeps its 8-bit correction in the optimizer's state: call "
            "quantize_weights(model, 'bf16') and build the optimizer with param_rounding='corrected'"
        )
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    quantized = [name for name, param in model.named_parameters() if isinstance(param, Int8Weight)]
    if quantized and dtype not in INT8_PARTS:
        raise ValueError(f"{quantized[0]} is int8 already; export_weights gives its values in {dtype}")
    if dtype not in INT8_PARTS:
        return model.to(COMPUTE_DTYPES[dtype])
    parts = _int8_parts(model, dtype)  # checked before anything changes
    if any(
        p.is_floating_point() and p.dtype not in (torch.float32, torch.bfloat16) for p in model.parameters()
    ):
        model.to(torch.bfloat16)
    shared = _shared_parameters(model)
    head = output_head(model) if skip is None else None
    names = tuple(skip or ())
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (
            type(module) is not nn.Linear
            or module is head
            or isinstance(weight, Int8Weight)
            or id(weight) in shared
            or weight.numel() == 0
            or any(name == s or name.endswith("." + s) for s in names)
        ):
            continue
        _quantize(module, block_size)
    tied = len(parts) == 2 and parts[0].weight is parts[1].weight
    for position, module in enumerate(parts):
        if tied and position == 1:  # one tensor: its codes saved under the head's names too
            _quantize(module, block_size, parts[0].weight)
        elif not isinstance(module.weight, Int8Weight):
            _quantize(module, block_size)
    return model


def _quantize(module: nn.Module, block_size: int, shared: nn.Parameter | None = None) -> None:
    """Store ``module``'s weight as an ``Int8Weight`` (or give it ``shared``, the int8 weight
    it is tied to) and save and load it as codes and scales."""
    if shared is None:
        shared = nn.Parameter(
            Int8Weight.from_float(module.weight, block_size), requires_grad=module.weight.requires_grad
        )
    module.weight = shared
    module.register_state_dict_post_hook(_save_codes)
    module.register_load_state_dict_pre_hook(_load_codes)


def _int8_parts(model: nn.Module, dtype: str) -> list[nn.Module]:
    """The modules besides the linear layers whose weights ``dtype`` makes int8 (the embedding,
    then the head); raises ``ValueError`` for a model that has not such a module, or whose tied
    embedding and head ``dtype`` would split."""
    wanted = INT8_PARTS[dtype]
    if not wanted:
        return []
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    if not isinstance(embedding, nn.Embedding):
        raise ValueError(f"{dtype} makes the input embedding int8, but this model has no nn.Embedding one")
    if embedding.max_norm is not None or embedding.sparse:
        raise ValueError(
            f"{dtype}: the input embedding renormalizes rows (max_norm) or has sparse gradients, "
            "which an int8 embedding does not take; use int8"
        )
    head = output_head(model)
    tied = head is not None and getattr(head, "weight", None) is embedding.weight
    if "head" not in wanted:
        if tied:
            raise ValueError(
                "the input embedding and the output head are one tensor (tied) in this model: "
                "int8-all makes it int8, int8 keeps it bf16"
            )
        return [embedding]
    if type(head) is not nn.Linear:
        kind = "none" if head is None else f"a {type(head).__name__}"
        raise ValueError(f"int8-all makes the output head (an nn.Linear) int8, but this model's is {kind}")
    return [embedding, head]


def lost_int8_weights(model: nn.Module) -> list[str]:
    """The modules of ``model`` that ``quantize_weights`` made int8 but whose weight is a plain
    tensor now: FSDP2's ``fully_shard`` gathers and re-splits weights as plain tensors, so an
    int8 model it wraps trains as a bf16 one."""
    return [
        name
        for name, module in model.named_modules()
        if _save_codes in module._state_dict_hooks.values()
        and not isinstance(getattr(module, "weight", None), Int8Weight)
    ]


def _shared_parameters(model: nn.Module) -> set[int]:
    """ids of parameters that more than one module holds."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return {key for key, count in owners.items() if count > 1}


def _save_codes(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    weight = state_dict.pop(prefix + "weight", None)
    if isinstance(weight, Int8Weight):
        state_dict[prefix + CODES] = weight.codes
        state_dict[prefix + SCALES] = weight.scales
    elif weight is not None:
        state_dict[prefix + "weight"] = weight


def _load_codes(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    if prefix + CODES in state_dict and prefix + SCALES in state_dict:
        codes, scales = state_dict.pop(prefix + CODES), state_dict.pop(prefix + SCALES)
        state_dict[prefix + "weight"] = Int8Weight(codes, scales, module.weight.dtype)


def dequantized_state_dict(model: nn.Module, dtype: torch.dtype | None = torch.bfloat16) -> dict[str, Tensor]:
    """``model.state_dict()`` as a plain model of its architecture loads it, strictly.

    Every int8 weight's codes and scales become its values, under its own name. A tensor shared
    under several names (an embedding tied to the head) is under each of them, a copy of it under
    all but the first, as a file holds it.

    Args:
        model: the model, int8 weights and all.
        dtype: the dtype of its floating-point tensors (None: as they are).

    Returns:
        The state dict.
    """
    state = model.state_dict()
    plain: dict[str, Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for key, tensor in state.items():
        if key.endswith(SCALES):
            continue
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        shared = where in seen and tensor.numel() > 0
        seen.add(where)
        if key.endswith(CODES):
            key = key[: -len(CODES)] + "weight"
            tensor = dequantize(tensor, state[key[: -len("weight")] + SCALES])
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensor = tensor.detach()
        plain[key] = tensor.clone() if shared else tensor.contiguous()
    return plain


def export_weights(model: nn.Module, path: str | Path, dtype: torch.dtype | None = torch.bfloat16) -> Path:
    """Write ``model``'s weights as a safetensors file that a plain model of its architecture loads.

    Written atomically: a file of that name appears whole or not at all.

    Args:
        model: the model, int8 weights and all.
        path: the file to write.
        dtype: the dtype of its floating-point tensors (None: as they are).

    Returns:
        The path written.
    """
    from safetensors.torch import save_file

    path = Path(path)
    staging = path.with_name(f".{path.name}.partial")
    save_file({k: v.cpu() for k, v in dequantized_state_dict(model, dtype).items()}, str(staging))
    staging.replace(path)
    return path
