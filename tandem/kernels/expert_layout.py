"""The geometry of the CPU expert kernel's packed layout (tandem/offload/cpu_kernels/moe.h), for the
code that reads it elsewhere: the device unpack of expert streaming (tandem/offload/streaming.py)
and its Triton decode of the quantized formats (expert_unpack.py). Pure arithmetic: no torch.

An expert is ceil(I/8) phase-1 tiles (rows 0-7 gate rows 8j.., rows 8-15 up rows 8j..; K = H
inputs) then ceil(H/16) phase-2 tiles (down rows 16j..; K = I), each tile 16 rows over K padded to
blocks of 32 inputs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

ROWS, BLOCK = 16, 32  # moe.h's kRows and kBlock
SCALE_BYTES = {"int4": ROWS * 2, "mxfp4": ROWS}  # per block: bf16 / E8M0 row scales, then the codes
CODE_BYTES = BLOCK // 2 * ROWS  # a block's 4-bit codes: 4 octets of [16 rows][2 words]


def tile_bytes(fmt: str, nb: int) -> int:
    """moe.h's tile_bytes: one tile of 16 rows over nb blocks of 32 inputs."""
    if fmt in ("fp32", "bf16"):
        return nb * BLOCK * ROWS * (4 if fmt == "fp32" else 2)
    if fmt == "int8":
        return 64 + nb * BLOCK * ROWS  # [16] float32 row scales in 64 bytes, then int8 codes
    return nb * (SCALE_BYTES[fmt] + CODE_BYTES)


class Geometry(NamedTuple):
    """moe.h's Geometry of one layer's packed expert."""

    nb_h: int  # blocks along H (the gate / up input)
    nb_i: int  # blocks along I (the down input)
    tiles1: int  # phase-1 tiles (8 intermediate indices each)
    tiles2: int  # phase-2 tiles
    tile1: int  # their byte sizes
    tile2: int

    @classmethod
    def of(cls, fmt: str, hidden: int, inter: int) -> Geometry:
        nb_h, nb_i = math.ceil(hidden / BLOCK), math.ceil(inter / BLOCK)
        return cls(nb_h, nb_i, math.ceil(inter / (ROWS // 2)), math.ceil(hidden / ROWS), tile_bytes(fmt, nb_h),
                   tile_bytes(fmt, nb_i))

    @property
    def down_offset(self) -> int:
        """Byte offset of the phase-2 (down) tiles."""
        return self.tiles1 * self.tile1
