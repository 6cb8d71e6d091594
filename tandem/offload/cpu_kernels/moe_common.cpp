// Tandem's CPU routed-expert kernel: thread pool, ISA dispatch, packing, the MoE call and the
// read-bandwidth probe, behind a small C API (tandem/offload/cpu_experts.py binds it with
// ctypes). Compiled without SIMD flags: the SIMD lives in the per-ISA tile kernels (moe.h).
//
// One call, for a batch of T tokens with top-k routing (T > kChunk is done kChunk at a time):
//   routing (caller thread): (token, slot) pairs grouped by expert, experts ascending;
//   phase 0: each thread gathers its pairs' activations, column-major per expert ([H][n_e]);
//   phase 1: the active experts' gate/up tiles, concatenated, split over the threads by cost
//            (a tile costs its bytes plus a share per token); a tile is 8 gate and the 8 matching
//            up rows, so SwiGLU (clamped when the layer has a limit) is applied at once, for
//            every ISA alike -> intermediate [I][n_e];
//   phase 2: the output rows split over the threads; each thread runs every active expert's
//            down tiles of its rows and accumulates weight * result, experts ascending.
// Each phase hands the first (100 - dynamic_pct)% of its work out up front, a contiguous stretch
// per thread (the weights stream), and the rest in small chunks that threads claim as they finish
// (moe.h Tuning): on a VM some cores run a third slower than others, and with a static split every
// barrier waited for the slowest (BENCHMARKS.md, session 16). With work stealing (Tuning::steal)
// the whole phase is split up front and a thread done with its stretch takes from the back of the
// stretch with the most left (`take`). A chunk is whole tiles (phase 1) or whole output rows
// (phase 2), so who computes what never changes a result.
// With int8 activations (moe.h) phase 0 quantises what it gathers, and between phases 1 and 2 the
// threads quantise the intermediate, split by (expert, block of 32) (a block spans 4 phase-1 tiles,
// which may have been computed by different threads).
// Every weight is loaded once per call and applied to all its expert's tokens; each output
// element is summed by one thread in a fixed order, so results do not depend on the thread count.
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <vector>

#include "moe.h"

#define TANDEM_API extern "C" __attribute__((visibility("default")))

namespace tandem {

Tuning g_tuning;

bool amx_permitted() {
#if defined(__x86_64__) && !defined(TANDEM_SCALAR_ONLY)
    // Linux (5.16+) hands out the tile state per process on request: ARCH_REQ_XCOMP_PERM for
    // XFEATURE_XTILEDATA. Without it the first tile instruction is a SIGILL.
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ok;
#else
    return false;
#endif
}

namespace {

constexpr int kChunk = 512;            // tokens per pass (bounds the gathered activations)
constexpr int kTokensPerCall = 32;     // tokens handed to one tile-kernel call
constexpr int64_t kTileCostTokens = 4;  // a tile's streaming cost, in tokens of compute
constexpr int64_t kChunk1 = 2;          // phase-1 tiles per claimed chunk (phase 2 claims one row tile)
constexpr int64_t kSpinNs = 1000000;   // workers spin this long for the next job, then sleep
constexpr int kMaxThreads = 256;       // the pool's largest size

int64_t now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

// Spins until pred() holds; after 100 us it yields between checks (an oversubscribed machine).
template <class Pred>
void spin_until(Pred pred) {
    int64_t start = 0;
    for (int i = 1; !pred(); ++i) {
        cpu_relax();
        if ((i & 1023) == 0) {
            int64_t t = now_ns();
            if (start == 0) start = t;
            else if (t - start > 100000) sched_yield();
        }
    }
}

// ---- thread pool ------------------------------------------------------------------------------

using Job = void (*)(void* ctx, int tid, int nthreads);

// CPUs this process may run on, one per physical core first, then their SMT siblings.
std::vector<int> cpu_order() {
    cpu_set_t set;
    std::vector<int> first, second;
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return first;
    for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (!CPU_ISSET(c, &set)) continue;
        char path[96];
        std::snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu%d/topology/thread_siblings_list", c);
        int lowest = c;
        if (FILE* f = std::fopen(path, "r")) {
            if (std::fscanf(f, "%d", &lowest) != 1) lowest = c;
            std::fclose(f);
        }
        (lowest == c ? first : second).push_back(c);
    }
    first.insert(first.end(), second.begin(), second.end());
    return first;
}

// N threads: the caller of run() is thread 0 (not pinned: it may be Python's or CUDA's thread),
// workers 1..N-1 are pinned to distinct allowed CPUs, spin kSpinNs for the next job, then sleep
// on a futex.
class Pool {
public:
    int size() const { return n_; }

    void resize(int n) {
        n = std::clamp(n, 1, kMaxThreads);
        stop_workers();
        n_ = n;
        std::vector<int> cpus = cpu_order();
        for (int tid = 1; tid < n; ++tid) {
            Worker* w = new Worker{this, tid, cpus.empty() ? -1 : cpus[tid % cpus.size()], 0};
            if (pthread_create(&w->thread, nullptr, &Pool::thread_main, w) != 0) {
                delete w;
                n_ = tid;  // fewer threads than asked: the machine refused more
                break;
            }
            workers_.push_back(w);
        }
    }

    void run(Job job, void* ctx) {
        if (n_ == 1) return job(ctx, 0, 1);
        job_ = job, ctx_ = ctx;
        remaining_.store(n_ - 1, std::memory_order_relaxed);
        gen_.fetch_add(1, std::memory_order_seq_cst);
        if (sleepers_.load(std::memory_order_seq_cst) > 0) wake();
        job(ctx, 0, n_);
        spin_until([&] { return remaining_.load(std::memory_order_acquire) == 0; });
    }

    // Inside a job: returns when all N threads reached it.
    void barrier() {
        uint32_t g = bar_gen_.load(std::memory_order_acquire);
        if (bar_count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
            bar_count_.store(0, std::memory_order_relaxed);
            bar_gen_.fetch_add(1, std::memory_order_release);
        } else {
            spin_until([&] { return bar_gen_.load(std::memory_order_acquire) != g; });
        }
    }

    // In a forked child the workers do not exist: forget them.
    void after_fork() {
        for (Worker* w : workers_) delete w;
        workers_.clear();
        n_ = 1;
        stop_.store(false);
        sleepers_.store(0);
    }

private:
    struct Worker {
        Pool* pool;
        int tid, cpu;
        pthread_t thread;
    };

    static void* thread_main(void* arg) {
        Worker* w = static_cast<Worker*>(arg);
        if (w->cpu >= 0) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(w->cpu, &set);
            sched_setaffinity(0, sizeof(set), &set);  // best effort
        }
        w->pool->loop(w->tid);
        return nullptr;
    }

    void loop(int tid) {
        uint32_t seen = start_gen_;
        for (;;) {
            seen = wait_for_job(seen);
            if (stop_.load(std::memory_order_acquire)) return;
            job_(ctx_, tid, n_);
            remaining_.fetch_sub(1, std::memory_order_release);
        }
    }

