"""Decoding the CPU expert kernel's quantized tiles (int8, int4, mxfp4) into dense expert weights on
the GPU in one pass, for PCIe expert streaming (tandem/offload/streaming.py).

    unpack_quantized(packed uint8 [G, expert_bytes], fmt, hidden, inter, dtype)
        -> (w13 [G, 2I, H], w2 [G, H, I]) in dtype

The packed layout is moe.h's (tandem/offload/cpu_kernels/; its tiles and sizes in
expert_layout.py). Per tile of 16 rows over K inputs, by format:

    int8   [16] float32 row scales (64 bytes), then [K][16] int8          value = code * scale[row]
    int4   per block: [16] bf16 scales, then 4 octets of [16 rows][2 words]  value = code (-8..7) * scale
    mxfp4  per block: [16] E8M0 scales, then the same octets of E2M1 codes  value = e2m1(code) * 2^(s - 127)

where nibble s of word w of row r in octet o holds input 8o + 2s + w. The values are computed in
float32 exactly as moe_scalar.cpp's decode_block (code x scale) and rounded once to `dtype`; the torch path of streaming.py computes the same and is the
reference of the tests.

One program decodes BLOCKS blocks (32 inputs each) of one tile of one expert: the grid is
(G * tiles, cdiv(nb, BLOCKS)), one launch per phase.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.expert_layout import SCALE_BYTES, Geometry

_FMT = {"int8": 0, "int4": 1, "mxfp4": 2}
_BLOCKS = 4  # blocks of 32 inputs per program


@triton.jit
def _unpack_kernel(
    packed_ptr, out_ptr,
    expert_bytes, phase_offset, tile_bytes, tiles, nb, out_rows, out_cols, row_offset,
    stride_og, stride_or,
    FMT: tl.constexpr, PHASE1: tl.constexpr, BLOCKS: tl.constexpr, SB: tl.constexpr,
):
    pid = tl.program_id(0)
    g, t = pid // tiles, pid % tiles
    tile = packed_ptr + g.to(tl.int64) * expert_bytes + phase_offset + t.to(tl.int64) * tile_bytes
    r = tl.arange(0, 16)[:, None]  # the tile's rows
    i = tl.arange(0, 32)[None, :]  # inputs of a block
    if PHASE1:  # rows 0-7: gate rows 8t + r; rows 8-15: up rows 8t + r - 8 (up starts at row_offset)
        local = 8 * t + r % 8
        out_row = local + (r >= 8).to(tl.int32) * row_offset
        row_ok = local < row_offset
    else:
        out_row = 16 * t + r
        row_ok = out_row < out_rows
    if FMT == 0:
        scale = tl.load(tile.to(tl.pointer_type(tl.float32)) + r)  # [16, 1]
    for bb in tl.static_range(BLOCKS):
        b = tl.program_id(1) * BLOCKS + bb
        col = b * 32 + i
        mask = row_ok & (col < out_cols) & (b < nb)
        if FMT == 0:  # [K][16] int8 after the 64 bytes of row scales
            code = tl.load(tile + 64 + col * 16 + r, mask=mask, other=0).to(tl.int8, bitcast=True)
            value = code.to(tl.float32) * scale
        else:
            blk = tile + b.to(tl.int64) * (SB + 256)  # SB scale bytes, then 256 bytes of codes
            byte = tl.load(blk + SB + (i // 8) * 64 + r * 4 + 2 * (i % 2) + (i % 8) // 4, mask=mask, other=0)
            byte = byte.to(tl.int32)
            nib = tl.where((i // 2) % 2 == 1, byte >> 4, byte & 15)
            if FMT == 1:
                s = tl.load(blk.to(tl.pointer_type(tl.bfloat16)) + r, mask=row_ok & (b < nb), other=0.0).to(tl.float32)
                value = (nib - 16 * (nib >= 8).to(tl.int32)).to(tl.float32) * s
            else:
                e8 = tl.load(blk + r, mask=row_ok & (b < nb), other=127).to(tl.int32)
                # 2^(s - 127) from its bits; 0 is 2^-127 (a subnormal) as decode_block has it
                s = tl.where(e8 == 0, 5.877471754111438e-39, (e8 << 23).to(tl.float32, bitcast=True))
                e = (nib >> 1) & 3
                m = (nib & 1).to(tl.float32)
                pow2 = tl.where(e == 3, 4.0, tl.where(e == 2, 2.0, 1.0))
                magnitude = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pow2)
                value = tl.where(nib >= 8, -magnitude, magnitude) * s
        tl.store(out_ptr + g.to(tl.int64) * stride_og + out_row.to(tl.int64) * stride_or + col,
                 value.to(out_ptr.dtype.element_ty), mask=mask)


def unpack_quantized(packed: torch.Tensor, fmt: str, hidden: int, inter: int, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. `packed` must be contiguous uint8 on the device."""
    if fmt not in _FMT:
        raise ValueError(f"unpack_quantized decodes {', '.join(_FMT)}, not {fmt}")
    if packed.dtype != torch.uint8 or packed.dim() != 2 or not packed.is_contiguous():
        raise ValueError(f"packed experts must be contiguous uint8 [G, bytes], got {packed.dtype} {tuple(packed.shape)}")
    g = packed.shape[0]
    nb_h, nb_i, tiles1, tiles2, tile1, tile2 = Geometry.of(fmt, hidden, inter)
    w13 = torch.empty(g, 2 * inter, hidden, dtype=dtype, device=packed.device)
    w2 = torch.empty(g, hidden, inter, dtype=dtype, device=packed.device)
    if g == 0:
        return w13, w2
    common = dict(FMT=_FMT[fmt], BLOCKS=_BLOCKS, SB=SCALE_BYTES.get(fmt, 0))
    _unpack_kernel[(g * tiles1, triton.cdiv(nb_h, _BLOCKS))](
        packed, w13, packed.shape[1], 0, tile1, tiles1, nb_h, 2 * inter, hidden, inter,
        w13.stride(0), w13.stride(1), PHASE1=True, **common)
    _unpack_kernel[(g * tiles2, triton.cdiv(nb_i, _BLOCKS))](
        packed, w2, packed.shape[1], tiles1 * tile1, tile2, tiles2, nb_i, hidden, inter, 0,
        w2.stride(0), w2.stride(1), PHASE1=False, **common)
    return w13, w2
