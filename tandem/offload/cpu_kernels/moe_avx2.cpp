// AVX2 + FMA tile kernels (compiled with -mavx2 -mfma -mf16c; called only where the CPU has
// them). A tile's 16 rows are two 8-lane vectors; activations are fp32. Weights are converted
// to fp32 in registers: bf16 by a shift / mask of the pair, int8 by vpmovsxbd + vcvtdq2ps, int4
// by sign-extending the nibble with shifts, mxfp4 by vpermps over the 8 magnitudes plus the
// sign bit. int4 / mxfp4 scales multiply the block's partial sum, not each weight.
//
// int8 activations (int4 / mxfp4 weights; moe.h): vpshufb + vpmaddubsw, integer sums per block.
// These also serve AVX-512 CPUs without VNNI.
#include <immintrin.h>

#include "moe.h"

namespace tandem {
namespace {

inline void zero(__m256* a, int n) {
    for (int i = 0; i < n; ++i) a[i] = _mm256_setzero_ps();
}
// Rows 0-7 of token t are the sum of acc[c][0][t] over the C chains, rows 8-15 of acc[c][1][t].
template <int C, int TB>
inline void store_sum(float* out, const __m256 (&acc)[C][2][TB]) {
    for (int t = 0; t < TB; ++t)
        for (int half = 0; half < 2; ++half) {
            __m256 s = acc[0][half][t];
            for (int c = 1; c < C; ++c) s = _mm256_add_ps(s, acc[c][half][t]);
            _mm256_storeu_ps(out + t * kRows + 8 * half, s);
        }
}
// Independent FMA chains per token (an FMA waits ~4 cycles for its accumulator).
constexpr int chains(int tb, int want) { return tb >= want ? 1 : want / tb; }

template <int TB>
struct F32 {
    static constexpr int U = chains(TB, 2);
    static void run(const uint8_t* tile, int64_t nb, const float* x, int64_t ld, float* out) {
        const float* w = reinterpret_cast<const float*>(tile);
        __m256 acc[U][2][TB];
        zero(&acc[0][0][0], U * 2 * TB);
        for (int64_t k = 0; k < nb * kBlock; k += U, w += kRows * U, x += U * ld) {
#pragma GCC unroll 2
            for (int u = 0; u < U; ++u) {
                __m256 w0 = _mm256_loadu_ps(w + kRows * u), w1 = _mm256_loadu_ps(w + kRows * u + 8);
#pragma GCC unroll 16
                for (int t = 0; t < TB; ++t) {
                    __m256 xv = _mm256_broadcast_ss(x + u * ld + t);
                    acc[u][0][t] = _mm256_fmadd_ps(w0, xv, acc[u][0][t]);
                    acc[u][1][t] = _mm256_fmadd_ps(w1, xv, acc[u][1][t]);
                }
            }
        }
        store_sum(out, acc);
    }
};

// Even and odd inputs of a pair accumulate in separate chains.
template <int TB>
struct Bf16 {
    static void run(const uint8_t* tile, int64_t nb, const float* x, int64_t ld, float* out) {
        const __m256i high = _mm256_set1_epi32(int(0xFFFF0000u));
        __m256 acc[2][2][TB];
        zero(&acc[0][0][0], 4 * TB);
        for (int64_t i = 0; i < nb * kBlock / 2; ++i, tile += 64, x += 2 * ld) {
            for (int half = 0; half < 2; ++half) {
                __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * half));
                __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
#pragma GCC unroll 16
                for (int t = 0; t < TB; ++t) {
                    acc[0][half][t] = _mm256_fmadd_ps(even, _mm256_broadcast_ss(x + t), acc[0][half][t]);
                    acc[1][half][t] = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(x + ld + t), acc[1][half][t]);
                }
            }
        }
        store_sum(out, acc);
    }
};

inline __m256 int8x8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int TB>
struct Int8 {
    static constexpr int U = chains(TB, 2);
    static void run(const uint8_t* tile, int64_t nb, const float* x, int64_t ld, float* out) {
        const float* scale = reinterpret_cast<const float*>(tile);
        const uint8_t* codes = tile + 64;
        __m256 acc[U][2][TB];
        zero(&acc[0][0][0], U * 2 * TB);
        for (int64_t k = 0; k < nb * kBlock; k += U, codes += kRows * U, x += U * ld) {
#pragma GCC unroll 2
            for (int u = 0; u < U; ++u) {
                __m256 w0 = int8x8(codes + kRows * u), w1 = int8x8(codes + kRows * u + 8);
#pragma GCC unroll 16
                for (int t = 0; t < TB; ++t) {
                    __m256 xv = _mm256_broadcast_ss(x + u * ld + t);
                    acc[u][0][t] = _mm256_fmadd_ps(w0, xv, acc[u][0][t]);
                    acc[u][1][t] = _mm256_fmadd_ps(w1, xv, acc[u][1][t]);
                }
            }
        }
        const __m256 s[2] = {_mm256_loadu_ps(scale), _mm256_loadu_ps(scale + 8)};
        for (int u = 0; u < U; ++u)
            for (int half = 0; half < 2; ++half)
                for (int t = 0; t < TB; ++t) acc[u][half][t] = _mm256_mul_ps(acc[u][half][t], s[half]);
        store_sum(out, acc);
    }
};