    uint32_t wait_for_job(uint32_t seen) {
        int64_t deadline = now_ns() + kSpinNs;
        for (int i = 1;; ++i) {
            uint32_t g = gen_.load(std::memory_order_acquire);
            if (g != seen) return g;
            cpu_relax();
            if ((i & 255) == 0 && now_ns() > deadline) break;
        }
        for (;;) {  // run() bumps gen_ then reads sleepers_; we bump sleepers_ then read gen_
            sleepers_.fetch_add(1, std::memory_order_seq_cst);
            if (gen_.load(std::memory_order_seq_cst) == seen)
                syscall(SYS_futex, &gen_, FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
            sleepers_.fetch_sub(1, std::memory_order_relaxed);
            uint32_t g = gen_.load(std::memory_order_acquire);
            if (g != seen) return g;
        }
    }

    void wake() { syscall(SYS_futex, &gen_, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0); }

    void stop_workers() {
        if (workers_.empty()) return;
        stop_.store(true, std::memory_order_release);
        gen_.fetch_add(1, std::memory_order_seq_cst);
        wake();
        for (Worker* w : workers_) pthread_join(w->thread, nullptr), delete w;
        workers_.clear();
        stop_.store(false);
        start_gen_ = gen_.load();
    }

    int n_ = 1;
    std::vector<Worker*> workers_;
    Job job_ = nullptr;
    void* ctx_ = nullptr;
    uint32_t start_gen_ = 0;
    std::atomic<bool> stop_{false};
    alignas(64) std::atomic<uint32_t> gen_{0};
    alignas(64) std::atomic<int> remaining_{0};
    alignas(64) std::atomic<int> sleepers_{0};
    alignas(64) std::atomic<uint32_t> bar_gen_{0};
    alignas(64) std::atomic<int> bar_count_{0};
};

// ---- global state: one call at a time (the pool and the scratch are shared) ------------------

struct Buffer {  // grow-only, 64-byte aligned
    void* ptr = nullptr;
    size_t size = 0;
    void* get(size_t bytes) {
        if (bytes <= size) return ptr;
        void* p = nullptr;
        if (posix_memalign(&p, 64, bytes) != 0) return nullptr;
        std::free(ptr);
        ptr = p, size = bytes;
        return p;
    }
};

// Work stealing (Tuning::steal): a phase's items (phase-1 tiles, phase-2 row tiles) are split up
// front into one stretch per thread, kept as (front, back) in one 64-bit word that every change
// swaps whole, so each item is taken exactly once. The owner takes its stretch from the front a
// few items at a time (its weight stream stays contiguous); a thread whose stretch is done takes
// from the back of the stretch with the most left. A thread that falls behind (a slower core, a
// vCPU descheduled mid-stretch) then loses the end of its stretch instead of holding every other
// thread at the barrier.
struct alignas(64) Stretch {
    std::atomic<uint64_t> span{0};  // front in the low 32 bits, back in the high 32
};
inline uint64_t pack_span(int64_t front, int64_t back) { return uint64_t(back) << 32 | uint64_t(front); }
inline int64_t span_front(uint64_t v) { return int64_t(v & 0xFFFFFFFFu); }
inline int64_t span_back(uint64_t v) { return int64_t(v >> 32); }

// Items [first, end) for thread tid: from the front of its own stretch, `step` of them or (`halve`)
// half of what is left, at least `step`; else up to `step` from the back of the fullest other
// stretch. False when every stretch is empty. `steals` counts the second kind.
bool take(Stretch* s, int n, int tid, int64_t step, bool halve, std::atomic<int64_t>& steals, int64_t& first,
          int64_t& end) {
    uint64_t v = s[tid].span.load(std::memory_order_relaxed);
    while (span_front(v) < span_back(v)) {
        const int64_t f = span_front(v), b = span_back(v);
        const int64_t e = std::min(f + (halve ? std::max(step, (b - f + 1) / 2) : step), b);
        if (s[tid].span.compare_exchange_weak(v, pack_span(e, b), std::memory_order_relaxed)) {
            first = f, end = e;
            return true;
        }
    }
    for (;;) {
        int victim = -1;
        int64_t most = 0;
        uint64_t seen = 0;
        for (int i = 0; i < n; ++i) {
            const uint64_t w = s[i].span.load(std::memory_order_relaxed);
            if (span_back(w) - span_front(w) > most) most = span_back(w) - span_front(w), victim = i, seen = w;
        }
        if (victim < 0) return false;
        const int64_t f = span_front(seen), b = span_back(seen), start = std::max(f, b - step);
        if (s[victim].span.compare_exchange_strong(seen, pack_span(f, start), std::memory_order_relaxed)) {
            steals.fetch_add(1, std::memory_order_relaxed);
            first = start, end = b;
            return true;
        }
    }
}

// Where a call's time goes, per thread (tandem_profile): timestamps of each part of moe_job, summed
// over the calls made while it is on. Parts: 0 wake-up (the job's start after run() began), 1 the
// gather (phase 0), 2 the wait at the barrier after it, 3 the gate/up tiles (phase 1), 4 the wait
// at the barrier after them (with int8 activations also the intermediate's quantisation and its
// barrier), 5 the down tiles (phase 2), 6 the wait until the last thread is done. Off by default:
// seven clock reads per thread per call.
constexpr int kProfParts = 7;
constexpr int kProfThreads = kMaxThreads;
struct Profile {
    bool on = false;
    int64_t calls = 0, call_ns = 0, route_ns = 0;  // whole calls, and their routing before the job
    int64_t run_start = 0;                         // this pass: when run() began
    int64_t mark[kProfThreads][kProfParts - 1];    // this pass: the end of parts 0-5, per thread
    int64_t sum[kProfThreads][kProfParts];
    void reset() {
        calls = call_ns = route_ns = 0;
        std::memset(sum, 0, sizeof(sum));
    }
    void at(int tid, int part) {
        if (on && tid < kProfThreads) mark[tid][part] = now_ns();
    }
    void add_pass(int nthreads, int64_t end) {  // after run(): every thread's marks are in
        for (int t = 0; t < nthreads && t < kProfThreads; ++t) {
            int64_t prev = run_start;
            for (int p = 0; p < kProfParts - 1; ++p) sum[t][p] += mark[t][p] - prev, prev = mark[t][p];
            sum[t][kProfParts - 1] += end - prev;
        }
    }
};

struct State {
    std::mutex mutex;
    Pool pool;
    Profile prof;
    int isa = ISA_SCALAR;
    const Kernels* kernels = kernels_scalar();
    const TileFn* i8 = kernels_scalar()->i8;  // the int8-activation kernels run under `isa`
    Buffer x, act, act8, acc, routing;
    std::atomic<int64_t> next1{0}, next2{0};  // the claimed chunks of the pass running (Plan::next1 / next2)
    Stretch stretch1[kMaxThreads], stretch2[kMaxThreads];  // work stealing: each thread's stretch per phase
    std::atomic<int64_t> steals{0};  // chunks taken from another thread's stretch (tandem_take_steals)
};

State& state() {
    static State* s = [] {
        State* st = new State;  // never destroyed: workers may outlive static destructors
        pthread_atfork(nullptr, nullptr, [] {
            new (&state().mutex) std::mutex;
            state().pool.after_fork();
        });
        return st;
    }();
    return *s;
}

bool isa_supported(int isa) {
#if defined(__x86_64__) && !defined(TANDEM_SCALAR_ONLY)
    __builtin_cpu_init();
    bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    switch (isa) {
    case ISA_SCALAR: return true;
    case ISA_AVX2: return avx2;
    case ISA_AVX512: return avx512;
    case ISA_AVX512BF16: return avx512 && __builtin_cpu_supports("avx512bf16");
#ifdef TANDEM_AMX_EMULATE
    case ISA_AMX: return avx512 && __builtin_cpu_supports("avx512bf16");
#else
    case ISA_AMX:
        return avx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("amx-tile") &&
               __builtin_cpu_supports("amx-bf16") && amx_permitted();
#endif
    }
    return false;
#else
    return isa == ISA_SCALAR;
#endif
}

bool vnni_supported() {
#if defined(__x86_64__) && !defined(TANDEM_SCALAR_ONLY)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni");
#else
    return false;
#endif
}

const Kernels* kernels_for(int isa) {
#if defined(__x86_64__) && !defined(TANDEM_SCALAR_ONLY)
    switch (isa) {
    case ISA_AVX2: return kernels_avx2();
    case ISA_AVX512: return kernels_avx512();
    case ISA_AVX512BF16: return kernels_avx512bf16();
    case ISA_AMX: return kernels_amx();
    }
#endif
    return kernels_scalar();
}

// The int8-activation kernels of an ISA: the AVX-512 ones use vpdpbusd, so an AVX-512 CPU without
// VNNI runs the AVX2 ones (vpmaddubsw).
const TileFn* int8_kernels(int isa) {
    if (isa >= ISA_AVX512 && !vnni_supported()) return kernels_for(ISA_AVX2)->i8;
    return kernels_for(isa)->i8;
}

// ---- numbers ----------------------------------------------------------------------------------

inline float bf16_to_float(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline uint16_t float_to_bf16(float f) {  // round to nearest even
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}
// silu(g) * u; limit > 0 clamps first, as DeepSeek-V4's ClampedSwiGLU (models/deepseek_v4_moe.py):
// silu(min(g, limit)) * clamp(u, -limit, limit). NaN stays NaN, as in torch.clamp. limit 0: the
// plain SwiGLU, bit for bit.
inline float swiglu(float g, float u, float limit) {
    if (limit > 0.0f) g = std::min(g, limit), u = std::min(std::max(u, -limit), limit);
    return g / (1.0f + std::exp(-g)) * u;
}

constexpr int64_t kQBlockWords = sizeof(QBlock) / 4;

// Quantises the 32 values of one block for int8 activations (moe.h), for weights whose biased
// bytes carry `bias`. A NaN or inf in the block makes d NaN and every q 0, so the block's
// products are NaN, as in the exact math.
void quantize_block(const float v[kBlock], int bias, QBlock* out) {
    // (y + 1.5 * 2^23) - 1.5 * 2^23 rounds y to an integer, ties to even, as nearbyintf does under
    // the default rounding mode (for |y| < 2^22); inline, unlike the libm call.
    constexpr float kRound = 12582912.0f;
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < kBlock; ++i) {
        const float a = std::fabs(v[i]);
        amax = a > amax ? a : amax;
        finite = finite && a <= FLT_MAX;  // false for inf and NaN
    }
    const float d = finite ? amax / 127.0f : NAN;
    int8_t q[kBlock];
    int32_t sum = 0;
    for (int i = 0; i < kBlock; ++i) {
        const float y = d > 0.0f ? (v[i] / d + kRound) - kRound : 0.0f;
        q[i] = int8_t(std::min(std::max(y, -127.0f), 127.0f));
        sum += q[i];
    }
    for (int o = 0; o < kBlock / 8; ++o)
        for (int h = 0; h < 2; ++h) {
            uint32_t word = 0;
            for (int j = 0; j < 4; ++j) word |= uint32_t(uint8_t(q[8 * o + q8_input(h, j)])) << (8 * j);
            out->q[2 * o + h] = word;
        }
    out->d = d;
    out->corr = -bias * sum;
}

}  // namespace
}  // namespace tandem

