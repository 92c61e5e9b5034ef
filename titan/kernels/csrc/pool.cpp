// The chunk-claiming pool of pool.h. A job is published as a 64-bit ticket (generation << 32 | next
// chunk): a claim is a compare-and-swap on it, so a worker that wakes after its job has ended can never
// claim a chunk of the next job with the old job's body. Idle workers spin for a short while (a decode
// step issues ~150 jobs a few microseconds apart), then sleep on a condition variable.
#include "pool.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

// How long an idle worker spins before it sleeps: ~50 us, as GOMP_SPINCOUNT=3000 for the OpenMP threads
// (titan/__init__.py). TITAN_POOL_SPIN_US overrides it (0: sleep at once, where cores are shared).
int64_t microseconds_from_env(const char* name, int64_t fallback) {
    const char* value = std::getenv(name);
    return value != nullptr ? std::max<int64_t>(0, std::atoll(value)) : fallback;
}

// TITAN_POOL_RACE_PROBE_US (tests only): a worker pauses this long after each claim it finishes, and a job
// pauses twice as long between its fields and its ticket, so that a late worker meets the next job's fields
// under the last job's ticket every time instead of ~2 jobs in a million (tests/test_kernel_pool.py).
const int64_t g_probe_us = microseconds_from_env("TITAN_POOL_RACE_PROBE_US", 0);

// A body that calls parallel_chunks runs that job inline: on the calling thread, set for the job; on a worker,
// always (a worker waiting for the call lock, which the caller holds until its job ends, would never return).
thread_local bool t_in_job = false;

// A ticket's chunk index once its job is over: no count of chunks reaches it, so no claim on it succeeds.
constexpr uint64_t CLOSED = 0xFFFFFFFFu;

class Pool {
  public:
    explicit Pool(int workers) : spin_(std::chrono::microseconds(microseconds_from_env("TITAN_POOL_SPIN_US", 50))) {
        for (int i = 0; i < workers; i++) threads_.emplace_back([this] { work(); });
    }

