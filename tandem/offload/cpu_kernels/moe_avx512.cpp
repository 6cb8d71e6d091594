// AVX-512 tile kernels (compiled with -mavx512f/bw/vl/dq; called only where the CPU has them).
// A tile's 16 rows are one 16-lane vector, multiplied by each token's broadcast activation.
//
// fp32 activations (every format; exact): weights become fp32 in registers. bf16: a shift and a
// mask of the (2i, 2i+1) pair; int8: vpmovsxbd + vcvtdq2ps; int4 and mxfp4: one 64-byte load of
// an octet (a row's 8 codes in its dword), then vpermps over a 16-entry fp32 table (it reads the
// low 4 bits: each of the eight nibbles after a shift). The int4 / mxfp4 block scale multiplies
// the block's partial sum once per token, not each weight.
//
// bf16 activations (ISA avx512bf16, for bf16 / int4 / mxfp4 weights when the hidden state is
// bf16): vdpbf16ps multiplies a weight pair by the token's activation pair in one instruction.
// The nibbles become bf16 pairs through vpermw over a bf16 table (every E2M1 and int4 value is
// exact in bf16): four lookups per octet, no widening (moe.h's layout). Products are exact, sums
// fp32; the SwiGLU intermediate is rounded to bf16 for the down projection (the bf16 GPU model
// rounds it too). These functions carry
// target("avx512bf16") so that nothing else in this file may use the instruction.
//
// int8 activations (the lossy activation mode, int4 / mxfp4 weights; moe.h): vpshufb to biased
// bytes and vpdpbusd, integer sums per block, on CPUs with avx512vnni (below).
//
// AMX (ISA amx, int4 / mxfp4 weights with bf16 activations, 2 or more tokens): the decode above
// fills a tile of 16 input pairs x 16 rows in memory, and one tdpbf16ps multiplies it by every
// token's 32 inputs (tokens as the tile rows, so these kernels read token-major activations). At
// one token the decode is the cost, not the products (an AMX path for one token, tried, was no
// faster: BENCHMARKS.md, session 12), and one token runs the avx512bf16 kernel; from two on,
// vdpbf16ps repeats the products per token (one thread's exact MXFP4 read 10.1 GB/s at 1 token,
// 4.5 at 4: session 16), where the tile unit takes up to 16 tokens in one instruction.
// TANDEM_AMX_EMULATE builds the tile operations in plain C++ (a test checks this path's data
// layout on CPUs without AMX); the ISA then needs only avx512bf16.
#include <immintrin.h>

#include <cstring>

#include "moe.h"

namespace tandem {
namespace {

// Software prefetch of the weight stream, g_tuning's distances ahead of it (the hardware
// prefetcher alone lags when 16 threads each stream a different expert; it also stops at every
// 4 KiB page). lines<N>(p) touches every cache line of [p, p + 64 N) at both distances.
struct Prefetch {
    int64_t l1 = g_tuning.prefetch_l1, l2 = g_tuning.prefetch_l2;  // 0: off
    template <int N>
    void lines(const uint8_t* p) const {
        const char* c = reinterpret_cast<const char*>(p);
        for (int i = 0; i < N; ++i) {
            if (l1) _mm_prefetch(c + l1 + 64 * i, _MM_HINT_T0);
            if (l2) _mm_prefetch(c + l2 + 64 * i, _MM_HINT_T1);
        }
    }
};
// An int4 / mxfp4 block is not line-aligned (272 / 288 bytes, starting at a multiple of 16 / 32):
// prefetches at 0, 64, .. 256 from its start reach every line it touches.
constexpr int kBlockLines = 5;
static_assert(block_bytes(FMT_MXFP4) <= 64 * (kBlockLines - 1) + 16 && block_bytes(FMT_INT4) <= 64 * (kBlockLines - 1) + 32,
              "a block must end within the line of its last prefetch");

inline void zero(__m512* a, int n) {
    for (int i = 0; i < n; ++i) a[i] = _mm512_setzero_ps();
}
// out[t] = sum over the U accumulator chains of acc[u][t].
template <int U, int TB>
inline void store_sum(float* out, const __m512 (&acc)[U][TB]) {
    for (int t = 0; t < TB; ++t) {
        __m512 s = acc[0][t];
        for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[u][t]);
        _mm512_storeu_ps(out + t * kRows, s);
    }
}
// Independent accumulator chains per token, so that a few tokens still keep enough FMAs in
// flight (an FMA waits ~4 cycles for its accumulator; one chain would cap a core well below
// its share of the RAM bandwidth).
constexpr int chains(int tb, int want) { return tb >= want ? 1 : want / tb; }

template <int TB>
struct F32 {
    static constexpr int U = chains(TB, 4);
    static void run(const uint8_t* tile, int64_t nb, const float* x, int64_t ld, float* out) {
        __m512 acc[U][TB];
        zero(&acc[0][0], U * TB);
        const Prefetch pf;
        for (int64_t k = 0; k < nb * kBlock; k += U, tile += 64 * U, x += U * ld) {
            pf.lines<U>(tile);
#pragma GCC unroll 4
            for (int u = 0; u < U; ++u) {
                __m512 w = _mm512_loadu_ps(reinterpret_cast<const float*>(tile + 64 * u));
#pragma GCC unroll 16
                for (int t = 0; t < TB; ++t) acc[u][t] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[u * ld + t]), acc[u][t]);
            }
        }
        store_sum(out, acc);
    }
};