using namespace tandem;

// ---- the call -----------------------------------------------------------------------------------

enum Dtype : int32_t { DT_F32 = 0, DT_BF16 = 1, DT_I32 = 2, DT_I64 = 3 };
enum ActDtype : int32_t { ACT_AUTO = 0, ACT_INT8 = 1 };  // ACT_INT8: int4 / mxfp4 weights only
enum Status : int32_t { ST_OK = 0, ST_BAD_EXPERT = 1, ST_BAD_COUNT = 2, ST_NO_MEMORY = 3, ST_BAD_ARGS = 4 };

// What Python's HostJob / forward_into hand over (ctypes mirrors it field by field).
struct tandem_call {
    const uint8_t* data;  // [E, expert_bytes] packed experts
    int64_t expert_bytes;
    int32_t num_experts, hidden, inter, fmt;
    float swiglu_limit;   // > 0: the SwiGLU clamp (swiglu()); 0: none
    int32_t act_dtype;    // ActDtype
    const void* x;        // [rows, H] f32 / bf16
    const void* ids;      // [rows, k] i32 / i64
    const void* weights;  // [rows, k] f32 / bf16
    void* out;            // [rows, H], x's dtype
    const int32_t* num_tokens;  // rows to compute, read at run time; null: all rows
    int32_t rows, top_k, x_dtype, ids_dtype, w_dtype;
    int32_t status;       // out: Status
    int64_t bad_value;    // out: the offending expert id / count
};

