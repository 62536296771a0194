"""Block-wise quantization against a code map (the bitsandbytes / torchao scheme).

A tensor is flattened and cut into blocks; each block is divided by its absolute maximum (kept
in fp32) and every element is stored as the index of the nearest map value: 8 bits per element,
or two 4-bit indices per byte.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


class BlockwiseCodec:
    """Nearest-value quantization with a per-block absmax.

    ``positive_floor``: for non-negative tensors (second moments) a positive value never takes
    the zero code, so it never decodes to 0 and 1/√v stays finite.
    """

    parts = ("codes", "absmax")
    stochastic = False

    def __init__(self, code_map: Tensor, block_size: int, *, positive_floor: bool = False) -> None:
        self.code_map = code_map
        self.block_size = block_size
        self.bits = 4 if code_map.numel() <= 16 else 8
        self.positive_floor = positive_floor
        # Index of the zero code (computed once on the CPU: no device sync per encode).
        self.zero_code = int(torch.searchsorted(code_map, torch.zeros(())))
        self._device_maps: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def _maps(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The map and the midpoints between its neighbours, on ``device``."""
        if device not in self._device_maps:
            values = self.code_map.to(device)
            self._device_maps[device] = values, (values[1:] + values[:-1]) / 2
        return self._device_maps[device]

    def encode(self, value: Tensor, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        _, midpoints = self._maps(value.device)
        blocks = _blocks(value, self.block_size)
        absmax = blocks.abs().amax(dim=1)
        normalized = blocks / torch.where(absmax > 0, absmax, 1.0).unsqueeze(1)
        codes = torch.bucketize(normalized, midpoints, out_int32=True)
        if self.positive_floor:
            lifted = (normalized > 0) & (codes == self.zero_code)
            codes = torch.where(lifted, self.zero_code + 1, codes)
        codes = codes.to(torch.uint8).reshape(-1)
        if self.bits == 4:
            codes = codes[0::2] | (codes[1::2] << 4)
        return {"codes": codes, "absmax": absmax}

    def decode(self, stored: Mapping[str, Tensor], shape: torch.Size) -> Tensor:
        values, _ = self._maps(stored["codes"].device)
        codes = stored["codes"]
        if self.bits == 4:
            codes = torch.stack([codes & 15, codes >> 4], dim=1).reshape(-1)
        # int32 indices: half the memory traffic of the int64 ones plain indexing makes.
        blocks = values.index_select(0, codes.int()).view(-1, self.block_size) * stored["absmax"].unsqueeze(1)
        return _unblock(blocks, shape)


def _blocks(value: Tensor, block_size: int) -> Tensor:
    """``value`` flattened, zero-padded to whole blocks, as (blocks, block_size) fp32."""
    flat = value.reshape(-1).float()
    padding = -flat.numel() % block_size
    if padding:
        flat = torch.cat([flat, flat.new_zeros(padding)])
    return flat.view(-1, block_size)


def _unblock(blocks: Tensor, shape: torch.Size) -> Tensor:
    return blocks.reshape(-1)[: shape.numel()].view(shape)