// The even and the odd input of a pair go to separate chains.
template <int TB>
struct Bf16 {
    static constexpr int U = chains(TB, 2);
    static void run(const uint8_t* tile, int64_t nb, const float* x, int64_t ld, float* out) {
        const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
        __m512 acc[2 * U][TB];
        zero(&acc[0][0], 2 * U * TB);
        const Prefetch pf;
        for (int64_t i = 0; i < nb * kBlock / 2; i += U, tile += 64 * U, x += 2 * U * ld) {
            pf.lines<U>(tile);
#pragma GCC unroll 4
            for (int u = 0; u < U; ++u) {
                __m512i v = _mm512_loadu_si512(tile + 64 * u);
                __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, high));
                const float* xu = x + 2 * u * ld;
#pragma GCC unroll 16
                for (int t = 0; t < TB; ++t) {
                    acc[2 * u][t] = _mm512_fmadd_ps(even, _mm512_set1_ps(xu[t]), acc[2 * u][t]);
                    acc[2 * u + 1][t] = _mm512_fmadd_ps(odd, _mm512_set1_ps(xu[ld + t]), acc[2 * u + 1][t]);
                }
            }
        }
        store_sum(out, acc);
    }
};

template <int TB>
struct Int8 {
    static constexpr int U = chains(TB, 4);
    static void run(const uint8_t* tile, int64_t nb, const float* x, int64_t ld, float* out) {
        const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(tile));
        const uint8_t* codes = tile + 64;
        __m512 acc[U][TB];
        zero(&acc[0][0], U * TB);
        const Prefetch pf;
        for (int64_t k = 0; k < nb * kBlock; k += U, codes += kRows * U, x += U * ld) {
            if (k % 4 == 0) pf.lines<1>(codes);
#pragma GCC unroll 4
            for (int u = 0; u < U; ++u) {
                __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + kRows * u));
                __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
#pragma GCC unroll 16
                for (int t = 0; t < TB; ++t) acc[u][t] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[u * ld + t]), acc[u][t]);
            }
        }
        for (int u = 0; u < U; ++u)
            for (int t = 0; t < TB; ++t) acc[u][t] = _mm512_mul_ps(acc[u][t], scale);
        store_sum(out, acc);
    }
};