namespace tandem {
namespace {

// How the kernels take their activations: fp32, bf16 pairs (vdpbf16ps) or int8 blocks (moe.h).
enum Acts : int { ACTS_F32, ACTS_BF16, ACTS_INT8 };

struct Plan {
    const tandem_call* c;
    Geometry g;
    TileFn fn;
    Acts acts;
    bool tmajor;               // the kernel reads its bf16 activations token-major (Kernels::bf16_token_major)
    int64_t t0, T, k;          // this chunk: tokens [t0, t0 + T)
    int64_t x_rows, a_rows;    // 4-byte words per token of the gathered activations / intermediate
    int64_t q_rows;            // int8: 4-byte words per token of the quantised intermediate
    int64_t tok_words;         // 4-byte words per token of one row of the kernels' input (QBlock: 10)
    int A;                     // active experts
    const int* expert;         // [A] ids, ascending
    const int* start;          // [A + 1] their first pair
    const int* pair_expert;    // [P] index into expert[]
    const int* pair_tok;       // [P] token (chunk-relative)
    const float* pair_w;       // [P]
    const int64_t* split;      // [N + 1] phase-1 tile boundaries per thread (the static part)
    int64_t static2;           // phase-2 row tiles [0, static2) split over the threads; the rest claimed
    std::atomic<int64_t>* next1;  // the next phase-1 tile to claim (from split[N])
    std::atomic<int64_t>* next2;  // the next phase-2 row tile to claim (from static2)
    Stretch* stretch1;         // work stealing: each thread's phase-1 tiles, from split (else null)
    Stretch* stretch2;         // work stealing: each thread's phase-2 row tiles (else null)
    std::atomic<int64_t>* steals;
    int nthreads;
    uint32_t* x;               // [P * x_rows] gathered activations, per expert [x_rows][n] (int8: QBlock [nb_h][n])
    uint32_t* act;             // [P * a_rows] intermediate, per expert [a_rows][n]
    uint32_t* act8;            // int8: [P * q_rows] the quantised intermediate, per expert QBlock [nb_i][n]
    float* acc;                // [T, hp] output accumulator
};

float weight_at(const tandem_call* c, int64_t i) {
    return c->w_dtype == DT_F32 ? static_cast<const float*>(c->weights)[i]
                                : bf16_to_float(static_cast<const uint16_t*>(c->weights)[i]);
}
int64_t id_at(const tandem_call* c, int64_t i) {
    return c->ids_dtype == DT_I32 ? static_cast<const int32_t*>(c->ids)[i] : static_cast<const int64_t*>(c->ids)[i];
}

// Where word i of token j sits in an expert's activations (or intermediate) of `rows` words per
// token and n tokens: column-major [rows][n], or token-major [n][rows] for a kernel that reads
// that (Plan::tmajor); token j's first word as the kernels take it, and their ld.
inline int64_t word_at(const Plan& p, int64_t rows, int64_t n, int64_t i, int64_t j) {
    return p.tmajor ? j * rows + i : i * n + j;
}
inline int64_t token_offset(const Plan& p, int64_t rows, int64_t j) { return p.tmajor ? j * rows : j * p.tok_words; }
inline int64_t kernel_ld(const Plan& p, int64_t rows, int64_t n) { return p.tmajor ? rows : n; }

// Element h of pair q's hidden state (chunk-relative token) as fp32; 0 past H.
inline float hidden_at(const Plan& p, int64_t q, int64_t h) {
    const int64_t H = p.g.hidden, row = (p.t0 + p.pair_tok[q]) * H;
    return h >= H ? 0.0f
           : p.c->x_dtype == DT_F32 ? static_cast<const float*>(p.c->x)[row + h]
                                    : bf16_to_float(static_cast<const uint16_t*>(p.c->x)[row + h]);
}

// Activation h of pair q as the fp32 / bf16 kernels read it.
inline uint32_t activation(const Plan& p, int64_t q, int64_t h) {
    const int64_t H = p.g.hidden, row = (p.t0 + p.pair_tok[q]) * H;
    if (p.acts == ACTS_BF16) {  // bf16 pair (2h, 2h+1), straight from the bf16 hidden state
        const uint16_t* src = static_cast<const uint16_t*>(p.c->x) + row;
        uint32_t lo = 2 * h < H ? src[2 * h] : 0, hi = 2 * h + 1 < H ? src[2 * h + 1] : 0;
        return lo | hi << 16;
    }
    const float v = hidden_at(p, q, h);
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return u;
}

// Gathers this thread's pairs into the per-expert column-major activations, up to 16 columns
// of one expert at a time (so each written cache line is filled at once).
void phase0_gather(const Plan& p, int tid, int nthreads) {
    const int64_t P = p.start[p.A], q1 = P * (tid + 1) / nthreads;  // the pairs not skipped
    for (int64_t q0 = P * tid / nthreads; q0 < q1;) {
        const int a = p.pair_expert[q0];
        const int64_t n = p.start[a + 1] - p.start[a], j0 = q0 - p.start[a];
        const int64_t cols = std::min<int64_t>({16, q1 - q0, n - j0});
        if (p.acts == ACTS_INT8) {
            QBlock* x = reinterpret_cast<QBlock*>(p.x + int64_t(p.start[a]) * p.x_rows) + j0;
            float v[kBlock];
            for (int64_t b = 0; b < p.g.nb_h; ++b)
                for (int64_t j = 0; j < cols; ++j) {
                    for (int i = 0; i < kBlock; ++i) v[i] = hidden_at(p, q0 + j, b * kBlock + i);
                    quantize_block(v, q8_bias(p.g.fmt), x + b * n + j);
                }
        } else if (p.tmajor) {  // token by token: a token's words are contiguous here
            uint32_t* x = p.x + int64_t(p.start[a]) * p.x_rows;
            for (int64_t j = 0; j < cols; ++j)
                for (int64_t h = 0; h < p.x_rows; ++h) x[word_at(p, p.x_rows, n, h, j0 + j)] = activation(p, q0 + j, h);
        } else {
            uint32_t* x = p.x + int64_t(p.start[a]) * p.x_rows;
            for (int64_t h = 0; h < p.x_rows; ++h)
                for (int64_t j = 0; j < cols; ++j) x[word_at(p, p.x_rows, n, h, j0 + j)] = activation(p, q0 + j, h);
        }
        // Intermediate rows past the last gate/up tile are never written: zero them (the down
        // weights there are zero, but 0 * garbage may be NaN, and int8 quantises whole blocks).
        // 0u is also 0.0f.
        uint32_t* act = p.act + int64_t(p.start[a]) * p.a_rows;
        for (int64_t i = p.g.tiles1 * kRows / 2 / (p.acts == ACTS_BF16 ? 2 : 1); i < p.a_rows; ++i)
            for (int64_t j = 0; j < cols; ++j) act[word_at(p, p.a_rows, n, i, j0 + j)] = 0;
        q0 += cols;
    }
}

// A thread's weight stream jumps at each new expert, where the kernels' prefetch (which runs
// ahead within a stream) has not reached: prefetch_start asks for the first prefetch_l1 bytes
// of the next stretch (up to 4 KiB) before the jump, e.g. while this thread waits in a barrier.
void prefetch_start(const uint8_t* p) {
    const int64_t n = std::min<int64_t>(g_tuning.prefetch_l1, 4096);
    for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(p + i, 0, 3);
}
const uint8_t* gate_up_tile(const Plan& p, int a, int64_t jt) {
    return p.c->data + p.expert[a] * p.g.expert_bytes + jt * p.g.tile1;
}
const uint8_t* down_tile(const Plan& p, int a, int64_t ht) {
    return p.c->data + p.expert[a] * p.g.expert_bytes + p.g.down_offset + ht * p.g.tile2;
}
// This thread's first phase-2 tile (of its stretch).
const uint8_t* first_down_tile(const Plan& p, int tid, int nthreads);

// The gate/up tile at index t of the active experts' concatenated tiles.
const uint8_t* gate_up_at(const Plan& p, int64_t t) { return gate_up_tile(p, int(t / p.g.tiles1), t % p.g.tiles1); }

// Items [first, end) of a phase; empty: none left.
struct Span {
    int64_t first = 0, end = 0;
    bool empty() const { return first >= end; }
};

// This thread's next phase-1 tiles after what it has done: the next kChunk1 of the shared pool, or
// with work stealing from its stretch or another's (`take`); their first lines asked for.
Span next1(const Plan& p, int tid) {
    const int64_t total = p.A * p.g.tiles1;
    Span s;
    if (p.stretch1) {
        if (!take(p.stretch1, p.nthreads, tid, kChunk1, false, *p.steals, s.first, s.end)) return {};
    } else {
        s.first = p.next1->fetch_add(kChunk1, std::memory_order_relaxed), s.end = std::min(s.first + kChunk1, total);
    }
    if (s.first < total) prefetch_start(gate_up_at(p, s.first));
    return s;
}

// Tiles [t0, t1) of the concatenated gate/up tiles. Returns this thread's next tiles (`next1`),
// taken at the start of the last tile (their lines come in while that tile streams).
Span gate_up_tiles(const Plan& p, int tid, Span tiles) {
    if (tiles.empty()) return next1(p, tid);
    float out[kTokensPerCall * kRows];
    const float limit = p.c->swiglu_limit;
    Span next;
    int a = int(tiles.first / p.g.tiles1);
    for (int64_t tile = tiles.first; tile < tiles.end; ++tile) {
        while (tile >= (a + 1) * p.g.tiles1) ++a;
        const int64_t jt = tile - a * p.g.tiles1, n = p.start[a + 1] - p.start[a];
        const uint8_t* w = gate_up_tile(p, a, jt);
        if (tile + 1 == tiles.end) {
            next = next1(p, tid);
        } else if (jt == p.g.tiles1 - 1) {
            prefetch_start(gate_up_tile(p, a + 1, 0));
        }
        const uint32_t* x = p.x + int64_t(p.start[a]) * p.x_rows;
        uint32_t* act = p.act + int64_t(p.start[a]) * p.a_rows;
        for (int64_t c0 = 0; c0 < n; c0 += kTokensPerCall) {
            const int cnt = int(n - c0 < kTokensPerCall ? n - c0 : kTokensPerCall);
            p.fn(w, p.g.nb_h, x + token_offset(p, p.x_rows, c0), kernel_ld(p, p.x_rows, n), cnt, out);
            for (int t = 0; t < cnt; ++t)
                for (int i = 0; i < kRows / 2; ++i) {
                    float v = swiglu(out[t * kRows + i], out[t * kRows + kRows / 2 + i], limit);
                    int64_t row = jt * kRows / 2 + i;  // intermediate index
                    if (p.acts == ACTS_BF16) {  // the bf16 half of pair row / 2
                        const uint16_t h = float_to_bf16(v);
                        std::memcpy(reinterpret_cast<char*>(act + word_at(p, p.a_rows, n, row / 2, c0 + t)) + 2 * (row % 2), &h, 2);
                    } else
                        reinterpret_cast<float*>(act)[row * n + c0 + t] = v;
                }
        }
    }
    return next;
}

// Phase 1 for one thread: its stretch (whole, or taken a chunk at a time with work stealing), then
// chunks while any are left.
void phase1_gate_up(const Plan& p, int tid) {
    Span tiles = p.stretch1 ? Span{} : Span{p.split[tid], p.split[tid + 1]};
    do tiles = gate_up_tiles(p, tid, tiles);
    while (!tiles.empty());
}

// int8 activations: quantises the fp32 intermediate for the down tiles, each thread a share of
// the (expert, block of 32) units, every token of the unit's expert.
void quantize_intermediate(const Plan& p, int tid, int nthreads) {
    const int64_t units = p.A * p.g.nb_i;
    float v[kBlock];
    for (int64_t u = units * tid / nthreads; u < units * (tid + 1) / nthreads; ++u) {
        const int a = int(u / p.g.nb_i);
        const int64_t b = u % p.g.nb_i, n = p.start[a + 1] - p.start[a];
        const float* act = reinterpret_cast<const float*>(p.act + int64_t(p.start[a]) * p.a_rows) + b * kBlock * n;
        QBlock* dst = reinterpret_cast<QBlock*>(p.act8 + int64_t(p.start[a]) * p.q_rows) + b * n;
        for (int64_t j = 0; j < n; ++j) {
            for (int i = 0; i < kBlock; ++i) v[i] = act[i * n + j];
            quantize_block(v, q8_bias(p.g.fmt), dst + j);
        }
    }
}

// What the down tiles of active expert a read: [rows][n] of the intermediate, as the kernels take it.
const uint32_t* down_input(const Plan& p, int a) {
    return p.acts == ACTS_INT8 ? p.act8 + int64_t(p.start[a]) * p.q_rows : p.act + int64_t(p.start[a]) * p.a_rows;
}

// Output rows of row tiles [h0, h1) from the accumulator to the call's output, in its dtype.
void write_rows(const Plan& p, int64_t h0, int64_t h1) {
    const int64_t hp = p.g.hp(), H = p.g.hidden, end = h1 * kRows < H ? h1 * kRows : H;
    for (int64_t t = 0; t < p.T; ++t) {
        const float* src = p.acc + t * hp;
        const int64_t row = (p.t0 + t) * H;
        for (int64_t h = h0 * kRows; h < end; ++h) {
            if (p.c->x_dtype == DT_F32) static_cast<float*>(p.c->out)[row + h] = src[h];
            else static_cast<uint16_t*>(p.c->out)[row + h] = float_to_bf16(src[h]);
        }
    }
}

// This thread's next phase-2 row tile after what it has done: the next of the shared pool, or
// with work stealing from its stretch or another's (`take`); its first expert's first lines asked
// for.
Span next2(const Plan& p, int tid) {
    Span s;
    if (p.stretch2) {
        // The owner takes half of what is left: each expert's down tiles of a row range are
        // contiguous, and a tile at a time cut the stream at every tile (a tenth slower on one thread).
        if (!take(p.stretch2, p.nthreads, tid, 1, true, *p.steals, s.first, s.end)) return {};
    } else {
        s.first = p.next2->fetch_add(1, std::memory_order_relaxed), s.end = std::min(s.first + 1, p.g.tiles2);
    }
    if (s.first < p.g.tiles2 && p.A > 0) prefetch_start(down_tile(p, 0, s.first));
    return s;
}

// Output row tiles [h0, h1): every active expert's down tiles of these rows, summed in expert
// order into the accumulator, then written out. Returns this thread's next row tiles (`next2`),
// taken at the start of the last expert's last tile.
Span down_rows(const Plan& p, int tid, Span rows) {
    if (rows.empty()) return next2(p, tid);
    const int64_t h0 = rows.first, h1 = rows.end;
    float out[kTokensPerCall * kRows];
    const int64_t hp = p.g.hp();
    Span next = p.A == 0 ? next2(p, tid) : Span{};  // else at the last tile
    for (int64_t t = 0; t < p.T; ++t) std::memset(p.acc + t * hp + h0 * kRows, 0, (h1 - h0) * kRows * 4);
    for (int a = 0; a < p.A; ++a) {
        const int64_t n = p.start[a + 1] - p.start[a];
        const uint32_t* act = down_input(p, a);
        const uint8_t* base = down_tile(p, a, 0);
        for (int64_t ht = h0; ht < h1; ++ht) {
            if (ht == h1 - 1) {
                if (a + 1 < p.A) prefetch_start(down_tile(p, a + 1, h0));
                else next = next2(p, tid);
            }
            for (int64_t c0 = 0; c0 < n; c0 += kTokensPerCall) {
                const int cnt = int(n - c0 < kTokensPerCall ? n - c0 : kTokensPerCall);
                p.fn(base + ht * p.g.tile2, p.g.nb_i, act + token_offset(p, p.a_rows, c0), kernel_ld(p, p.a_rows, n), cnt, out);
                for (int t = 0; t < cnt; ++t) {
                    const int64_t q = p.start[a] + c0 + t;
                    float* dst = p.acc + p.pair_tok[q] * hp + ht * kRows;
                    const float w = p.pair_w[q];
                    for (int r = 0; r < kRows; ++r) dst[r] += w * out[t * kRows + r];
                }
            }
        }
    }
    write_rows(p, h0, h1);
    return next;
}

// The first row tile of this thread's phase-2 stretch, and its end.
int64_t down_begin(const Plan& p, int tid, int nthreads) { return p.static2 * tid / nthreads; }
int64_t down_end(const Plan& p, int tid, int nthreads) { return p.static2 * (tid + 1) / nthreads; }

// Phase 2 for one thread: its stretch of row tiles (whole, or a tile at a time with work
// stealing), then single row tiles while any are left.
void phase2_down(const Plan& p, int tid, int nthreads) {
    Span rows = p.stretch2 ? Span{} : Span{down_begin(p, tid, nthreads), down_end(p, tid, nthreads)};
    do rows = down_rows(p, tid, rows);
    while (!rows.empty());
}

const uint8_t* first_down_tile(const Plan& p, int tid, int nthreads) {
    const int64_t h0 = down_begin(p, tid, nthreads), h1 = down_end(p, tid, nthreads);
    return p.A > 0 && h1 > h0 ? down_tile(p, 0, h0) : nullptr;
}

void moe_job(void* ctx, int tid, int nthreads) {
    const Plan& p = *static_cast<const Plan*>(ctx);
    Profile& prof = state().prof;
    prof.at(tid, 0);
    if (p.split[tid] < p.split[tid + 1]) prefetch_start(gate_up_at(p, p.split[tid]));
    phase0_gather(p, tid, nthreads);
    prof.at(tid, 1);
    state().pool.barrier();
    prof.at(tid, 2);
    if (g_tuning.stall_ns && tid == nthreads - 1) {  // testing only (tandem_debug_stall)
        const timespec ts{g_tuning.stall_ns / 1000000000, g_tuning.stall_ns % 1000000000};
        nanosleep(&ts, nullptr);
    }
    phase1_gate_up(p, tid);
    prof.at(tid, 3);
    if (const uint8_t* next = first_down_tile(p, tid, nthreads)) prefetch_start(next);
    state().pool.barrier();
    if (p.acts == ACTS_INT8) {
        quantize_intermediate(p, tid, nthreads);
        state().pool.barrier();
    }
    prof.at(tid, 4);
    phase2_down(p, tid, nthreads);
    prof.at(tid, 5);
}

// Groups the chunk's pairs by expert and splits the phase-1 tiles over the threads by cost.
// Returns false when the scratch cannot be allocated.
bool route(Plan& p, int nthreads) {
    const tandem_call* c = p.c;
    const int E = c->num_experts;
    const int64_t P = p.T * p.k;
    size_t ints = size_t(E) * 4 + 1 + 2 * P, bytes = ints * 4 + P * 4 + (nthreads + 1) * 8 + 64;
    char* mem = static_cast<char*>(state().routing.get(bytes));
    if (!mem) return false;
    int* count = reinterpret_cast<int*>(mem);  // [E], then the position of each expert
    int* expert = count + E;                   // [A]
    int* start = expert + E;                   // [A + 1]
    int* pos = start + E + 1;                  // [A] next free pair of each active expert
    int* pair_expert = pos + E;                // [P]
    int* pair_tok = pair_expert + P;           // [P]
    float* pair_w = reinterpret_cast<float*>(pair_tok + P);
    int64_t* split = reinterpret_cast<int64_t*>(mem + round_up(int64_t(ints * 4 + P * 4), 8));
    std::memset(count, 0, E * 4);
    const int64_t base = p.t0 * p.k;
    // Expert id -1 skips the pair (its expert is computed elsewhere: a hot-expert cache on the GPU).
    for (int64_t i = 0; i < P; ++i)
        if (const int64_t e = id_at(c, base + i); e >= 0) ++count[e];
    int A = 0;
    start[0] = 0;
    for (int e = 0; e < E; ++e)
        if (count[e] > 0) expert[A] = e, start[A + 1] = start[A] + count[e], count[e] = A++;
    std::memcpy(pos, start, A * 4);
    for (int64_t i = 0; i < P; ++i) {
        const int64_t e = id_at(c, base + i);
        if (e < 0) continue;
        const int a = count[e], q = pos[a]++;
        pair_expert[q] = a, pair_tok[q] = int(i / p.k), pair_w[q] = weight_at(c, base + i);
    }
    // Phase-1 split: tile of expert a costs kTileCostTokens + n_a; of the first (100 - dynamic_pct)%
    // of the cost W, thread i starts at W' * i / N; the tiles after split[N] are claimed in chunks.
    int64_t total = 0;
    for (int a = 0; a < A; ++a) total += p.g.tiles1 * (kTileCostTokens + start[a + 1] - start[a]);
    // (With work stealing all of it is split up front: the stretches balance themselves.)
    const int64_t pct = g_tuning.steal ? 0 : std::clamp<int64_t>(g_tuning.dynamic_pct, 0, 100);
    const int64_t up_front = total * (100 - pct) / 100;
    int64_t cum = 0;
    int a = 0;
    for (int i = 0; i <= nthreads; ++i) {
        const int64_t target = up_front * i / nthreads;
        while (a < A && cum + p.g.tiles1 * (kTileCostTokens + start[a + 1] - start[a]) <= target)
            cum += p.g.tiles1 * (kTileCostTokens + start[a + 1] - start[a]), ++a;
        const int64_t cost = a < A ? kTileCostTokens + start[a + 1] - start[a] : 1;
        split[i] = i == nthreads && pct == 0 ? A * p.g.tiles1 : a * p.g.tiles1 + (target - cum + cost - 1) / cost;
    }
    p.static2 = p.g.tiles2 * (100 - pct) / 100;
    p.A = A, p.expert = expert, p.start = start, p.pair_expert = pair_expert;
    p.pair_tok = pair_tok, p.pair_w = pair_w, p.split = split;
    return true;
}

int run_call(tandem_call* c) {
    State& s = state();
    if (c->fmt < 0 || c->fmt >= FMT_COUNT || c->top_k < 1 || c->rows < 0 || c->x_dtype > DT_BF16 ||
        c->w_dtype > DT_BF16 || (c->ids_dtype != DT_I32 && c->ids_dtype != DT_I64) ||
        (c->act_dtype != ACT_AUTO && c->act_dtype != ACT_INT8) || !(c->swiglu_limit >= 0.0f))  // NaN or negative
        return ST_BAD_ARGS;
    const int64_t T = c->num_tokens ? *c->num_tokens : c->rows;
    if (T < 0 || T > c->rows) return c->bad_value = T, ST_BAD_COUNT;
    for (int64_t i = 0; i < T * c->top_k; ++i) {
        int64_t e = id_at(c, i);
        if (e < -1 || e >= c->num_experts) return c->bad_value = e, ST_BAD_EXPERT;
    }
    Plan p{c, Geometry(c->fmt, c->hidden, c->inter), nullptr, ACTS_F32};  // the rest zero: set below
    if (p.g.expert_bytes != c->expert_bytes) return ST_BAD_ARGS;
    const Kernels* k = s.kernels;
    if (c->act_dtype == ACT_INT8) {
        if (!s.i8[c->fmt]) return ST_BAD_ARGS;  // a weight format the mode does not cover
        p.acts = ACTS_INT8, p.fn = s.i8[c->fmt];
    } else if (k->bf16[c->fmt] && c->x_dtype == DT_BF16) {
        p.acts = ACTS_BF16, p.fn = k->bf16[c->fmt], p.tmajor = k->bf16_token_major[c->fmt];
    } else {
        p.acts = ACTS_F32, p.fn = k->f32[c->fmt];
    }
    p.k = c->top_k;
    p.x_rows = p.acts == ACTS_INT8 ? p.g.nb_h * kQBlockWords : p.acts == ACTS_BF16 ? p.g.hp() / 2 : p.g.hp();
    p.a_rows = p.acts == ACTS_BF16 ? p.g.ip() / 2 : p.g.ip();
    p.q_rows = p.acts == ACTS_INT8 ? p.g.nb_i * kQBlockWords : 0;
    p.tok_words = p.acts == ACTS_INT8 ? kQBlockWords : 1;
    const int nthreads = s.pool.size();
    Profile& prof = s.prof;
    const int64_t call_start = prof.on ? now_ns() : 0;
    for (int64_t t0 = 0; t0 < T; t0 += kChunk) {
        const int64_t pass_start = prof.on ? now_ns() : 0;
        p.t0 = t0, p.T = T - t0 < kChunk ? T - t0 : kChunk;
        const int64_t P = p.T * p.k;
        p.x = static_cast<uint32_t*>(s.x.get(P * p.x_rows * 4));
        p.act = static_cast<uint32_t*>(s.act.get(P * p.a_rows * 4));
        p.act8 = p.acts == ACTS_INT8 ? static_cast<uint32_t*>(s.act8.get(P * p.q_rows * 4)) : nullptr;
        p.acc = static_cast<float*>(s.acc.get(p.T * p.g.hp() * 4));
        if (!p.x || !p.act || (p.acts == ACTS_INT8 && !p.act8) || !p.acc || !route(p, nthreads)) return ST_NO_MEMORY;
        s.next1.store(p.split[nthreads], std::memory_order_relaxed);
        s.next2.store(p.static2, std::memory_order_relaxed);
        p.next1 = &s.next1, p.next2 = &s.next2, p.steals = &s.steals, p.nthreads = nthreads;
        p.stretch1 = p.stretch2 = nullptr;
        if (g_tuning.steal) {  // (the pool's run() publishes these stores to the workers)
            for (int t = 0; t < nthreads; ++t) {
                s.stretch1[t].span.store(pack_span(p.split[t], p.split[t + 1]), std::memory_order_relaxed);
                s.stretch2[t].span.store(pack_span(down_begin(p, t, nthreads), down_end(p, t, nthreads)),
                                         std::memory_order_relaxed);
            }
            p.stretch1 = s.stretch1, p.stretch2 = s.stretch2;
        }
        if (prof.on) prof.run_start = now_ns(), prof.route_ns += prof.run_start - pass_start;
        s.pool.run(moe_job, &p);
        if (prof.on) prof.add_pass(nthreads, now_ns());
    }
    if (prof.on) ++prof.calls, prof.call_ns += now_ns() - call_start;
    return ST_OK;
}

// ---- packing (the layout itself is written in moe_scalar.cpp) -----------------------------------

struct PackJob {
    int fmt, hidden, inter;
    ExpertSources src;
    uint8_t* dst;
};

void pack_job(void* ctx, int tid, int nthreads) {
    const PackJob& j = *static_cast<const PackJob*>(ctx);
    const Geometry g(j.fmt, j.hidden, j.inter);
    const int64_t tiles = g.tiles1 + g.tiles2;
    pack_tiles(j.fmt, j.hidden, j.inter, j.src, tiles * tid / nthreads, tiles * (tid + 1) / nthreads, j.dst);
}

struct ReadJob {
    const uint8_t* buf;
    int64_t n;
    int active;
    uint64_t sink[256];
};

void read_job(void* ctx, int tid, int) {
    ReadJob& j = *static_cast<ReadJob*>(ctx);
    if (tid >= j.active) return;
    const int64_t units = j.n / 4096;  // slices in whole pages
    const int64_t b = units * tid / j.active * 4096, e = units * (tid + 1) / j.active * 4096;
    j.sink[tid % 256] ^= state().kernels->read(j.buf + b, e - b);
}

}  // namespace
}  // namespace tandem

