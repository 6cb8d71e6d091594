// Tandem's CPU routed-expert kernel: shared declarations of the packed layout and the per-ISA
// tile kernels. moe_common.cpp holds the thread pool, routing, the three phases and the C API;
// moe_scalar.cpp writes and reads the layout; moe_scalar.cpp, moe_avx2.cpp and moe_avx512.cpp
// hold one table of tile kernels each, compiled with their own -m flags and chosen at run time
// (__builtin_cpu_supports).
//
// Packed layout. An expert is two runs of tiles; a tile is kRows (16) weight rows over the whole
// input dimension K, padded with zeros to a multiple of kBlock (32):
//   phase-1 tiles (ceil(I/8) of them, K = H): rows 0-7 = gate rows 8j..8j+7, rows 8-15 = up rows
//     8j..8j+7, so the thread that computes a tile applies SwiGLU to it at once;
//   phase-2 tiles (ceil(H/16), K = I): down rows 16j..16j+15.
// Inside a tile the 16 rows run side by side, one input index after the other: a SIMD lane is a
// row, one loaded vector holds one input index of 16 rows and is multiplied by a broadcast
// activation of each token (so one load serves every token of the expert, and no horizontal
// sums are needed). Per format, with nb = K / 32 blocks:
//   fp32  [K][16] float                                            64 B per input index
//   bf16  [K/2][16] uint32: low half input 2i, high half 2i+1      the pair vdpbf16ps reads
//   int8  [16] float row scales (64 B), then [K][16] int8
//   int4  per block: [16] bf16 scales (32 B), then 4 octets of 64 B, two's complement -8..7
//   mxfp4 per block: [16] E8M0 scales (16 B), then 4 octets of 64 B, E2M1 codes
//         octet o (inputs 8o..8o+7) = [16 rows][2 words]: nibble s (bits 4s..4s+3) of word w of
//         row r holds input 8o + 2s + w. So row r's dword of one 64-byte load holds all 8 of its
//         inputs: shifting the words by 4s puts the pair (8o+2s, 8o+2s+1) in reach of one table
//         lookup (vpermw reads 5 index bits), one vdpbf16ps weight vector each with no widening
//         (moe_avx512.cpp); the fp32 kernels shift the dwords by 16 w + 4 s instead.
// The expert's byte size is rounded up to 64 so every expert starts on a cache line.
//
// int8 activations (the LOSSY activation mode "int8", int4 / mxfp4 weights only): each token's
// activations are quantised per block of 32 inputs, d = max|x| / 127, q = x / d rounded to the
// nearest (ties to even) in -127..127 (d = 0: all q = 0). A block of one token is a QBlock (40
// bytes, below): words 2o + h (o = octet, h = 0 / 1) hold four int8 q in the byte order of the
// nibbles (h = 0: low, 1: high) of a row's dword of octet o, byte j = input 8o + q8_input(h, j),
// i.e. low {8o, 8o+4, 8o+1, 8o+5}, high {8o+2, 8o+6, 8o+3, 8o+7}; then d (fp32) and the
// correction -bias * sum q (int32). The kernels map the codes to biased unsigned bytes (mxfp4:
// twice the E2M1 value + 12, so 0..24, against half the E8M0 scale; int4: value + 8), take the
// byte dot products with q (vpdpbusd / vpmaddubsw: unsigned x signed) from the correction: exact
// in int32. The block adds float(isum) * (scale[row] * d) to the fp32 output (one rounded
// product, then one fma: every ISA gives the same bits).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tandem {

constexpr int kRows = 16;   // weight rows per tile (one 512-bit vector of fp32)
constexpr int kBlock = 32;  // input elements per block: the int4 / mxfp4 scale group

enum Fmt : int { FMT_F32 = 0, FMT_BF16 = 1, FMT_INT8 = 2, FMT_INT4 = 3, FMT_MXFP4 = 4, FMT_COUNT = 5 };
enum Isa : int { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512BF16 = 3, ISA_AMX = 4, ISA_COUNT = 5 };