// One byte per row of an input pair -> 16 dwords.
inline __m512i bytes16(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

alignas(64) constexpr float kFp4Table[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
alignas(64) constexpr float kInt4Table[16] = {0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1};
// The same values as bf16, twice (vpermw reads 5 index bits; the indices here are < 16).
alignas(64) constexpr uint16_t kFp4Bf16[32] = {
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,  //  0 .. 6
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,  // -0 .. -6
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};
alignas(64) constexpr uint16_t kInt4Bf16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,  //  0 .. 7
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,  // -8 .. -1
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80};

template <int Fmt>
inline __m512 block_scale(const uint8_t* blk) {
    if (Fmt == FMT_INT4) {  // bf16 -> fp32
        __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    __m512i e = _mm512_slli_epi32(bytes16(blk), 23);  // E8M0: 2^(s-127); s = 0 -> 2^-127
    return _mm512_max_ps(_mm512_castsi512_ps(e), _mm512_set1_ps(0x1p-127f));
}

// acc[t] += scale * (sum of the block's partial chains)
template <int C, int TB>
inline void add_block(__m512 (&acc)[TB], const __m512 (&part)[C][TB], __m512 scale) {
    for (int t = 0; t < TB; ++t) {
        __m512 s = part[0][t];
        for (int c = 1; c < C; ++c) s = _mm512_add_ps(s, part[c][t]);
        acc[t] = _mm512_fmadd_ps(s, scale, acc[t]);
    }
}

template <int Fmt>
struct Nibbles {
    template <int TB>
    struct K {
        static constexpr int C = TB >= 4 ? 2 : 4;  // chains per token: input 8o + k goes to k % C
        static void run(const uint8_t* tile, int64_t nb, const float* x, int64_t ld, float* out) {
            const __m512 table = _mm512_load_ps(Fmt == FMT_INT4 ? kInt4Table : kFp4Table);
            const Prefetch pf;
            __m512 acc[TB];
            zero(acc, TB);
            for (int64_t b = 0; b < nb; ++b, tile += block_bytes(Fmt)) {
                pf.lines<kBlockLines>(tile);
                const uint8_t* codes = tile + block_scale_bytes(Fmt);
                __m512 part[C][TB];  // the block's partial sums
                zero(&part[0][0], C * TB);
                for (int o = 0; o < kBlock / 8; ++o, codes += 4 * kRows, x += 8 * ld) {
                    const __m512i d = _mm512_loadu_si512(codes);  // row r's 8 codes in dword r
#pragma GCC unroll 8
                    for (int k = 0; k < 8; ++k) {
                        const __m512 w = _mm512_permutexvar_ps(_mm512_srli_epi32(d, octet_bit(k)), table);
#pragma GCC unroll 16
                        for (int t = 0; t < TB; ++t)
                            part[k % C][t] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[k * ld + t]), part[k % C][t]);
                    }
                }
                add_block(acc, part, block_scale<Fmt>(tile));
            }
            for (int t = 0; t < TB; ++t) _mm512_storeu_ps(out + t * kRows, acc[t]);
        }
    };
};

// ---- bf16 activations: x is uint32 pairs, x[i * ld + t] = (bf16 input 2i, bf16 input 2i+1).

#define TANDEM_BF16 __attribute__((target("avx512bf16")))

template <int TB>
struct Bf16Dot {
    static constexpr int U = chains(TB, 4);
    TANDEM_BF16 static void run(const uint8_t* tile, int64_t nb, const uint32_t* x, int64_t ld, float* out) {
        __m512 acc[U][TB];
        zero(&acc[0][0], U * TB);
        const Prefetch pf;
        for (int64_t i = 0; i < nb * kBlock / 2; i += U, tile += 64 * U, x += U * ld) {
            pf.lines<U>(tile);
#pragma GCC unroll 4
            for (int u = 0; u < U; ++u) {
                __m512bh w = (__m512bh)_mm512_loadu_si512(tile + 64 * u);
#pragma GCC unroll 16
                for (int t = 0; t < TB; ++t)
                    acc[u][t] = _mm512_dpbf16_ps(acc[u][t], w, (__m512bh)_mm512_set1_epi32(int(x[u * ld + t])));
            }
        }
        store_sum(out, acc);
    }
};

