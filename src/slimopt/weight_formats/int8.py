"""Linear weights stored as int8 codes with one fp32 scale per block of a row, that train.

An ``Int8Weight`` is a tensor subclass that looks like an m×n weight of its ``dtype`` (the
dtype its gradient has) and holds ``codes`` (int8, m×n) and ``scales`` (fp32, m×blocks):
weight ≈ code · scale. ``F.linear`` dequantizes it for the forward matmul and again for the
backward one, and saves only the codes for backward, so no full-precision copy of the matrix
outlives one matmul. Blocks are ``block_size`` columns of one row (the whole row when that does
not divide it), so a slice of rows is a view of the codes and scales it owns.

Optimizers write a new value with ``store_``: codes are rounded stochastically (unbiased:
E[code · scale] is the value written), and a block keeps its scale unless the new value no
longer fits it (its largest magnitude above 127 scales) or uses less than half of it. A block
whose scale is refitted gets ⅛ headroom, so a slowly growing largest weight does not re-round
its block at every step: with a fixed scale the rounding noise of a step is that of the step's
own change, not of the whole weight.

Everything else reads the dequantized values; an in-place change other than ``copy_`` raises,
because it would be rounded where slimopt cannot say how (``store_`` is the one way to write).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import return_and_correct_aliasing
from torch.utils._pytree import tree_map

from slimopt.codecs.draws import floor_stochastically_
from slimopt.codecs.slicing import row_slices

CODE_MAX = 127
# Why several processes cannot share int8 weights, and the way out: DDP broadcasts and buckets
# parameters as flat plain tensors, and FSDP2 gathers row shards of them, neither of which an
# int8 weight's codes and block scales are.
INT8_ONE_PROCESS = (
    "int8 weights train in one process (DDP, ZeRO-1 and FSDP2 move parameters as plain tensors); "
    "with several processes use bf16+8 or bf16 weights"
)
BLOCK_SIZE = 256
HEADROOM = 9 / 8
# A block fitted to its largest magnitude x has scale x/127, and 127 · (x/127) can come out an ulp
# or two below x in fp32: such a block still fits its scale.
FIT_SLACK = 1 + 2**-20
aten = torch.ops.aten


def block_of(cols: int, block_size: int) -> int:
    """The columns per block of a row of ``cols``: ``block_size`` if it divides the row, else
    the whole row."""
    return block_size if 0 < block_size < cols and cols % block_size == 0 else cols


def quantize(values: Tensor, block_size: int = BLOCK_SIZE) -> tuple[Tensor, Tensor]:
    """(codes, scales) of the m×n ``values``, rounded to nearest, each block's scale its largest
    magnitude over 127 (an all-zero block: scale 0, codes 0)."""
    rows, cols = values.shape
    block = block_of(cols, block_size)
    blocks = values.detach().float().reshape(rows, cols // block, block)
    scales = blocks.abs().amax(-1).div_(CODE_MAX)
    codes = blocks.mul(_inverse(scales).unsqueeze(-1)).round_().clamp_(-CODE_MAX, CODE_MAX)
    return codes.to(torch.int8).view(rows, cols), scales


def _inverse(scales: Tensor) -> Tensor:
    return torch.where(scales > 0, scales.reciprocal(), 0.0)


def dequantize(codes: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """code · scale as an m×n tensor of ``dtype`` (one allocation of that size)."""
    values = codes.to(torch.float32)
    values.view(codes.shape[0], scales.shape[1], -1).mul_(scales.unsqueeze(-1))
    return values if dtype == torch.float32 else values.to(dtype)


def store_(codes: Tensor, scales: Tensor, values: Tensor, generator: torch.Generator | None) -> None:
    """Write the m×n fp32 ``values`` (overwritten: used as the workspace) into ``codes`` and
    ``scales`` with unbiased stochastic rounding (draws from ``generator``), refitting the scale
    only of the blocks the new values do not fit (see the module docstring)."""
    blocks = values.view(codes.shape[0], scales.shape[1], -1)
    largest = blocks.abs().amax(-1)
    limit = scales * CODE_MAX
    refit = (largest > limit * FIT_SLACK) | (largest < limit / 2)
    scales.copy_(torch.where(refit, largest * (HEADROOM / CODE_MAX), scales))
    blocks.mul_(_inverse(scales).unsqueeze(-1))
    codes.copy_(floor_stochastically_(values, generator).clamp_(-CODE_MAX, CODE_MAX))


class Int8Weight(Tensor):
    """An m×n weight of ``dtype`` stored as int8 ``codes`` and fp32 block ``scales`` (see the
    module docstring). Build one with ``Int8Weight.from_float``."""

    codes: Tensor
    scales: Tensor

    @staticmethod
    def __new__(cls, codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Int8Weight:
        return Tensor._make_wrapper_subclass(cls, codes.shape, dtype=dtype, device=codes.device)

    def __init__(self, codes: Tensor, scales: Tensor, dtype: torch.dtype) -> None:
        self.codes = codes
        self.scales = scales

    @classmethod
    def from_float(cls, weight: Tensor, block_size: int = BLOCK_SIZE) -> Int8Weight:
        """``weight`` (2-D, floating point) quantized to nearest; it keeps ``weight``'s dtype as
        the dtype it shows (and its gradients have)."""
        codes, scales = quantize(weight, block_size)
        return cls(codes, scales, weight.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The weight's values as a plain tensor of ``dtype`` (its own dtype by default)."""
        return dequantize(self.codes, self.scales, dtype or self.dtype)

    def store_(self, values: Tensor, generator: torch.Generator | None) -> None:
        """Write fp32 ``values`` of this shape (overwritten) with stochastic rounding."""
        store_(self.codes, self.scales, values, generator)

    @property
    def block_size(self) -> int:
        """Columns per block of scales."""
        return self.shape[1] // self.scales.shape[1]

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (
            f"Int8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
            f"block_size={self.block_size}, requires_grad={self.requires_grad})"
        )

    def __tensor_flatten__(self) -> tuple[list[str], tuple[torch.dtype]]:
        return ["codes", "scales"], (self.dtype,)

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, Tensor], meta: tuple, outer_size: Any, outer_stride: Any
    ) -> Int8Weight:
        return Int8Weight(inner["codes"], inner["scales"], *meta)

    def __reduce_ex__(self, protocol: int) -> tuple:
        return Int8Weight, (self.codes, self.scales, self.dtype)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            return _Linear.apply(*args, **kwargs)
        if func is F.embedding:
            return _embedding(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        if func._schema.is_mutable:
            raise TypeError(
                f"{func.__name__} would change an int8 weight in place; slimopt's optimizers "
                "write int8 weights (Int8Weight.store_), other writes go through copy_"
            )
        plain = tree_map(
            lambda value: value.dequantize() if isinstance(value, Int8Weight) else value, (args, kwargs)
        )
        return func(*plain[0], **plain[1])


# A weight with more elements than this is dequantized for its matmuls a slice of rows of at most
# this many elements at a time (64 MiB in bf16), so that no copy of a large matrix (an output
# head: 0.98 GiB in bf16 at a 128k vocabulary) exists in forward or backward.
MATMUL_NUMEL = 1 << 25


def matmul_slices(weight: Tensor) -> list[slice]:
    """The slices of rows of ``weight`` its matmuls dequantize at a time (one for a weight of
    at most ``MATMUL_NUMEL`` elements): ``row_slices`` of that size."""
    return row_slices(*weight.shape, numel=MATMUL_NUMEL)


class _Linear(torch.autograd.Function):
    """``F.linear`` with an ``Int8Weight``: dequantized in the input's dtype for each matmul, a
    slice of rows at a time for a large weight (``MATMUL_NUMEL``): the forward's output columns
    slice by slice, the input's gradient summed over the slices in fp32 (each slice's product
    in the gradient's dtype, as one matmul computes it, the sum rounded once into it)."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, weight: Int8Weight, bias: Tensor | None = None) -> Tensor:
        ctx.save_for_backward(input, weight)
        ctx.has_bias = bias is not None
        parts = matmul_slices(weight)
        if len(parts) == 1:
            return F.linear(input, weight.dequantize(input.dtype), bias)
        output = input.new_empty(*input.shape[:-1], weight.shape[0])
        for rows in parts:
            part_bias = None if bias is None else bias[rows]
            output[..., rows] = F.linear(input, weight[rows].dequantize(input.dtype), part_bias)
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = _input_gradient(grad, weight)
        if ctx.needs_input_grad[1]:
            flat = grad.reshape(-1, grad.shape[-1])
            grad_weight = flat.t() @ input.reshape(-1, input.shape[-1]).to(grad.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_input, grad_weight, grad_bias


def _input_gradient(grad: Tensor, weight: Int8Weight) -> Tensor:
    """``grad @ weight`` (the gradient of ``F.linear``'s input), a slice of rows of a large
    weight at a time."""
    parts = matmul_slices(weight)
    if len(parts) == 1:
        return grad @ weight.dequantize(grad.dtype)
    flat = grad.reshape(-1, grad.shape[-1])
    total = flat.new_zeros(flat.shape[0], weight.shape[1], dtype=torch.float32)
    for rows in parts:
        total += flat[:, rows] @ weight[rows].dequantize(grad.dtype)
    return total.to(grad.dtype).view(*grad.shape[:-1], weight.shape[1])


def _embedding(
    input: Tensor,
    weight: Int8Weight,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Tensor:
    """``F.embedding`` with an ``Int8Weight``: the rows ``input`` names decoded, the gradient
    the dense one a bf16 embedding's has."""
    if max_norm is not None or sparse:
        raise ValueError(
            "an int8 embedding takes neither max_norm (which renormalizes rows in place) nor "
            "sparse gradients; keep this embedding in bf16"
        )
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return _Embedding.apply(input, weight, -1 if padding_idx is None else padding_idx, scale_grad_by_freq)


class _Embedding(torch.autograd.Function):
    """An embedding lookup in an ``Int8Weight``: only the looked-up rows are dequantized (in the
    weight's dtype, through fp32 as ``dequantize`` does); backward is aten's dense embedding
    gradient, as for a plain weight of that dtype."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, weight: Int8Weight, padding_idx: int, by_frequency: bool) -> Tensor:
        ctx.save_for_backward(input)
        ctx.rows, ctx.padding_idx, ctx.by_frequency = weight.shape[0], padding_idx, by_frequency
        flat = input.reshape(-1)
        values = dequantize(weight.codes[flat], weight.scales[flat], weight.dtype)
        return values.view(*input.shape, weight.shape[1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (input,) = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = aten.embedding_dense_backward(
                grad, input, ctx.rows, ctx.padding_idx, ctx.by_frequency
            )
        return None, grad_weight, None, None


def _wrap(
    func: Any, args: tuple, kwargs: dict, codes: Tensor, scales: Tensor, dtype: torch.dtype
) -> Int8Weight:
    return return_and_correct_aliasing(func, args, kwargs, Int8Weight(codes, scales, dtype))


def _alias(func: Any, args: tuple, kwargs: dict) -> Int8Weight:
    weight = args[0]
    return _wrap(func, args, kwargs, func(weight.codes), func(weight.scales), weight.dtype)


def _clone(func: Any, args: tuple, kwargs: dict) -> Int8Weight:
    weight = args[0]
    return Int8Weight(weight.codes.clone(), weight.scales.clone(), weight.dtype)


def _slice(func: Any, args: tuple, kwargs: dict) -> Int8Weight:
    weight, dim, *bounds = args
    if dim not in (0, -2):
        raise NotImplementedError("an int8 weight is sliced by rows only (its scales cover blocks of a row)")
    codes, scales = func(weight.codes, 0, *bounds), func(weight.scales, 0, *bounds)
    return _wrap(func, args, kwargs, codes, scales, weight.dtype)


def _view(func: Any, args: tuple, kwargs: dict) -> Int8Weight:
    weight, shape = args[0], torch.Size(args[1])
    if shape != weight.shape:
        flat = f" ({INT8_ONE_PROCESS})" if len(shape) == 1 else ""  # DDP flattens to broadcast
        raise NotImplementedError(
            f"an int8 weight of shape {tuple(weight.shape)} has no view as {tuple(shape)}{flat}"
        )
    return _wrap(
        func, args, kwargs, weight.codes.view(shape), weight.scales.view(weight.scales.shape), weight.dtype
    )


def _to_copy(func: Any, args: tuple, kwargs: dict) -> Int8Weight:
    """A move to another device keeps the codes; a dtype changes only the dtype shown."""
    weight, device = args[0], kwargs.get("device")
    dtype = kwargs.get("dtype") or weight.dtype
    return Int8Weight(weight.codes.to(device), weight.scales.to(device), dtype)


def _copy(func: Any, args: tuple, kwargs: dict) -> Tensor:
    """Into an int8 weight: another one's codes and scales, or a plain tensor rounded to nearest
    in this weight's blocks; from one: its values."""
    target, source = args[0], args[1]
    if not isinstance(target, Int8Weight):
        return target.copy_(source.dequantize(target.dtype))
    if isinstance(source, Int8Weight):
        if source.scales.shape != target.scales.shape:
            raise ValueError(
                f"int8 weights of blocks of {source.block_size} and {target.block_size} columns differ"
            )
        target.codes.copy_(source.codes)
        target.scales.copy_(source.scales)
        return target
    codes, scales = quantize(source.to(target.device), target.block_size)
    target.codes.copy_(codes)
    target.scales.copy_(scales)
    return target


def _like(func: Any, args: tuple, kwargs: dict) -> Tensor:
    """zeros_like, empty_like and ones_like give a plain tensor of the weight's dtype."""
    weight = args[0]
    kwargs = {
        **kwargs,
        "dtype": kwargs.get("dtype") or weight.dtype,
        "device": kwargs.get("device") or weight.device,
    }
    return func(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), *args[1:], **kwargs)


_HANDLERS = {
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.clone.default: _clone,
    aten.slice.Tensor: _slice,
    aten.view.default: _view,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy,
    aten.zeros_like.default: _like,
    aten.empty_like.default: _like,
    aten.ones_like.default: _like,
}