// Inline code in this header sits in an unnamed namespace: each file compiles its own copy with
// its own -m flags, and the linker must never merge an AVX-512 copy into the portable code.
namespace {

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Bytes of one tile of `nb` blocks.
constexpr int64_t tile_bytes(int fmt, int64_t nb) {
    return fmt == FMT_F32    ? nb * kBlock * kRows * 4
           : fmt == FMT_BF16 ? nb * kBlock * kRows * 2
           : fmt == FMT_INT8 ? 64 + nb * kBlock * kRows
           : fmt == FMT_INT4 ? nb * (kRows * 2 + kBlock / 2 * kRows)
                             : nb * (kRows + kBlock / 2 * kRows);
}

// Byte offsets inside an int4 / mxfp4 block: the scales, then the codes.
constexpr int64_t block_scale_bytes(int fmt) { return fmt == FMT_INT4 ? kRows * 2 : kRows; }
constexpr int64_t block_bytes(int fmt) { return block_scale_bytes(fmt) + kBlock / 2 * kRows; }
// Where the code of (row r, input i in 0..31) of an int4 / mxfp4 block sits, from the block's
// first code byte: byte nibble_byte, its high half when nibble_high (the octets above).
constexpr int64_t nibble_byte(int r, int i) { return (i / 8) * 4 * kRows + 4 * r + 2 * (i % 2) + (i % 8) / 4; }
constexpr bool nibble_high(int i) { return (i / 2) % 2 == 1; }
// The bit of a row's dword (the row's 4 bytes of an octet) where input 8o + k starts.
constexpr int octet_bit(int k) { return 16 * (k % 2) + 4 * (k / 2); }

// int8 activations: the input in byte j of word 2o + h of a QBlock (above).
constexpr int q8_input(int h, int j) { return 2 * h + j / 2 + 4 * (j % 2); }
// The word order is the packed layout's nibble order: input q8_input(h, j) of an octet sits in
// byte j of a row's dword, in its low (h = 0) or high (h = 1) nibble.
constexpr bool q8_order_matches_octets() {
    for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; ++j)
            if (nibble_byte(0, q8_input(h, j)) != j || nibble_high(q8_input(h, j)) != (h == 1)) return false;
    return true;
}
static_assert(q8_order_matches_octets(), "int8 activation words must follow the octets' nibble order");
// The biased unsigned weight byte of each code, and the bias: mxfp4 bytes are twice the E2M1
// value (integers), against half the block's scale; int4 bytes are the value + 8.
alignas(16) constexpr uint8_t kFp4Biased[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
alignas(16) constexpr uint8_t kInt4Biased[16] = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
constexpr int q8_bias(int fmt) { return fmt == FMT_INT4 ? 8 : 12; }

// The geometry of one layer's packed expert.
struct Geometry {
    int fmt, hidden, inter;
    int64_t nb_h, nb_i;          // blocks along H (gate/up input) and I (down input)
    int64_t tiles1, tiles2;      // phase-1 tiles (8 intermediate indices each), phase-2 tiles
    int64_t tile1, tile2;        // their byte sizes
    int64_t down_offset, expert_bytes;

    Geometry(int fmt_, int hidden_, int inter_)
        : fmt(fmt_), hidden(hidden_), inter(inter_),
          nb_h(round_up(hidden_, kBlock) / kBlock), nb_i(round_up(inter_, kBlock) / kBlock),
          tiles1(round_up(inter_, kRows / 2) / (kRows / 2)), tiles2(round_up(hidden_, kRows) / kRows),
          tile1(tile_bytes(fmt_, nb_h)), tile2(tile_bytes(fmt_, nb_i)),
          down_offset(tiles1 * tile1), expert_bytes(round_up(tiles1 * tile1 + tiles2 * tile2, 64)) {}
    int64_t hp() const { return nb_h * kBlock; }  // padded H
    int64_t ip() const { return nb_i * kBlock; }  // padded I
};

}  // namespace

// int8 activations: one block of 32 inputs of one token (the layout above).
struct QBlock {
    uint32_t q[8];  // word 2o + h: four int8 q, byte j = input 8o + q8_input(h, j)
    float d;        // max|x| / 127
    int32_t corr;   // -q8_bias(fmt) * (sum of the 32 q)
};
static_assert(sizeof(QBlock) == 40, "a QBlock is 10 words");

// A tile kernel: out[t * 16 + r] = sum_k W[r][k] * X[k][t] for t < ntok, r < 16 (row and block
// scales applied). X is column-major over tokens with leading dimension `ld`: fp32 x[k * ld + t]
// for the fp32 kernels; for the bf16 kernels uint32 x[i * ld + t] holding the bf16 pair
// (input 2i low, 2i+1 high); for the int8 kernels QBlock x[b * ld + t] (block b of token t).
using TileFn = void (*)(const uint8_t* tile, int64_t nb, const void* x, int64_t ld, int ntok, float* out);

struct Kernels {
    TileFn f32[FMT_COUNT];    // activations in fp32 (every format)
    TileFn bf16[FMT_COUNT];   // activations as bf16 pairs (vdpbf16ps); null where not offered
    TileFn i8[FMT_COUNT];     // int8 activations (int4 / mxfp4 weights); null where not offered
    // Streams [buf, buf + n) (n a multiple of 256, buf 64-aligned) and returns a value that
    // depends on every byte, so the reads cannot be dropped.
    uint64_t (*read)(const uint8_t* buf, int64_t n);
    // bf16 kernels that take their activations token-major (the AMX ones: a tile's rows are
    // tokens): x[t * ld + i] is bf16 pair i of token t, where the others read x[i * ld + t].
    bool bf16_token_major[FMT_COUNT];
};

const Kernels* kernels_scalar();
const Kernels* kernels_avx2();        // only on CPUs with avx2+fma+f16c
const Kernels* kernels_avx512();      // only with avx512f/bw/vl/dq
const Kernels* kernels_avx512bf16();  // only with avx512bf16 as well
const Kernels* kernels_amx();         // only with avx512bf16, amx-tile, amx-bf16 and the OS's leave to use them
// Asks Linux for leave to use AMX tiles in this process (once; every thread then may).
bool amx_permitted();
// The AVX-512 tables' i8 kernels use vpdpbusd: call them only where the CPU has avx512vnni too
// (moe_common.cpp runs the AVX2 ones otherwise).