// ---- C API -----------------------------------------------------------------------------------

TANDEM_API int tandem_isa_supported(int isa) { return isa_supported(isa); }

// The default ISA. AMX is not one yet: it is chosen by name (TANDEM_CPU_ISA=amx, set_isa) until it
// has run, and been measured, on a CPU that has it.
TANDEM_API int tandem_best_isa() {
    for (int isa = ISA_AVX512BF16; isa > 0; --isa)
        if (isa_supported(isa)) return isa;
    return ISA_SCALAR;
}

TANDEM_API int tandem_set_isa(int isa) {  // 0 ok, -1 unsupported
    if (isa < 0 || isa >= ISA_COUNT || !isa_supported(isa)) return -1;
    std::lock_guard<std::mutex> lock(state().mutex);
    state().isa = isa, state().kernels = kernels_for(isa), state().i8 = int8_kernels(isa);
    return 0;
}

TANDEM_API int tandem_get_isa() { return state().isa; }

TANDEM_API void tandem_set_threads(int n) {
    std::lock_guard<std::mutex> lock(state().mutex);
    state().pool.resize(n);
}

TANDEM_API int tandem_num_threads() { return state().pool.size(); }

// Debugging knobs of the tile kernels (moe.h Tuning): prefetch distances in bytes, 0 = off,
// negative = keep. Results do not depend on them.
TANDEM_API void tandem_set_prefetch(int64_t l1_bytes, int64_t l2_bytes) {
    std::lock_guard<std::mutex> lock(state().mutex);
    if (l1_bytes >= 0) g_tuning.prefetch_l1 = l1_bytes;
    if (l2_bytes >= 0) g_tuning.prefetch_l2 = l2_bytes;
}

