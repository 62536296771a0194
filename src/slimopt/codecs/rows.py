"""Moments of large matrices stored as independent slices of rows.

An update of a large matrix would otherwise need several full-size fp32 temporaries at once (the
gradient, each decoded moment, the direction, the weights): 3.7 GiB for the 32000×4096 embedding
of a 7B model. The optimizer instead updates such a matrix a slice of rows at a time
(``row_slices``), and its moments are stored so that each slice decodes and encodes on its own:
every slice is encoded with the codec its shape gets, and each stored part (codes, scales, …) is
the flat concatenation of the slices' parts. Quantization blocks and scales therefore never
straddle two slices. A part with one value per element (fp32 and bf16 moments) is the slices
stacked, so it keeps the matrix's shape, as torch.optim's moments keep the parameter's.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor

from slimopt.codecs.choose import moment_codec
from slimopt.codecs.slicing import matrix_shape, row_slices


@cache
def row_sliced_storage(states: str, kind: str, shape: torch.Size, block_size: int | None) -> RowSlicedStorage:
    """The (cached) layout of a moment of a tensor of ``shape`` stored by slices of rows."""
    return RowSlicedStorage(states, kind, shape, block_size)


class RowSlicedStorage:
    """Where each slice's parts live inside the flat stored tensors of one moment.

    A slice of a 3-D tensor (stacked experts) keeps its three dimensions when it is encoded, so
    the codecs that read an expert's rows and columns (ternary and factored moments:
    ``slimopt.codecs.ternary.scaled_shape``) store each slice as they store a whole stack; values
    go in and come out as rows × cols matrices. Other tensors are sliced as rows × cols matrices.
    """

    def __init__(self, states: str, kind: str, shape: torch.Size, block_size: int | None) -> None:
        rows, cols = matrix_shape(shape)
        self.slices = row_slices(rows, cols)
        self.codecs = []
        self.layout: list[dict[str, tuple[int, torch.Size]]] = []  # per slice: part -> (offset, shape)
        self.sizes: dict[str, int] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.shape = torch.Size((rows, cols))
        per_element: dict[str, bool] = {}
        for rows_slice in self.slices:
            inner = shape[1:] if len(shape) == 3 else (cols,)
            slice_shape = torch.Size((rows_slice.stop - rows_slice.start, *inner))
            codec = moment_codec(states, kind, slice_shape, block_size)
            parts = _part_shapes(codec, slice_shape)
            entry = {}
            for part, (part_shape, dtype) in parts.items():
                is_per_element = part_shape == slice_shape
                per_element[part] = per_element.get(part, True) and is_per_element
                if is_per_element:  # read and written as the slice's rows × cols, as values are
                    part_shape = torch.Size((slice_shape[0], cols))
                entry[part] = (self.sizes.get(part, 0), part_shape)
                self.sizes[part] = self.sizes.get(part, 0) + part_shape.numel()
                self.dtypes[part] = dtype
            self.codecs.append((codec, slice_shape))
            self.layout.append(entry)
        self.per_element = {part for part, every in per_element.items() if every}

    def allocate(self, device: torch.device, shape: torch.Size | None = None) -> dict[str, Tensor]:
        """Empty tensors for every part (each slice is written by ``encode``): ``shape`` (the
        parameter's, default rows × cols) for a part with one value per element, flat for the
        others."""
        return {
            part: torch.empty(
                (shape or self.shape) if part in self.per_element else torch.Size((size,)),
                dtype=self.dtypes[part],
                device=device,
            )
            for part, size in self.sizes.items()
        }

    def decode_all(self, stored: dict[str, Tensor]) -> Tensor:
        """The whole fp32 moment, rows × cols."""
        return torch.cat([self.decode(stored, index) for index in range(len(self.slices))])

    def encode_all(self, value: Tensor, generator: torch.Generator | None) -> dict[str, Tensor]:
        """Stored parts for a whole fp32 moment (of rows × elements, in any shape); per-element
        parts keep ``value``'s shape."""
        stored = self.allocate(value.device, value.shape)
        matrix = value.reshape(self.shape)
        for index, rows in enumerate(self.slices):
            self.encode(stored, index, matrix[rows], generator)
        return stored

    def parts(self, stored: dict[str, Tensor], index: int) -> dict[str, Tensor]:
        """Slice ``index``'s stored parts: views into ``stored`` (writing them writes it)."""
        return {
            part: _view(stored[part], offset, part_shape)
            for part, (offset, part_shape) in self.layout[index].items()
        }

    def decode(self, stored: dict[str, Tensor], index: int) -> Tensor:
        """The fp32 moment of slice ``index``, rows × cols."""
        codec, shape = self.codecs[index]
        return codec.decode(self.parts(stored, index), shape).view(shape[0], -1)

    def encode(
        self, stored: dict[str, Tensor], index: int, value: Tensor, generator: torch.Generator | None
    ) -> None:
        """Encode slice ``index`` of the moment into ``stored`` in place."""
        codec, shape = self.codecs[index]
        for part, encoded in codec.encode(value.reshape(shape), generator).items():
            offset, part_shape = self.layout[index][part]
            target = _view(stored[part], offset, part_shape)
            if target.data_ptr() != encoded.data_ptr() or target.device.type == "meta":
                target.copy_(encoded.reshape(target.shape))


def _view(stored: Tensor, offset: int, shape: torch.Size) -> Tensor:
    return stored.view(-1)[offset : offset + shape.numel()].view(shape)


@cache
def _part_shapes_cached(codec: object, shape: torch.Size) -> tuple[tuple[str, torch.Size, torch.dtype], ...]:
    encoded = codec.encode(torch.zeros(shape, device="meta"), torch.Generator())
    return tuple((part, tensor.shape, tensor.dtype) for part, tensor in encoded.items())


def _part_shapes(codec: object, shape: torch.Size) -> dict[str, tuple[torch.Size, torch.dtype]]:
    return {part: (part_shape, dtype) for part, part_shape, dtype in _part_shapes_cached(codec, shape)}