// Decodes block b of a tile into q[r][i] (the element as stored: value, int8 / int4 / E2M1 code
// value) and s[r] (the block's scale; 1 for fp32 / bf16, the row scale for int8) so that the
// weight is exactly q * s. The scalar kernel and the unpacker share it.
void decode_block(int fmt, const uint8_t* tile, int64_t b, float q[kRows][kBlock], float s[kRows]);

namespace {

// Runs a token-blocked kernel K<TB>::run(tile, nb, x, ld, out) over ntok tokens: blocks of TBMAX
// tokens (the accumulators of a block live in registers), then one block of the remainder.
template <template <int> class K, int N>
struct Remainder {
    template <class X>
    static void run(int ntok, const uint8_t* tile, int64_t nb, const X* x, int64_t ld, float* out) {
        if (ntok == N) K<N>::run(tile, nb, x, ld, out);
        else Remainder<K, N - 1>::run(ntok, tile, nb, x, ld, out);
    }
};
template <template <int> class K>
struct Remainder<K, 0> {
    template <class X>
    static void run(int, const uint8_t*, int64_t, const X*, int64_t, float*) {}
};

template <template <int> class K, int TBMAX, class X>
void drive(const uint8_t* tile, int64_t nb, const void* xv, int64_t ld, int ntok, float* out) {
    const X* x = static_cast<const X*>(xv);
    for (; ntok >= TBMAX; ntok -= TBMAX, x += TBMAX, out += TBMAX * kRows) K<TBMAX>::run(tile, nb, x, ld, out);
    Remainder<K, TBMAX - 1>::run(ntok, tile, nb, x, ld, out);
}

}  // namespace

// One source matrix of an expert in its quantised row-major form (tandem_pack_expert's list).
struct Source {
    const uint8_t* w;
    const uint8_t* aux;  // int8 row scales, int4 / mxfp4 block scales
    int64_t rows, cols;  // cols: int4 padded to a multiple of 32
};
struct ExpertSources {
    Source gate, up, down;
};

// Packs tiles [t0, t1) of an expert (phase-1 tiles first, then phase-2) into `expert`.
void pack_tiles(int fmt, int hidden, int inter, const ExpertSources& src, int64_t t0, int64_t t1, uint8_t* expert);
// Decodes a packed expert: fp32 gate / up [I][H], down [H][I].
void unpack_expert(int fmt, int hidden, int inter, const uint8_t* expert, float* gate, float* up, float* down);

// Tuning knobs of the tile kernels, set through tandem_set_prefetch / tandem_set_balance
// (cpu_experts.py reads them from debugging environment variables) and read at each call.
// The L1 distance bounds the bytes a thread has in flight: at ~130 ns of DRAM latency under load,
// 1 KiB ahead caps a thread near 8 GB/s, which is what MXFP4 read per thread with 15 threads on
// a 16-core Xeon whose RAM gives 12.8 GB/s a thread (BENCHMARKS.md, session 14). On a GPU box's
// 16-core Xeon (session 15, same-run A/B, 15 threads, cold) L1 4 KiB + L2 16 KiB beat the others
// tried everywhere: bf16 84% -> 101-103% of the RAM probe from 1 KiB / no L2, MXFP4 with int8
// activations 58-63% -> 68-73%, exact MXFP4 46-51% -> 48-54% (its decode bounds it).
// dynamic_pct: the share of each phase's work that threads claim in small chunks as they finish
// (moe_common.cpp); the rest is split up front. The same box's profile (session 16, 15 threads,
// V4 MXFP4) had the slowest thread of a static split 30-40% behind the mean in both phases; on an
// H200 box's Xeon (session 17) 25% made V4 MXFP4 calls 10-26% faster (exact) and 21-22% (int8
// activations), and 40% added at most 3%. steal: work stealing instead (moe_common.cpp, `take`):
// the whole of each phase is split up front, and a thread done with its stretch takes from the back
// of the stretch with the most left; a thread that falls behind no longer holds the others.
struct Tuning {
    int64_t prefetch_l1 = 4096;  // bytes ahead of the weight stream prefetched to L1 (0: none)
    int64_t prefetch_l2 = 16384; // bytes ahead prefetched to L2 only (0: none)
    int dynamic_pct = 25;        // percent of each phase claimed as threads finish (0: all up front)
    bool steal = false;          // split each phase whole up front; threads done take from others' stretches
    int64_t stall_ns = 0;        // testing: thread N-1 sleeps this long before phase 1 (tandem_debug_stall)
};
extern Tuning g_tuning;

// E2M1 code -> value, and the two's complement int4 nibble -> value.
extern const float kFp4Values[16];
extern const float kInt4Values[16];

}  // namespace tandem