// 8 rows of an octet: 32 bytes, row r's 8 codes in dword r; input 8o + k at bit octet_bit(k).
inline __m256i octet8(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

struct Int4Decode {
    static constexpr int fmt = FMT_INT4;
    __m256 scale(const uint8_t* blk, int half) const {  // bf16 scales of rows 8*half..8*half+7
        __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * half));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    template <int Bit>
    __m256 code(__m256i d) const {  // two's complement nibble
        return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(d, 28 - Bit), 28));
    }
};

struct Fp4Decode {
    static constexpr int fmt = FMT_MXFP4;
    __m256 magnitudes = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    __m256i sign = _mm256_set1_epi32(int(0x80000000u));
    __m256 scale(const uint8_t* blk, int half) const {  // E8M0: 2^(s-127), s = 0 -> 2^-127
        __m256i e = _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 8 * half))), 23);
        return _mm256_max_ps(_mm256_castsi256_ps(e), _mm256_set1_ps(0x1p-127f));
    }
    template <int Bit>
    __m256 code(__m256i d) const {  // vpermps reads bits 0-2: the magnitude; bit 3 is the sign
        __m256 s = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d, 28 - Bit), sign));
        return _mm256_xor_ps(_mm256_permutevar8x32_ps(magnitudes, _mm256_srli_epi32(d, Bit)), s);
    }
};

template <class Decode>
struct Nibbles {
    template <int TB>
    struct K {
        template <int M>
        static void fma(const Decode& dec, __m256i d, const float* x, int64_t ld, __m256 (&part)[TB]) {
            const __m256 w = dec.template code<octet_bit(M)>(d);
#pragma GCC unroll 16
            for (int t = 0; t < TB; ++t) part[t] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + M * ld + t), part[t]);
        }
        static void run(const uint8_t* tile, int64_t nb, const float* x, int64_t ld, float* out) {
            const Decode dec;
            __m256 acc[1][2][TB];
            zero(&acc[0][0][0], 2 * TB);
            for (int64_t b = 0; b < nb; ++b, tile += block_bytes(Decode::fmt)) {
                const uint8_t* codes = tile + block_scale_bytes(Decode::fmt);
                __m256 part[2][2][TB];  // the block's partial sums: [even / odd inputs][rows 0-7 / 8-15]
                zero(&part[0][0][0], 4 * TB);
                for (int o = 0; o < kBlock / 8; ++o, codes += 4 * kRows, x += 8 * ld) {
                    const __m256i d0 = octet8(codes), d1 = octet8(codes + 32);  // rows 0-7, 8-15
                    fma<0>(dec, d0, x, ld, part[0][0]), fma<0>(dec, d1, x, ld, part[0][1]);
                    fma<1>(dec, d0, x, ld, part[1][0]), fma<1>(dec, d1, x, ld, part[1][1]);
                    fma<2>(dec, d0, x, ld, part[0][0]), fma<2>(dec, d1, x, ld, part[0][1]);
                    fma<3>(dec, d0, x, ld, part[1][0]), fma<3>(dec, d1, x, ld, part[1][1]);
                    fma<4>(dec, d0, x, ld, part[0][0]), fma<4>(dec, d1, x, ld, part[0][1]);
                    fma<5>(dec, d0, x, ld, part[1][0]), fma<5>(dec, d1, x, ld, part[1][1]);
                    fma<6>(dec, d0, x, ld, part[0][0]), fma<6>(dec, d1, x, ld, part[0][1]);
                    fma<7>(dec, d0, x, ld, part[1][0]), fma<7>(dec, d1, x, ld, part[1][1]);
                }
                for (int half = 0; half < 2; ++half) {
                    const __m256 s = dec.scale(tile, half);
                    for (int t = 0; t < TB; ++t) {
                        const __m256 sum = _mm256_add_ps(part[0][half][t], part[1][half][t]);
                        acc[0][half][t] = _mm256_fmadd_ps(sum, s, acc[0][half][t]);
                    }
                }
            }
            store_sum(out, acc);
        }
    };
};

