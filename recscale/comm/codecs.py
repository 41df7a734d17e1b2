"""Wire codecs: a float32 ``[n, c]`` tensor as ``[n, row_bytes(c)]`` bytes, one row per input row.

Keeping one byte row per input row lets a collective split any payload by rows, whatever the
precision. fp16 overflows above 65504 and flushes values below about 6e-8 to zero, which is why
gradients are multiplied by a loss scale before fp16 encoding. int8 is row-wise asymmetric: each
row keeps its own scale and offset (two float32 in 8 trailing bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Precision = Literal["fp32", "fp16", "bf16", "int8"]


@dataclass(frozen=True)
class FloatCodec:
    name: str
    dtype: torch.dtype

    def row_bytes(self, cols: int) -> int:
        return cols * torch.tensor([], dtype=self.dtype).element_size()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape
        y = x.to(self.dtype).contiguous()  # a copy unless fp32, and then we never write to it
        return y.view(torch.uint8).reshape(n, self.row_bytes(c)) if n * c else x.new_zeros((n, self.row_bytes(c)), dtype=torch.uint8)

    def decode(self, b: torch.Tensor, cols: int) -> torch.Tensor:
        n = b.shape[0]
        if n * cols == 0:
            return torch.zeros(n, cols, device=b.device)
        return b.contiguous().view(self.dtype).reshape(n, cols).float()


@dataclass(frozen=True)
class RowWiseInt8Codec:
    """q = round((x - min) / scale), scale = (max - min) / 255 per row; 8 bytes of (scale, min)."""

    name: str = "int8"

    def row_bytes(self, cols: int) -> int:
        return cols + 8

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape
        out = torch.empty(n, c + 8, dtype=torch.uint8, device=x.device)
        if n == 0:
            return out
        if c == 0:
            out.zero_()
            return out
        lo = x.amin(dim=1, keepdim=True)
        hi = x.amax(dim=1, keepdim=True)
        # Divided by a tensor: CUDA multiplies by the reciprocal of a Python-number divisor (a
        # bit off now and then), which would put other bytes on the wire than the CPU does.
        scale = (hi - lo) / torch.full_like(hi, 255.0)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        out[:, :c] = torch.round((x - lo) / scale).clamp_(0, 255).to(torch.uint8)
        out[:, c:] = torch.cat([scale, lo], dim=1).float().contiguous().view(torch.uint8)
        return out

    def decode(self, b: torch.Tensor, cols: int) -> torch.Tensor:
        n = b.shape[0]
        if n == 0 or cols == 0:
            return torch.zeros(n, cols, device=b.device)
        params = b[:, cols:].contiguous().view(torch.float32)  # [n, 2]: scale, offset
        return b[:, :cols].float() * params[:, :1] + params[:, 1:]


_CODECS = {
    "fp32": FloatCodec("fp32", torch.float32),
    "fp16": FloatCodec("fp16", torch.float16),
    "bf16": FloatCodec("bf16", torch.bfloat16),
    "int8": RowWiseInt8Codec(),
}


def get_codec(name: str) -> FloatCodec | RowWiseInt8Codec:
    if name not in _CODECS:
        raise ValueError(f"unknown wire precision {name!r}; choose one of {sorted(_CODECS)}")
    return _CODECS[name]