    ~Pool() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stop_.store(true);
        }
        wake_.notify_all();
        for (std::thread& t : threads_) t.join();
    }

    int workers() const { return (int)threads_.size(); }

    void run(int64_t total, int64_t chunk, const std::function<void(int64_t, int64_t)>& body) {
        const int64_t chunks = (total + chunk - 1) / chunk;
        // Close the last job's ticket before its fields change. A worker that finished that job's last chunk
        // may still be about to claim: it read the ticket, then reads `chunks_`. Without the close it could
        // read this job's count, claim under the old ticket (unchanged until the store below), run this job's
        // body and add to `done_` after the reset: the caller then returned with chunks still being written
        // (a product's last rows unwritten, ~2 jobs in a million on a loaded 2-core machine). Closed, the claim
        // fails.
        const uint64_t last = ticket_.load(std::memory_order_relaxed) >> 32;
        ticket_.store((last << 32) | CLOSED, std::memory_order_seq_cst);
        body_.store(&body, std::memory_order_relaxed);
        total_.store(total, std::memory_order_relaxed);
        chunk_.store(chunk, std::memory_order_relaxed);
        done_.store(0, std::memory_order_relaxed);
        chunks_.store(chunks, std::memory_order_release);  // read with acquire before a claim: then so is the close
        if (g_probe_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(2 * g_probe_us));
        const uint64_t generation = last + 1;
        ticket_.store(generation << 32, std::memory_order_seq_cst);
        if (sleepers_.load(std::memory_order_seq_cst) > 0) {
            std::lock_guard<std::mutex> lock(mutex_);
            wake_.notify_all();
        }
        help(generation);
        while (done_.load(std::memory_order_acquire) < chunks) _mm_pause();  // chunks others are finishing
    }

  private:
    // Claims and runs chunks of `generation` until none is left (or the job is no longer that one). A
    // claim takes 1 / (2 x threads) of what is left (at least one chunk): a thread's first claim is a long
    // contiguous run, which the hardware prefetcher streams (one chunk at a time measured ~25% slower on
    // decode products), and the claims shrink towards the end, where they balance the threads.
    void help(uint64_t generation) {
        const int64_t threads = (int64_t)threads_.size() + 1;
        uint64_t ticket = ticket_.load(std::memory_order_acquire);
        while ((ticket >> 32) == generation) {
            const int64_t index = (int64_t)(ticket & CLOSED), chunks = chunks_.load(std::memory_order_acquire);
            if (index >= chunks) return;
            const int64_t count = std::max<int64_t>(1, (chunks - index) / (2 * threads));
            if (!ticket_.compare_exchange_weak(ticket, ticket + count, std::memory_order_acq_rel)) continue;
            // The claim succeeded for this generation: its job's fields stay put until its chunks are done.
            const int64_t chunk = chunk_.load(std::memory_order_relaxed), begin = index * chunk;
            const int64_t end = std::min(total_.load(std::memory_order_relaxed), (index + count) * chunk);
            (*body_.load(std::memory_order_relaxed))(begin, end);
            done_.fetch_add(count, std::memory_order_release);
            if (g_probe_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(g_probe_us));
            ticket = ticket_.load(std::memory_order_acquire);
        }
    }

    void work() {
        t_in_job = true;
        uint64_t seen = 0;
        for (;;) {
            const auto until = std::chrono::steady_clock::now() + spin_;
            uint64_t generation = ticket_.load(std::memory_order_acquire) >> 32;
            while (generation == seen && !stop_.load(std::memory_order_relaxed) &&
                   std::chrono::steady_clock::now() < until) {
                for (int i = 0; i < 64; i++) _mm_pause();
                generation = ticket_.load(std::memory_order_acquire) >> 32;
            }
            if (generation == seen) {
                std::unique_lock<std::mutex> lock(mutex_);
                sleepers_.fetch_add(1, std::memory_order_seq_cst);
                wake_.wait(lock, [&] { return stop_ || (ticket_.load(std::memory_order_seq_cst) >> 32) != seen; });
                sleepers_.fetch_sub(1, std::memory_order_relaxed);
                if (stop_) return;
                generation = ticket_.load(std::memory_order_acquire) >> 32;
            }
            seen = generation;
            help(generation);
        }
    }

    const std::chrono::microseconds spin_;
    std::vector<std::thread> threads_;
    alignas(64) std::atomic<uint64_t> ticket_{0};  // own cache lines: claims, completions and the
    alignas(64) std::atomic<int64_t> done_{0};     // read-mostly job fields do not invalidate each other
    alignas(64) std::atomic<int> sleepers_{0};
    alignas(64) std::atomic<const std::function<void(int64_t, int64_t)>*> body_{nullptr};
    std::atomic<int64_t> total_{0}, chunk_{1}, chunks_{0};
    std::mutex mutex_;
    std::condition_variable wake_;
    std::atomic<bool> stop_{false};
};

// TITAN_KERNEL_POOL=0: ATen's OpenMP parallel_for instead, for A/B measurements.
const bool g_pool_enabled = [] {
    const char* value = std::getenv("TITAN_KERNEL_POOL");
    return value == nullptr || std::string(value) != "0";
}();

std::mutex g_call_mutex;
// Never destroyed: at process exit a daemon thread (the server's engine thread) may still be inside a job,
// and a pool torn down by static destructors under it would be freed memory. The OS ends its threads.
Pool* g_pool = nullptr;

}  // namespace

void parallel_chunks(int64_t total, int64_t chunk, const std::function<void(int64_t, int64_t)>& body) {
    if (total <= 0) return;
    chunk = std::max<int64_t>(1, chunk);
    const int workers = std::max(0, at::get_num_threads() - 1);
    if (workers == 0 || total <= chunk || t_in_job) return body(0, total);
    if (!g_pool_enabled) return at::parallel_for(0, total, chunk, body);
    std::lock_guard<std::mutex> lock(g_call_mutex);
    t_in_job = true;
    struct Reset {
        ~Reset() { t_in_job = false; }
    } reset;
    if (g_pool == nullptr || g_pool->workers() != workers) {  // --threads changed: no job runs meanwhile
        delete g_pool;
        g_pool = new Pool(workers);
    }
    g_pool->run(total, chunk, body);
}