// ---- int8 activations (moe.h): QBlock x[b * ld + t]. Per 8-row half of an octet,
// vpshufb maps the low and the high nibbles to biased bytes (each row's dword: 4 inputs), then
// vpmaddubsw multiplies them by the token's 4 q in the same order (pairs summed in int16) and
// vpmaddwd by ones widens to int32. The four vpmaddubsw results of two octets are summed in int16
// first: each is at most 2 * 24 * 127 in magnitude, four stay below 2^15. Blocks of 4 tokens
// (16% faster than 2 at 4-8 tokens on a Zen 4, the same at 1-2).
template <class Decode>
struct NibblesI8 {
    template <int TB>
    struct K {
        static constexpr int fmt = Decode::fmt;
        static __m256i q8(uint32_t word) { return _mm256_set1_epi32(int(word)); }
        static void run(const uint8_t* tile, int64_t nb, const QBlock* x, int64_t ld, float* out) {
            const Decode dec;
            const __m256i table = _mm256_broadcastsi128_si256(
                _mm_load_si128(reinterpret_cast<const __m128i*>(fmt == FMT_INT4 ? kInt4Biased : kFp4Biased)));
            const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
            const __m256 half_scale = _mm256_set1_ps(fmt == FMT_MXFP4 ? 0.5f : 1.0f);  // mxfp4 bytes are 2x
            __m256 acc[1][2][TB];
            zero(&acc[0][0][0], 2 * TB);
            for (int64_t b = 0; b < nb; ++b, tile += block_bytes(fmt), x += ld) {
                const uint8_t* codes = tile + block_scale_bytes(fmt);
                for (int half = 0; half < 2; ++half) {
                    __m256i isum[TB];
                    for (int t = 0; t < TB; ++t) isum[t] = _mm256_set1_epi32(x[t].corr);
                    for (int o = 0; o < kBlock / 8; o += 2) {
                        __m256i w[4];  // octet o low, high nibbles, octet o + 1 low, high
                        for (int k = 0; k < 2; ++k) {
                            const __m256i v = octet8(codes + (o + k) * 4 * kRows + 32 * half);
                            w[2 * k] = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
                            w[2 * k + 1] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
                        }
#pragma GCC unroll 16
                        for (int t = 0; t < TB; ++t) {
                            const uint32_t* q = x[t].q + 2 * o;
                            __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], q8(q[0])),
                                                         _mm256_maddubs_epi16(w[1], q8(q[1])));
                            s = _mm256_add_epi16(s, _mm256_add_epi16(_mm256_maddubs_epi16(w[2], q8(q[2])),
                                                                     _mm256_maddubs_epi16(w[3], q8(q[3]))));
                            isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(s, ones));
                        }
                    }
                    const __m256 ws = _mm256_mul_ps(dec.scale(tile, half), half_scale);  // exact: a power of two
                    for (int t = 0; t < TB; ++t) {
                        const __m256 s = _mm256_mul_ps(ws, _mm256_broadcast_ss(&x[t].d));
                        acc[0][half][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), s, acc[0][half][t]);
                    }
                }
            }
            store_sum(out, acc);
        }
    };
};

uint64_t read_avx2(const uint8_t* buf, int64_t n) {
    __m256i a[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int64_t i = 0; i < n; i += 128)
        for (int j = 0; j < 4; ++j)
            a[j] = _mm256_add_epi64(a[j], _mm256_load_si256(reinterpret_cast<const __m256i*>(buf + i + 32 * j)));
    __m256i s = _mm256_xor_si256(_mm256_xor_si256(a[0], a[1]), _mm256_xor_si256(a[2], a[3]));
    return uint64_t(_mm256_extract_epi64(s, 0) ^ _mm256_extract_epi64(s, 1) ^ _mm256_extract_epi64(s, 2) ^
                    _mm256_extract_epi64(s, 3));
}

const Kernels kAvx2 = {
    {drive<F32, 4, float>, drive<Bf16, 3, float>, drive<Int8, 4, float>, drive<Nibbles<Int4Decode>::K, 2, float>,
     drive<Nibbles<Fp4Decode>::K, 2, float>},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
    {nullptr, nullptr, nullptr, drive<NibblesI8<Int4Decode>::K, 4, QBlock>, drive<NibblesI8<Fp4Decode>::K, 4, QBlock>},
    read_avx2,
};

}  // namespace

const Kernels* kernels_avx2() { return &kAvx2; }

}  // namespace tandem