// The prefetch distances in effect (what tandem_set_prefetch, or the environment at load, set).
TANDEM_API void tandem_get_prefetch(int64_t* l1_bytes, int64_t* l2_bytes) {
    std::lock_guard<std::mutex> lock(state().mutex);
    *l1_bytes = g_tuning.prefetch_l1;
    *l2_bytes = g_tuning.prefetch_l2;
}

// Phase timing of the MoE calls (Profile above): on (resets the sums) or off.
TANDEM_API void tandem_set_profile(int on) {
    std::lock_guard<std::mutex> lock(state().mutex);
    state().prof.on = on != 0;
    state().prof.reset();
}

// The sums since the profile was turned on or last read, then reset: out[0] calls, out[1] their
// seconds, out[2] the routing's seconds, then per thread its kProfParts parts' seconds (thread-major).
// Returns the threads written (at most max_threads).
TANDEM_API int tandem_read_profile(double* out, int max_threads) {
    std::lock_guard<std::mutex> lock(state().mutex);
    Profile& prof = state().prof;
    const int n = std::min({state().pool.size(), max_threads, kProfThreads});
    out[0] = double(prof.calls), out[1] = prof.call_ns * 1e-9, out[2] = prof.route_ns * 1e-9;
    for (int t = 0; t < n; ++t)
        for (int p = 0; p < kProfParts; ++p) out[3 + t * kProfParts + p] = prof.sum[t][p] * 1e-9;
    prof.reset();
    return n;
}

