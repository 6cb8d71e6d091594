// Portable code (no SIMD flags): the packed layout's writer (pack_tiles) and reader (decode_block,
// unpack_expert: what `dequantized()` returns, so the tests see exactly the weights the kernels
// use), and the scalar tile kernels, the fallback for CPUs without AVX2 (their int8-activation
// ones are also the plain statement of the integer math the SIMD ones must match bit for bit).
#include <cmath>
#include <cstring>

#include "moe.h"

namespace tandem {

const float kFp4Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
const float kInt4Values[16] = {0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1};

static float bits_to_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// E8M0: 2^(s - 127). s = 0 is the subnormal 2^-127 (the SIMD paths take max(bits, 2^-127));
// s = 255 (NaN in the OCP MX spec, never written by a quantiser) decodes as +inf.
static float e8m0(uint8_t s) { return s == 0 ? std::ldexp(1.0f, -127) : bits_to_float(uint32_t(s) << 23); }

void decode_block(int fmt, const uint8_t* tile, int64_t b, float q[kRows][kBlock], float s[kRows]) {
    switch (fmt) {
    case FMT_F32: {
        const float* w = reinterpret_cast<const float*>(tile) + b * kBlock * kRows;
        for (int i = 0; i < kBlock; ++i)
            for (int r = 0; r < kRows; ++r) std::memcpy(&q[r][i], w + i * kRows + r, 4);
        for (int r = 0; r < kRows; ++r) s[r] = 1.0f;
        break;
    }
    case FMT_BF16: {
        const uint8_t* w = tile + b * kBlock * kRows * 2;
        for (int i = 0; i < kBlock / 2; ++i)
            for (int r = 0; r < kRows; ++r) {
                uint32_t pair;
                std::memcpy(&pair, w + (i * kRows + r) * 4, 4);
                q[r][2 * i] = bits_to_float(pair << 16);
                q[r][2 * i + 1] = bits_to_float(pair & 0xFFFF0000u);
            }
        for (int r = 0; r < kRows; ++r) s[r] = 1.0f;
        break;
    }
    case FMT_INT8: {
        const int8_t* w = reinterpret_cast<const int8_t*>(tile + 64) + b * kBlock * kRows;
        for (int i = 0; i < kBlock; ++i)
            for (int r = 0; r < kRows; ++r) q[r][i] = float(w[i * kRows + r]);
        std::memcpy(s, tile, kRows * 4);
        break;
    }
    default: {  // int4, mxfp4
        const uint8_t* blk = tile + b * block_bytes(fmt);
        const uint8_t* codes = blk + block_scale_bytes(fmt);
        const float* values = fmt == FMT_INT4 ? kInt4Values : kFp4Values;
        for (int i = 0; i < kBlock; ++i)
            for (int r = 0; r < kRows; ++r) {
                const uint8_t c = codes[nibble_byte(r, i)];
                q[r][i] = values[nibble_high(i) ? c >> 4 : c & 15];
            }
        for (int r = 0; r < kRows; ++r) {
            if (fmt == FMT_INT4) {
                uint16_t h;
                std::memcpy(&h, blk + 2 * r, 2);
                s[r] = bits_to_float(uint32_t(h) << 16);
            } else {
                s[r] = e8m0(blk[r]);
            }
        }
    }
    }
}

// ---- writing the layout (moe.h) --------------------------------------------------------------

namespace {

void pack_tile(int fmt, const Source* src[kRows], const int64_t row[kRows], int64_t nb, uint8_t* dst) {
    const int64_t K = nb * kBlock;
    if (fmt == FMT_INT8) {  // row scales, then as fp32 below with 1-byte elements
        for (int r = 0; r < kRows; ++r) {
            float scale = src[r] ? reinterpret_cast<const float*>(src[r]->aux)[row[r]] : 0.0f;
            std::memcpy(dst + 4 * r, &scale, 4);
        }
        std::memset(dst + 4 * kRows, 0, 64 - 4 * kRows);
        dst += 64;
    }
    if (fmt == FMT_BF16) {  // [K/2][16] pairs: input 2i in the low half, 2i+1 in the high half
        uint32_t* d = reinterpret_cast<uint32_t*>(dst);
        for (int r = 0; r < kRows; ++r) {
            const int64_t cols = src[r] ? src[r]->cols : 0;
            const uint16_t* w = src[r] ? reinterpret_cast<const uint16_t*>(src[r]->w) + row[r] * cols : nullptr;
            for (int64_t i = 0; i < K / 2; ++i) {
                uint32_t lo = 2 * i < cols ? w[2 * i] : 0, hi = 2 * i + 1 < cols ? w[2 * i + 1] : 0;
                d[i * kRows + r] = lo | hi << 16;
            }
        }
        return;
    }
    if (fmt == FMT_F32 || fmt == FMT_INT8) {  // [K][16] elements
        const int size = fmt == FMT_F32 ? 4 : 1;
        for (int r = 0; r < kRows; ++r) {
            const int64_t cols = src[r] ? src[r]->cols : 0;
            const uint8_t* w = src[r] ? src[r]->w + row[r] * cols * size : nullptr;
            for (int64_t k = 0; k < K; ++k) {
                if (k < cols) std::memcpy(dst + (k * kRows + r) * size, w + k * size, size);
                else std::memset(dst + (k * kRows + r) * size, 0, size);
            }
        }
        return;
    }
    const int scale_size = fmt == FMT_INT4 ? 2 : 1;  // int4, mxfp4: per block scales, then codes
    for (int64_t b = 0; b < nb; ++b, dst += block_bytes(fmt)) {
        uint8_t* codes = dst + block_scale_bytes(fmt);
        for (int r = 0; r < kRows; ++r) {
            const int64_t cols = src[r] ? src[r]->cols : 0;  // int4: padded to 32 already
            uint8_t nib[kBlock] = {};  // the block's 32 codes of row r, one per byte
            if (b * kBlock >= cols) {
                std::memset(dst + r * scale_size, 0, scale_size);
            } else {
                std::memcpy(dst + r * scale_size, src[r]->aux + (row[r] * (cols / kBlock) + b) * scale_size, scale_size);
                if (fmt == FMT_MXFP4) {  // the checkpoint's byte: input 2i low, 2i+1 high
                    const uint8_t* w = src[r]->w + row[r] * (cols / 2) + b * kBlock / 2;
                    for (int i = 0; i < kBlock; ++i) nib[i] = (i % 2 ? w[i / 2] >> 4 : w[i / 2]) & 15;
                } else {  // int8 codes in -8..7
                    const uint8_t* w = src[r]->w + row[r] * cols + b * kBlock;
                    for (int i = 0; i < kBlock; ++i) nib[i] = w[i] & 15;
                }
            }
            for (int i = 0; i < kBlock; ++i) {
                uint8_t& byte = codes[nibble_byte(r, i)];
                byte = nibble_high(i) ? uint8_t((byte & 15) | nib[i] << 4) : nib[i];  // low half is written first
            }
        }
    }
}

// Tile t of the expert -> its 16 source rows (null: padding rows).
void tile_rows(const Geometry& g, const ExpertSources& src, int64_t t, const Source* rows[kRows], int64_t row[kRows]) {
    for (int r = 0; r < kRows; ++r) {
        if (t < g.tiles1) {
            const Source* s = r < kRows / 2 ? &src.gate : &src.up;
            row[r] = t * kRows / 2 + r % (kRows / 2);
            rows[r] = row[r] < s->rows ? s : nullptr;
        } else {
            row[r] = (t - g.tiles1) * kRows + r;
            rows[r] = row[r] < src.down.rows ? &src.down : nullptr;
        }
    }
}

}  // namespace

void pack_tiles(int fmt, int hidden, int inter, const ExpertSources& src, int64_t t0, int64_t t1, uint8_t* expert) {
    const Geometry g(fmt, hidden, inter);
    for (int64_t t = t0; t < t1; ++t) {
        const Source* rows[kRows];
        int64_t row[kRows];
        tile_rows(g, src, t, rows, row);
        uint8_t* dst = expert + (t < g.tiles1 ? t * g.tile1 : g.down_offset + (t - g.tiles1) * g.tile2);
        pack_tile(fmt, rows, row, t < g.tiles1 ? g.nb_h : g.nb_i, dst);
    }
    if (t1 == g.tiles1 + g.tiles2) {  // the padding up to the 64-byte expert size
        const int64_t used = g.down_offset + g.tiles2 * g.tile2;
        std::memset(expert + used, 0, g.expert_bytes - used);
    }
}

void unpack_expert(int fmt, int hidden, int inter, const uint8_t* expert, float* gate, float* up, float* down) {
    const Geometry g(fmt, hidden, inter);
    float q[kRows][kBlock], s[kRows];
    for (int64_t t = 0; t < g.tiles1 + g.tiles2; ++t) {
        const bool first = t < g.tiles1;
        const uint8_t* tile = expert + (first ? t * g.tile1 : g.down_offset + (t - g.tiles1) * g.tile2);
        const int64_t nb = first ? g.nb_h : g.nb_i, K = first ? hidden : inter;
        for (int64_t b = 0; b < nb; ++b) {
            decode_block(fmt, tile, b, q, s);
            for (int r = 0; r < kRows; ++r) {
                const int64_t row = first ? t * kRows / 2 + r % (kRows / 2) : (t - g.tiles1) * kRows + r;
                float* dst = first ? (r < kRows / 2 ? gate : up) : down;
                if (row >= (first ? inter : hidden)) continue;
                for (int i = 0; i < kBlock && b * kBlock + i < K; ++i) dst[row * K + b * kBlock + i] = q[r][i] * s[r];
            }
        }
    }
}

// ---- the scalar kernels -----------------------------------------------------------------------

// One kernel for every format: per block, partial sums of code x activation, then the block
// scale (int4 / mxfp4) or, at the end, the row scale (int8).
template <int Fmt>
static void tile_scalar(const uint8_t* tile, int64_t nb, const void* xv, int64_t ld, int ntok, float* out) {
    const float* x = static_cast<const float*>(xv);
    constexpr bool block_scaled = Fmt == FMT_INT4 || Fmt == FMT_MXFP4;
    float q[kRows][kBlock], s[kRows];
    for (int t = 0; t < ntok; ++t)
        for (int r = 0; r < kRows; ++r) out[t * kRows + r] = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        decode_block(Fmt, tile, b, q, s);
        const float* xb = x + b * kBlock * ld;
        for (int t = 0; t < ntok; ++t)
            for (int r = 0; r < kRows; ++r) {
                float part = 0.0f;
                for (int i = 0; i < kBlock; ++i) part += q[r][i] * xb[i * ld + t];
                out[t * kRows + r] += block_scaled ? s[r] * part : part;
            }
    }
    if (Fmt == FMT_INT8) {
        decode_block(Fmt, tile, 0, q, s);
        for (int t = 0; t < ntok; ++t)
            for (int r = 0; r < kRows; ++r) out[t * kRows + r] *= s[r];
    }
}

