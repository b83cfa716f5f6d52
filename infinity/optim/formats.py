"""How an optimizer's moments are stored: fp32, bf16, or 8 bits a value with a scale per block.

[Note: moment formats]
The fp32 master is always fp32; the moments (Adam's exp_avg and exp_avg_sq, Adagrad's sum,
Lion's exp_avg) are kept in one of three formats, in host memory, on an accelerator and on NVMe
alike (`optimizer.params.moment_format`; DeepSpeed's `fp32_optimizer_states: false` is bf16):

  fp32   4 bytes a value: the moments torch keeps.
  bf16   2 bytes: the kernels load them into fp32, update there and round to nearest even on
         the way back (the update's arithmetic is fp32's).
  8bit   1 byte and a shared scale: a block of BLOCK values is stored as float8 e4m3 codes
         (sign, 4 exponent and 3 mantissa bits: a relative step of 1/8, a range of 2^17 before
         its subnormals) times the block's scale, a power of two chosen so the block's largest
         magnitude lands in (224, 448], e4m3's top octave. Like bitsandbytes' block-wise 8-bit
         state, the per-block scale follows the range of each region of the tensor and the code's
         exponent follows the range inside a block; unlike it, the code is a float format torch
         converts to and from itself. A non-negative moment (exp_avg_sq) is stored as its square
         root, whose range is half the exponent's, and never rounds to zero where it is positive:
         a zero in Adam's denominator would turn a small first moment into a step of lr / eps.

The update decodes a piece's 8-bit moments into fp32 scratch, runs the fp32 kernel and encodes
the result: the same arithmetic as fp32 moments whose values are rounded to the format after
every step. Decoding is exact (an e4m3 value times a power of two), and what was decoded encodes
to the same values (a block whose top rounded down an octave gets half the scale and doubled
codes), so a checkpoint, which keeps fp32 values, resumes exactly. Blocks are counted from the
shard's first element, and the NVMe tier's pieces start at multiples of 1024 elements, so every
tier rounds the same values the same way.
"""

from __future__ import annotations

import math

import torch

__all__ = ["BLOCK", "FORMATS", "MomentFormat", "moment_format"]

BLOCK = 256
_E4M3 = torch.float8_e4m3fn
_TOP = 448.0  # e4m3fn's largest finite value; it has no infinity, and overflow is NaN
_TINY = 2.0 ** -9  # its smallest subnormal


class MomentFormat:
    """One storage format ([Note: moment formats]). `stored` is what a tier keeps for a moment of
    n values: a tensor of `dtype` (fp32, bf16), or `nbytes(n)` bytes (8bit)."""

    name: str
    kernel_dtype: torch.dtype  # what the kernels read and write in place of the stored values
    packed = False  # stored as bytes that must be decoded before an update (8bit)

    def nbytes(self, n: int) -> int:
        raise NotImplementedError

    def bytes_per_value(self) -> float:
        return self.nbytes(1 << 20) / (1 << 20)

    def empty(self, n: int, fill: float, kind: str, device=None) -> torch.Tensor:
        """The stored form of n values equal to `fill`."""
        return self.encode(torch.full((n,), float(fill), dtype=torch.float32, device=device), kind)

    def view(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        """A pool buffer (bytes) seen as the stored form of n values."""
        raise NotImplementedError

    def decode(self, stored: torch.Tensor, n: int, kind: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The values as the kernel updates them (`kernel_dtype`, n of them)."""
        raise NotImplementedError

    def encode(self, values: torch.Tensor, kind: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The stored form of `values` (fp32 or kernel_dtype), into `out` when given."""
        raise NotImplementedError

    def to_fp32(self, stored: torch.Tensor, n: int, kind: str) -> torch.Tensor:
        return self.decode(stored, n, kind).float()


class _Plain(MomentFormat):
    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.kernel_dtype = name, dtype

    def nbytes(self, n: int) -> int:
        return n * self.kernel_dtype.itemsize

    def view(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        return raw.view(self.kernel_dtype)[:n]

    def decode(self, stored, n, kind, out=None):
        return stored[:n]

    def encode(self, values, kind, out=None):
        if out is None:
            return values.to(self.kernel_dtype, copy=True)
        out.copy_(values)
        return out


def _square_kind(kind: str) -> bool:
    return kind == "exp_avg_sq"  # Adam's second moment and Adagrad's sum: non-negative, stored as roots


class _Block8(MomentFormat):
    name = "8bit"
    kernel_dtype = torch.float32
    packed = True

    @staticmethod
    def _codes_len(n: int) -> int:
        return (n + 3) // 4 * 4  # the scales after the codes stay 4-byte aligned

    def nbytes(self, n: int) -> int:
        return self._codes_len(n) + 4 * math.ceil(n / BLOCK)

    def view(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        return raw.view(torch.uint8)[:self.nbytes(n)]

    def _parts(self, stored: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self._codes_len(n)
        return stored[:n].view(_E4M3), stored[c:c + 4 * math.ceil(n / BLOCK)].view(torch.float32)

    def decode(self, stored, n, kind, out=None):
        codes, scales = self._parts(stored, n)
        out = torch.empty(n, dtype=torch.float32, device=stored.device) if out is None else out[:n]
        full = n // BLOCK * BLOCK
        if full:
            torch.mul(codes[:full].float().view(-1, BLOCK), scales[:full // BLOCK, None], out=out[:full].view(-1, BLOCK))
        if full < n:
            torch.mul(codes[full:].float(), scales[-1], out=out[full:])
        if _square_kind(kind):
            out.mul_(out)
        return out

    def encode(self, values, kind, out=None):
        n = values.numel()
        x = values.float()
        if _square_kind(kind):
            x = x.sqrt()
        blocks = math.ceil(n / BLOCK)
        padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
        padded[:n] = x
        padded = padded.view(blocks, BLOCK)
        top = padded.abs().amax(dim=1)
        # The scale: the power of two that puts the block's largest magnitude in (224, 448].
        exponent = torch.ceil(torch.log2(top / _TOP)).nan_to_num(0.0, neginf=0.0).clamp_(-126, 127)
        scales = torch.where(top > 0, torch.exp2(exponent), torch.ones_like(top))
        scaled = padded / scales[:, None]
        while True:  # log2's rounding may leave a block's top a hair above 448: one octave up
            over = scaled.abs().amax(dim=1) > _TOP
            if not bool(over.any()):
                break
            scales = torch.where(over, scales * 2, scales)
            scaled = padded / scales[:, None]
        if _square_kind(kind):
            scaled = torch.where(scaled > 0, scaled.clamp(min=_TINY), scaled)
        codes = scaled.view(-1)[:n].to(_E4M3)
        out = torch.empty(self.nbytes(n), dtype=torch.uint8, device=x.device) if out is None else out[:self.nbytes(n)]
        c_out, s_out = self._parts(out, n)
        c_out.copy_(codes)
        s_out.copy_(scales)
        return out


FORMATS = {"fp32": _Plain("fp32", torch.float32), "bf16": _Plain("bf16", torch.bfloat16), "8bit": _Block8()}


def moment_format(name: str) -> MomentFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"moment format: expected one of {', '.join(FORMATS)}, got {name!r}") from None