// The share of each phase's work (percent, 0-100) that threads claim as they finish instead of
// being handed out up front (moe.h Tuning); negative: keep. Results do not depend on it.
TANDEM_API void tandem_set_balance(int dynamic_pct) {
    std::lock_guard<std::mutex> lock(state().mutex);
    if (dynamic_pct >= 0) g_tuning.dynamic_pct = std::min(dynamic_pct, 100);
}

// Work stealing instead of claimed chunks (moe.h Tuning): 1 on, 0 off, negative: keep. Results do
// not depend on it.
TANDEM_API void tandem_set_steal(int on) {
    std::lock_guard<std::mutex> lock(state().mutex);
    if (on >= 0) g_tuning.steal = on != 0;
}

// Chunks of work a thread took from another's stretch since the last read (work stealing), then 0.
TANDEM_API int64_t tandem_take_steals() { return state().steals.exchange(0); }

// Testing: thread N-1 of each call sleeps this long before its gate/up tiles (0: never), so that
// the others must take its stretch.
TANDEM_API void tandem_debug_stall(int64_t ns) {
    std::lock_guard<std::mutex> lock(state().mutex);
    g_tuning.stall_ns = ns > 0 ? ns : 0;
}

TANDEM_API int64_t tandem_expert_bytes(int fmt, int hidden, int inter) { return Geometry(fmt, hidden, inter).expert_bytes; }