// An octet's 64 bytes as 32 words: word w of row r (word 2r + w) holds inputs 8o + 2s + w in its
// nibble s, so the words shifted by 4s hold in their low 4 bits (vpermw reads 5: the 32-entry
// table is the 16 values twice) the pair (8o+2s, 8o+2s+1) of every row, in the row's dword.
// Four lookups and three shifts per 64 code bytes.
template <int Fmt>
struct NibblesDot {
    template <int TB>
    struct K {
        static constexpr int C = TB >= 2 ? 2 : 4;  // chains per token: pair 4o + s goes to s % C
        TANDEM_BF16 static void run(const uint8_t* tile, int64_t nb, const uint32_t* x, int64_t ld, float* out) {
            const __m512i table = _mm512_load_si512(Fmt == FMT_INT4 ? kInt4Bf16 : kFp4Bf16);
            const Prefetch pf;
            __m512 acc[TB];
            zero(acc, TB);
            for (int64_t b = 0; b < nb; ++b, tile += block_bytes(Fmt)) {
                pf.lines<kBlockLines>(tile);
                const uint8_t* codes = tile + block_scale_bytes(Fmt);
                __m512 part[C][TB];
                zero(&part[0][0], C * TB);
                for (int o = 0; o < kBlock / 8; ++o, codes += 4 * kRows, x += 4 * ld) {
                    const __m512i v = _mm512_loadu_si512(codes);
#pragma GCC unroll 4
                    for (int q = 0; q < 4; ++q) {
                        const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4 * q), table);
#pragma GCC unroll 16
                        for (int t = 0; t < TB; ++t)
                            part[q % C][t] = _mm512_dpbf16_ps(part[q % C][t], w, (__m512bh)_mm512_set1_epi32(int(x[q * ld + t])));
                    }
                }
                add_block(acc, part, block_scale<Fmt>(tile));
            }
            for (int t = 0; t < TB; ++t) _mm512_storeu_ps(out + t * kRows, acc[t]);
        }
    };
};

// ---- int8 activations (moe.h): QBlock x[b * ld + t]. One 64-byte load of an octet
// holds each row's 8 codes in its dword; vpshufb (the 16 biased bytes in every 128-bit lane) maps
// its low and its high nibbles to two weight vectors of 4 inputs per row, and vpdpbusd adds their
// byte products with the token's 4 q (in the same order) to the row's int32: two lookups and two
// dot products per octet and token, where the bf16 path needs four of each. The block's int32
// starts at the token's correction, -bias * sum q. These functions carry target("avx512vnni") so that nothing else in
// this file may use VNNI.

#define TANDEM_VNNI __attribute__((target("avx512vnni")))

template <int Fmt>
struct NibblesI8 {
    template <int TB>
    struct K {
        // int32 chains per token: vpdpbusd waits ~5 cycles for its accumulator; a block's chains
        // are short and the next block's are independent, so out-of-order execution overlaps them.
        static constexpr int C = TB >= 2 ? 1 : 2;
        TANDEM_VNNI static void run(const uint8_t* tile, int64_t nb, const QBlock* x, int64_t ld, float* out) {
            const __m512i table = _mm512_broadcast_i32x4(
                _mm_load_si128(reinterpret_cast<const __m128i*>(Fmt == FMT_INT4 ? kInt4Biased : kFp4Biased)));
            const __m512i low = _mm512_set1_epi8(0x0F);
            const __m512 half_scale = _mm512_set1_ps(Fmt == FMT_MXFP4 ? 0.5f : 1.0f);  // mxfp4 bytes are 2x
            const Prefetch pf;
            __m512 acc[TB];
            zero(acc, TB);
            for (int64_t b = 0; b < nb; ++b, tile += block_bytes(Fmt), x += ld) {
                pf.lines<kBlockLines>(tile);
                const uint8_t* codes = tile + block_scale_bytes(Fmt);
                __m512i part[C][TB];
                for (int t = 0; t < TB; ++t) {
                    part[0][t] = _mm512_set1_epi32(x[t].corr);
                    for (int c = 1; c < C; ++c) part[c][t] = _mm512_setzero_si512();
                }
#pragma GCC unroll 4
                for (int o = 0; o < kBlock / 8; ++o) {
                    const __m512i v = _mm512_loadu_si512(codes + o * 4 * kRows);
                    const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
                    const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
#pragma GCC unroll 16
                    for (int t = 0; t < TB; ++t) {
                        __m512i& even = part[(2 * o) % C][t];
                        even = _mm512_dpbusd_epi32(even, lo, _mm512_set1_epi32(int(x[t].q[2 * o])));
                        __m512i& odd = part[(2 * o + 1) % C][t];
                        odd = _mm512_dpbusd_epi32(odd, hi, _mm512_set1_epi32(int(x[t].q[2 * o + 1])));
                    }
                }
                const __m512 ws = _mm512_mul_ps(block_scale<Fmt>(tile), half_scale);  // exact: a power of two
                for (int t = 0; t < TB; ++t) {
                    __m512i isum = part[0][t];
                    for (int c = 1; c < C; ++c) isum = _mm512_add_epi32(isum, part[c][t]);
                    const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(x[t].d));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, acc[t]);
                }
            }
            for (int t = 0; t < TB; ++t) _mm512_storeu_ps(out + t * kRows, acc[t]);
        }
    };
};

