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

An update is the fp32 kernel between a decode and an encode: the same arithmetic as fp32
moments whose values are rounded to the format after every step. The CPU kernels of Adam,
Adagrad and Lion do all three a block at a time in one pass over the stored bytes, with the bits
of the decode and encode below ([Note: 8-bit moments in the kernels] in csrc/adam/adam.h; how a
tier's piece is cut for them: [Note: 8-bit updates of a piece] in rules.py); LAMB and the torch
ops on an accelerator run between this module's decode and encode. Decoding is exact (an e4m3
value times a power of two; a square moment is then squared, rounded once), and what was decoded
encodes to the same values (a block whose top rounded down an octave gets half the scale and
doubled codes), so a checkpoint, which keeps fp32 values, resumes exactly. Blocks are counted
from the shard's first element, and the NVMe tier's pieces start at multiples of 1024 elements,
so every tier rounds the same values the same way.

Every step of the encode is exactly defined, so that other code (a fused kernel) can give its
bits: the root is the correctly rounded one, taken in double (exact: a double's 53 bits are more
than twice a float's 24, so rounding the double root to float rounds the true root once; torch's
float sqrt on the CPU is not correctly rounded); the scale is the smallest power of two 2^e with
top <= 448 * 2^e and e >= -126 (the log2 below only guesses it, and the loop corrects the guess
upwards), except that a block with a NaN, or whose top / 448 rounds to 0, keeps scale 1, and an
infinite top gets an infinite scale; dividing by it is exact but where it underflows; the codes
are torch's conversion (round to nearest even; torch 2.13 saturates at 448 and writes a NaN as
0x7F with its sign).
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

    def scales_offset(self, n: int) -> int:
        """Where, in the stored bytes of n values, the first block's scale is (fp32, one a block)."""
        return self._codes_len(n)

    def view(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        return raw.view(torch.uint8)[:self.nbytes(n)]

    def _parts(self, stored: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self._codes_len(n)
        return stored[:n].view(_E4M3), stored[c:c + 4 * math.ceil(n / BLOCK)].view(torch.float32)

    def decode(self, stored, n, kind, out=None):
        return self.decode_blocks(stored, n, kind, 0, math.ceil(n / BLOCK), out)

    def decode_blocks(self, stored: torch.Tensor, n: int, kind: str, first: int, last: int,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """The values of blocks [first, last) of the stored form of n values (blocks are
        independent: each is its codes times its own scale)."""
        codes, scales = self._parts(stored, n)
        lo, hi = first * BLOCK, min(last * BLOCK, n)
        codes, scales, m = codes[lo:hi], scales[first:last], hi - lo
        out = torch.empty(m, dtype=torch.float32, device=stored.device) if out is None else out[:m]
        full = m // BLOCK * BLOCK
        if full:
            torch.mul(codes[:full].float().view(-1, BLOCK), scales[:full // BLOCK, None], out=out[:full].view(-1, BLOCK))
        if full < m:
            torch.mul(codes[full:].float(), scales[-1], out=out[full:])
        if _square_kind(kind):
            out.mul_(out)
        return out

    def encode(self, values, kind, out=None):
        n = values.numel()
        size = self.nbytes(n)
        out = torch.empty(size, dtype=torch.uint8, device=values.device) if out is None else out[:size]
        self.encode_blocks(values, kind, out, n, 0)
        return out

    def encode_blocks(self, values: torch.Tensor, kind: str, stored: torch.Tensor, n: int, first: int) -> None:
        """`values` (fp32) into the stored form of n values as its blocks from `first` on: they
        start a block and end one or at the n-th value."""
        m = values.numel()
        x = values.float()
        if _square_kind(kind):
            x = x.double().sqrt().float()  # the correctly rounded root, as the kernels take it
        blocks = math.ceil(m / BLOCK)
        padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
        padded[:m] = x
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
        c_out, s_out = self._parts(stored, n)
        c_out[first * BLOCK:first * BLOCK + m].copy_(scaled.view(-1)[:m].to(_E4M3))
        s_out[first:first + blocks].copy_(scales)


FORMATS = {"fp32": _Plain("fp32", torch.float32), "bf16": _Plain("bf16", torch.bfloat16), "8bit": _Block8()}


def moment_format(name: str) -> MomentFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"moment format: expected one of {', '.join(FORMATS)}, got {name!r}") from None