// Packs one expert into dst (expert_bytes). Sources, row-major, as cpu_experts.py quantises them:
//   fp32 float [rows][K]; bf16 uint16 [rows][K]; int8 int8 [rows][K] + aux float [rows];
//   int4 int8 codes -8..7 [rows][Kp] + aux bf16 [rows][Kp/32] (Kp = K rounded up to 32);
//   mxfp4 uint8 [rows][K/2] + aux E8M0 [rows][K/32] (K a multiple of 32).
// gate/up are [I][H], down [H][I].
TANDEM_API void tandem_pack_expert(int fmt, int hidden, int inter, uint8_t* dst, const void* gate, const void* gate_aux,
                                   const void* up, const void* up_aux, const void* down, const void* down_aux) {
    const int64_t kh = fmt == FMT_INT4 ? round_up(hidden, kBlock) : hidden;
    const int64_t ki = fmt == FMT_INT4 ? round_up(inter, kBlock) : inter;
    auto u8 = [](const void* p) { return static_cast<const uint8_t*>(p); };
    PackJob j{fmt, hidden, inter,
              {{u8(gate), u8(gate_aux), inter, kh}, {u8(up), u8(up_aux), inter, kh}, {u8(down), u8(down_aux), hidden, ki}},
              dst};
    std::lock_guard<std::mutex> lock(state().mutex);
    state().pool.run(pack_job, &j);
}

// The expert as the kernels see it: fp32 gate/up [I][H], down [H][I].
TANDEM_API void tandem_unpack_expert(int fmt, int hidden, int inter, const uint8_t* src, float* gate, float* up,
                                     float* down) {
    unpack_expert(fmt, hidden, inter, src, gate, up, down);
}

// Asks for transparent huge pages over [ptr, ptr + n) before its first touch: streaming a
// layer's experts then misses the TLB once per 2 MiB, not per 4 KiB. A hint; 0 if taken.
TANDEM_API int tandem_advise_huge_pages(void* ptr, int64_t n) {
    const uintptr_t huge = uintptr_t(2) << 20, begin = (uintptr_t(ptr) + huge - 1) & ~(huge - 1),
                    end = (uintptr_t(ptr) + uintptr_t(n)) & ~(huge - 1);
    return end > begin ? madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) : -1;
}

TANDEM_API int tandem_moe(tandem_call* c) {
    std::lock_guard<std::mutex> lock(state().mutex);
    c->status = run_call(c);
    return c->status;
}

// cudaHostFn_t: runs on a CUDA driver thread; no CUDA, no Python; errors land in c->status.
TANDEM_API void tandem_host_fn(void* c) { tandem_moe(static_cast<tandem_call*>(c)); }

// Best of `repeats` timed reads of buf[0, n) (n a multiple of 4096, buf 64-aligned) on the
// first `threads` threads of the pool; seconds.
TANDEM_API double tandem_read_seconds(const uint8_t* buf, int64_t n, int threads, int repeats) {
    std::lock_guard<std::mutex> lock(state().mutex);
    const int active = threads < 1 ? 1 : threads > state().pool.size() ? state().pool.size() : threads;
    ReadJob j{buf, n, active, {}};
    // Each repeat reads the buffer as one plain stream per thread and, where the kernels prefetch
    // (AVX-512), again with their software prefetch; the best of all is the roofline. Which is
    // faster depends on the machine: on the H100 box's Xeon the bf16 kernel (prefetching) read its
    // experts at 115-118 GB/s where the plain stream read 100-111; on this workplace's 2-core EPYC
    // (one pool thread) the plain stream is the faster (43 against 39 GB/s).
    const Tuning tuned = g_tuning;
    const bool both = tuned.prefetch_l1 || tuned.prefetch_l2;
    double best = 1e30;
    for (int r = 0; r < repeats; ++r) {
        for (int pass = 0; pass < (both ? 2 : 1); ++pass) {
            if (both) {
                g_tuning.prefetch_l1 = pass ? tuned.prefetch_l1 : 0;
                g_tuning.prefetch_l2 = pass ? tuned.prefetch_l2 : 0;
            }
            int64_t t0 = now_ns();
            state().pool.run(read_job, &j);
            double sec = double(now_ns() - t0) * 1e-9;
            best = sec < best ? sec : best;
        }
    }
    g_tuning.prefetch_l1 = tuned.prefetch_l1;
    g_tuning.prefetch_l2 = tuned.prefetch_l2;
    volatile uint64_t keep = j.sink[0];
    (void)keep;
    return best;
}