// ---- AMX: int4 / mxfp4 weights, bf16 activations token-major, x[t * ld + i] = pair i of token t.

// The tiles: activations A0, A1 (tb tokens x 16 pairs), decoded weights B0, B1 (16 pairs x 16
// rows as bf16 pairs), products C0..C3 (tb tokens x 16 rows, fp32). Block j of a group of four
// uses A and B (j % 2) and C j, so consecutive products do not wait on each other's tiles.
// product<j>(a, lda, b): C j = A (j % 2) x B (j % 2), loaded from a (row stride lda) and b;
// store<j>(p): C j to p, 64 bytes a row. (GCC's tile intrinsics take literal tile numbers.)
constexpr int kGroup = 4;           // blocks decoded a group ahead of their products
constexpr int kPairTile = 16 * 64;  // bytes of one decoded block (tile B)
constexpr bool is_b_tile(int t) { return t == 2 || t == 3; }

#ifdef TANDEM_AMX_EMULATE
#define TANDEM_AMX TANDEM_BF16
// The tile registers and operations in plain C++: what a test runs where the CPU has no AMX.
struct TileRegs {
    alignas(64) uint8_t data[8][16][64];
    uint8_t rows[8];
    uint16_t colsb[8];
};
thread_local TileRegs t_regs;
inline void tile_config(const uint8_t* cfg) {
    for (int i = 0; i < 8; ++i) {
        std::memcpy(&t_regs.colsb[i], cfg + 16 + 2 * i, 2);
        t_regs.rows[i] = cfg[48 + i];
    }
    std::memset(t_regs.data, 0, sizeof t_regs.data);
}
inline void tile_load(int t, const void* p, int64_t stride) {
    for (int r = 0; r < t_regs.rows[t]; ++r)
        std::memcpy(t_regs.data[t][r], static_cast<const uint8_t*>(p) + r * stride, t_regs.colsb[t]);
}
inline float bf16_at(const uint8_t* row, int i) {
    uint32_t u = uint32_t(row[2 * i] | row[2 * i + 1] << 8) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// C[m][n] = sum over pairs k of A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1] (fp32 sums; C zeroed first).
inline void tile_dot(int c, int a, int b) {
    for (int m = 0; m < t_regs.rows[c]; ++m)
        for (int n = 0; n < t_regs.colsb[c] / 4; ++n) {
            float sum = 0.0f;
            for (int k = 0; k < t_regs.colsb[a] / 4; ++k)
                sum += bf16_at(t_regs.data[a][m], 2 * k) * bf16_at(t_regs.data[b][k], 2 * n) +
                       bf16_at(t_regs.data[a][m], 2 * k + 1) * bf16_at(t_regs.data[b][k], 2 * n + 1);
            std::memcpy(&t_regs.data[c][m][4 * n], &sum, 4);
        }
}
template <int J>
inline void product(const void* a, int64_t lda, const void* b) {
    tile_load(J % 2, a, lda);
    tile_load(2 + J % 2, b, 64);
    tile_dot(4 + J, J % 2, 2 + J % 2);
}
template <int J>
inline void store(void* p) {
    for (int r = 0; r < t_regs.rows[4 + J]; ++r) std::memcpy(static_cast<uint8_t*>(p) + 64 * r, t_regs.data[4 + J][r], 64);
}
#else
#define TANDEM_AMX __attribute__((target("avx512bf16,amx-tile,amx-bf16")))
TANDEM_AMX inline void tile_config(const uint8_t* cfg) { _tile_loadconfig(cfg); }
template <int J>
TANDEM_AMX void product(const void* a, int64_t lda, const void* b);
template <int J>
TANDEM_AMX void store(void* p);
#define TANDEM_AMX_TILES(J, A, B, C)                                                     \
    template <>                                                                         \
    TANDEM_AMX inline void product<J>(const void* a, int64_t lda, const void* b) {      \
        _tile_zero(C);                                                                  \
        _tile_loadd(A, a, lda);                                                         \
        _tile_loadd(B, b, 64);                                                          \
        _tile_dpbf16ps(C, A, B);                                                        \
    }                                                                                   \
    template <>                                                                         \
    TANDEM_AMX inline void store<J>(void* p) { _tile_stored(C, p, 64); }
TANDEM_AMX_TILES(0, 0, 2, 4)
TANDEM_AMX_TILES(1, 1, 3, 5)
TANDEM_AMX_TILES(2, 0, 2, 6)
TANDEM_AMX_TILES(3, 1, 3, 7)
#undef TANDEM_AMX_TILES
#endif

// Loads the tile shapes for tb tokens. At every kernel call: the calling thread may have run
// other AMX code (torch's oneDNN) since its last one.
TANDEM_AMX inline void configure(int tb) {
    alignas(64) uint8_t cfg[64] = {};
    cfg[0] = 1;  // palette 1
    for (int t = 0; t < 8; ++t) {
        const uint16_t colsb = 64;
        std::memcpy(cfg + 16 + 2 * t, &colsb, 2);
        cfg[48 + t] = uint8_t(is_b_tile(t) ? 16 : tb);
    }
    tile_config(cfg);
}

template <int Fmt>
struct NibblesAmx {
    // Block b's 16 pairs x 16 rows as bf16 (vdpbf16ps's weight vectors, in pair order) into dst.
    TANDEM_AMX static void decode(const uint8_t* blk, __m512i table, const Prefetch& pf, uint8_t* dst) {
        pf.lines<kBlockLines>(blk);
        const uint8_t* codes = blk + block_scale_bytes(Fmt);
#pragma GCC unroll 4
        for (int o = 0; o < kBlock / 8; ++o) {
            const __m512i v = _mm512_loadu_si512(codes + o * 4 * kRows);
#pragma GCC unroll 4
            for (int q = 0; q < 4; ++q)
                _mm512_store_si512(dst + (4 * o + q) * 64, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4 * q), table));
        }
    }

    template <int TB>
    TANDEM_AMX static void tiles(const uint8_t* tile, int64_t nb, const uint32_t* x, int64_t ld, float* out) {
        const __m512i table = _mm512_load_si512(Fmt == FMT_INT4 ? kInt4Bf16 : kFp4Bf16);
        const Prefetch pf;
        configure(TB);
        alignas(64) uint8_t decoded[2][kGroup][kPairTile];
        alignas(64) float prod[kGroup][TB * kRows];
        __m512 acc[TB];
        zero(acc, TB);
        const int64_t bb = block_bytes(Fmt);
        for (int64_t j = 0; j < kGroup && j < nb; ++j) decode(tile + j * bb, table, pf, decoded[0][j]);
        for (int64_t g = 0, h = 0; g < nb; g += kGroup, h ^= 1) {
            const int64_t n = nb - g < kGroup ? nb - g : kGroup;
            const uint32_t* xg = x + g * (kBlock / 2);  // block g's 16 pairs of every token
            product<0>(xg, ld * 4, decoded[h][0]);
            if (n > 1) product<1>(xg + kBlock / 2, ld * 4, decoded[h][1]);
            if (n > 2) product<2>(xg + kBlock, ld * 4, decoded[h][2]);
            if (n > 3) product<3>(xg + 3 * kBlock / 2, ld * 4, decoded[h][3]);
            store<0>(prod[0]);
            if (n > 1) store<1>(prod[1]);
            if (n > 2) store<2>(prod[2]);
            if (n > 3) store<3>(prod[3]);
            // The next group's decode runs while the tile unit works on this one's products.
            for (int64_t j = 0; j < kGroup && g + kGroup + j < nb; ++j)
                decode(tile + (g + kGroup + j) * bb, table, pf, decoded[h ^ 1][j]);
            for (int64_t j = 0; j < n; ++j) {
                const __m512 scale = block_scale<Fmt>(tile + (g + j) * bb);
#pragma GCC unroll 16
                for (int t = 0; t < TB; ++t)
                    acc[t] = _mm512_fmadd_ps(_mm512_load_ps(prod[j] + t * kRows), scale, acc[t]);
            }
        }
        for (int t = 0; t < TB; ++t) _mm512_storeu_ps(out + t * kRows, acc[t]);
    }

    // ntok tokens, token-major: 16 at a time through the tiles, a single one through vdpbf16ps
    // (its pairs are contiguous: the column-major kernel with ld = 1).
    template <int TB>
    struct K {
        TANDEM_AMX static void run(const uint8_t* tile, int64_t nb, const uint32_t* x, int64_t ld, float* out) {
            if constexpr (TB == 1) NibblesDot<Fmt>::template K<1>::run(tile, nb, x, 1, out);
            else tiles<TB>(tile, nb, x, ld, out);
        }
    };
    static void drive(const uint8_t* tile, int64_t nb, const void* xv, int64_t ld, int ntok, float* out) {
        const uint32_t* x = static_cast<const uint32_t*>(xv);
        for (; ntok >= 16; ntok -= 16, x += 16 * ld, out += 16 * kRows) K<16>::run(tile, nb, x, ld, out);
        Remainder<K, 15>::run(ntok, tile, nb, x, ld, out);
    }
};

