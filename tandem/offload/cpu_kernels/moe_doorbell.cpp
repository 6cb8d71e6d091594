// The doorbell: a CPU thread that runs MoE calls when the GPU asks, by polling two flags in pinned
// memory, in place of a CUDA host node (tandem/offload/handoff.py drives the GPU side).
//
//   GPU stream:  copies in -> write request = j + 1 -> wait until done == j + 1 -> write done = 0
//                -> copy out
//   this thread: sees request = j + 1 -> request = 0 -> tandem_moe(job j) -> done = j + 1
//
// The values are the job's index, constant per layer, so the stream operations can be captured in
// a CUDA graph. The GPU clears `done` after its wait and before its next request, and this thread
// writes `done` only after seeing a request, so a stale `done` never satisfies a later wait (the
// same job twice in a row included). A request for an unknown job still gets its `done`, with the
// error kept for Python to raise: the GPU must never wait forever.
//
// Idle, the thread spins for kSpinNs after its last call, then sleeps kNapNs between looks (a
// step's first layer after a pause pays at most one nap).
#include <pthread.h>
#include <sys/prctl.h>
#include <time.h>

#include <atomic>
#include <cstdint>
#include <new>

#define TANDEM_API extern "C" __attribute__((visibility("default")))

struct tandem_call;
extern "C" int tandem_moe(tandem_call* c);

namespace {

constexpr int kMaxJobs = 4096;
constexpr int64_t kSpinNs = 2000000;  // 2 ms: a decode step's layers come well within it
constexpr long kNapNs = 20000;        // 20 us
constexpr int kDoneWord = 16;         // flags[0] request, flags[16] done: separate cache lines

int64_t now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

struct Doorbell {
    int32_t* flags = nullptr;  // pinned, >= 17 int32 words
    std::atomic<tandem_call*> jobs[kMaxJobs] = {};
    std::atomic<int> num_jobs{0};
    std::atomic<bool> stop{false};
    std::atomic<int64_t> served{0};
    std::atomic<int32_t> error{0};     // 0, or the status / bad request of the first failure
    std::atomic<int32_t> error_job{-1};
    pthread_t thread{};
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

int32_t load(const int32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store(int32_t* p, int32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

void* doorbell_main(void* arg) {
    Doorbell* d = static_cast<Doorbell*>(arg);
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // naps of 20 us, not the default slack's 50 more
    int64_t last = now_ns();
    for (int i = 1; !d->stop.load(std::memory_order_acquire); ++i) {
        const int32_t r = load(&d->flags[0]);
        if (r == 0) {
            cpu_relax();
            if ((i & 255) == 0 && now_ns() - last > kSpinNs) {
                timespec nap{0, kNapNs};
                nanosleep(&nap, nullptr);
            }
            continue;
        }
        store(&d->flags[0], 0);
        tandem_call* job = r >= 1 && r <= d->num_jobs.load(std::memory_order_acquire)
                               ? d->jobs[r - 1].load(std::memory_order_acquire) : nullptr;
        const int status = job ? tandem_moe(job) : -1;
        if (status != 0) {
            int32_t none = 0;
            if (d->error.compare_exchange_strong(none, status)) d->error_job.store(r - 1);
        }
        d->served.fetch_add(1, std::memory_order_relaxed);
        store(&d->flags[kDoneWord], r);  // after the output's stores (release)
        last = now_ns();
    }
    return nullptr;
}

}  // namespace

// Starts the thread; null when it could not be created.
TANDEM_API void* tandem_doorbell_open(int32_t* flags) {
    Doorbell* d = new (std::nothrow) Doorbell;
    if (!d) return nullptr;
    d->flags = flags;
    store(&flags[0], 0);
    store(&flags[kDoneWord], 0);
    if (pthread_create(&d->thread, nullptr, doorbell_main, d) != 0) {
        delete d;
        return nullptr;
    }
    return d;
}

// The job's index (the GPU requests index + 1), or -1 when the table is full.
TANDEM_API int tandem_doorbell_add(void* db, tandem_call* job) {
    Doorbell* d = static_cast<Doorbell*>(db);
    const int j = d->num_jobs.load();
    if (j >= kMaxJobs) return -1;
    d->jobs[j].store(job, std::memory_order_release);
    d->num_jobs.store(j + 1, std::memory_order_release);
    return j;
}

TANDEM_API int64_t tandem_doorbell_served(void* db) { return static_cast<Doorbell*>(db)->served.load(); }

// The first failure since open (0: none; -1: a request for an unknown job; else the call's
// status), and its job index via *job.
TANDEM_API int32_t tandem_doorbell_error(void* db, int32_t* job) {
    Doorbell* d = static_cast<Doorbell*>(db);
    *job = d->error_job.load();
    return d->error.load();
}

// Stops and frees it. The GPU must have nothing queued that waits on it.
TANDEM_API void tandem_doorbell_close(void* db) {
    Doorbell* d = static_cast<Doorbell*>(db);
    d->stop.store(true, std::memory_order_release);
    pthread_join(d->thread, nullptr);
    delete d;
}