// int8 activations (moe.h): the integer the SIMD kernels reach through biased bytes, taken here as
// the signed weight times q (mxfp4: twice the E2M1 value against half the scale), then the same
// float steps: out += float(isum) * (scale * d), one fma.
template <int Fmt>
static void tile_scalar_i8(const uint8_t* tile, int64_t nb, const void* xv, int64_t ld, int ntok, float* out) {
    const QBlock* x = static_cast<const QBlock*>(xv);
    constexpr int mult = Fmt == FMT_MXFP4 ? 2 : 1;
    float q[kRows][kBlock], s[kRows];
    int32_t w[kRows][kBlock];
    for (int t = 0; t < ntok; ++t)
        for (int r = 0; r < kRows; ++r) out[t * kRows + r] = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        decode_block(Fmt, tile, b, q, s);
        for (int r = 0; r < kRows; ++r) {
            s[r] /= mult;  // exact: a power of two
            for (int i = 0; i < kBlock; ++i) w[r][i] = int32_t(q[r][i] * mult);
        }
        for (int t = 0; t < ntok; ++t) {
            const QBlock& xb = x[b * ld + t];
            int32_t a[kBlock];
            for (int o = 0; o < kBlock / 8; ++o)
                for (int h = 0; h < 2; ++h)
                    for (int j = 0; j < 4; ++j) a[8 * o + q8_input(h, j)] = int8_t(xb.q[2 * o + h] >> (8 * j));
            for (int r = 0; r < kRows; ++r) {
                int32_t isum = 0;
                for (int i = 0; i < kBlock; ++i) isum += w[r][i] * a[i];
                out[t * kRows + r] = std::fma(float(isum), s[r] * xb.d, out[t * kRows + r]);
            }
        }
    }
}

static uint64_t read_scalar(const uint8_t* buf, int64_t n) {
    uint64_t acc[4] = {0, 0, 0, 0};
    for (int64_t i = 0; i < n; i += 32) {
        uint64_t v[4];
        std::memcpy(v, buf + i, 32);
        for (int j = 0; j < 4; ++j) acc[j] += v[j];
    }
    return acc[0] ^ acc[1] ^ acc[2] ^ acc[3];
}

static const Kernels kScalar = {
    {tile_scalar<FMT_F32>, tile_scalar<FMT_BF16>, tile_scalar<FMT_INT8>, tile_scalar<FMT_INT4>,
     tile_scalar<FMT_MXFP4>},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
    {nullptr, nullptr, nullptr, tile_scalar_i8<FMT_INT4>, tile_scalar_i8<FMT_MXFP4>},
    read_scalar,
};

const Kernels* kernels_scalar() { return &kScalar; }

}  // namespace tandem