// The read-bandwidth probe's stream (tandem_read_seconds), with the kernels' software prefetch
// when g_tuning has it on (the probe reads with it off too).
uint64_t read_avx512(const uint8_t* buf, int64_t n) {
    __m512i a[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    const Prefetch pf;
    for (int64_t i = 0; i < n; i += 256) {
        pf.lines<4>(buf + i);
        for (int j = 0; j < 4; ++j) a[j] = _mm512_add_epi64(a[j], _mm512_load_si512(buf + i + 64 * j));
    }
    __m512i s = _mm512_xor_si512(_mm512_xor_si512(a[0], a[1]), _mm512_xor_si512(a[2], a[3]));
    return uint64_t(_mm512_reduce_add_epi64(s));
}

// Token blocks: 12 accumulators for the one-vector formats, 8 (plus 8 partial sums) for the
// block-scaled ones, 12 (plus 12 int32 sums) for int8 activations (10% faster than 8 at 12
// tokens on a Zen 4).
#define TANDEM_F32_TABLE                                                                      \
    {drive<F32, 12, float>, drive<Bf16, 12, float>, drive<Int8, 12, float>,                   \
     drive<Nibbles<FMT_INT4>::K, 8, float>, drive<Nibbles<FMT_MXFP4>::K, 8, float>}

#define TANDEM_I8_TABLE \
    {nullptr, nullptr, nullptr, drive<NibblesI8<FMT_INT4>::K, 12, QBlock>, drive<NibblesI8<FMT_MXFP4>::K, 12, QBlock>}

const Kernels kAvx512 = {TANDEM_F32_TABLE, {nullptr, nullptr, nullptr, nullptr, nullptr}, TANDEM_I8_TABLE, read_avx512};
const Kernels kAvx512Bf16 = {
    TANDEM_F32_TABLE,
    {nullptr, drive<Bf16Dot, 12, uint32_t>, nullptr, drive<NibblesDot<FMT_INT4>::K, 8, uint32_t>,
     drive<NibblesDot<FMT_MXFP4>::K, 8, uint32_t>},
    TANDEM_I8_TABLE,
    read_avx512,
};
const Kernels kAmx = {
    TANDEM_F32_TABLE,
    {nullptr, drive<Bf16Dot, 12, uint32_t>, nullptr, NibblesAmx<FMT_INT4>::drive, NibblesAmx<FMT_MXFP4>::drive},
    TANDEM_I8_TABLE,
    read_avx512,
    {false, false, false, true, true},
};

}  // namespace

const Kernels* kernels_avx512() { return &kAvx512; }
const Kernels* kernels_avx512bf16() { return &kAvx512Bf16; }
const Kernels* kernels_amx() { return &kAmx; }

}  // namespace tandem
