// A parallel loop that never waits for a thread the OS has not run yet.
//
// NOTE(work-pool): at::parallel_for (OpenMP) gives each thread one fixed
// share of a loop and ends with a barrier, so a loop takes as long as its
// slowest thread.  On a 2-core machine the engine's two threads share the
// cores with the API process (and, in the benchmarks, the load generator):
// whenever one of those runs, one engine thread waits at the barriers of the
// step for the other to get its core back, and under overload the API process
// is busiest just when requests arrive.  At 3x load on a 2-core EPYC, P0 met
// its TTFT target for 64-93% of requests with the engine's two OpenMP threads
// and for 100% with one engine thread and the other core left to the API
// process, a load that was 3x of that engine's own (lower) capacity
// (docs/benchmarks.md, "One engine thread, or two, beside the API process").
// This pool keeps both threads' capacity and does not wait for the one the OS
// took: at one fixed 3x load and a 64-ms target, P0 95-98% of requests per run
// against 83-99% with OpenMP (means 96.7% and 93.5%); idle steps are as fast.
//
// Here a loop is cut into a few chunks per thread that threads claim from a
// shared counter; the calling thread claims chunks too, and waits only for
// chunks another thread has started.  A worker the OS has not scheduled yet
// claims nothing and is not waited for: the caller does its share.  The
// workers run at a lower CPU priority (nice ``SLUICE_POOL_NICE``, default 19),
// so the API process takes a worker's core, not the caller's, when it needs
// one; when nothing else runs they run like any thread.  Each chunk is a
// contiguous range of the loop computed by one thread, as before, so results
// do not depend on which thread ran which chunk (the kernels' reductions are
// never split across threads: NOTE(parallel) in qgemm.cpp).
//
// NOTE(pool-waits): what the pool does not avoid: a worker the OS takes off
// its core while it runs a chunk (the API process or a client waking up on
// that core: the worker runs at nice 19) holds that chunk until it runs
// again, and the caller, done with every other chunk, spins at the loop's end
// until then: for those moments neither engine thread makes progress.  The
// pool counts the callers' waits after their last chunk, and the waits of
// kStallNs or more (``pool_waits()``; the engine exports them:
// ``sluice_engine_pool_wait_seconds_total``, ``sluice_engine_pool_stalls_total``,
// ``sluice_engine_pool_stall_seconds_total``).
// On a 2-core Sapphire Rapids the waits were ~5% of the engine's time
// in-process with nothing else running (the last chunks' imbalance), and
// 11-14% behind the HTTP server under load, of which stalls 9-11% (~80 a
// second at 3x capacity; docs/benchmarks.md, "The work pool's waits").  A caller
// that slept on a condition variable after 50 us of waiting, instead of
// spinning, waited less (9-10%) but served no more.  Only a chunk another
// thread could take over mid-way would end such a stall.
//
// The three extension modules (quant, attention, lora) share one pool: the
// static in ``WorkPool::get`` is an inline function's, which GCC binds once per
// process across shared objects (checked: one module's set_pool_threads is
// what the others report); a pool per module would be correct too.  Idle
// workers spin ``kSpinIters`` pauses and then sleep.  A loop entered while the
// pool is busy (another thread, or a loop nested in a chunk) runs on the
// calling thread alone.
#pragma once

#include <ATen/Parallel.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <exception>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SLUICE_PAUSE() _mm_pause()
#else
#define SLUICE_PAUSE() ((void)0)
#endif

namespace sluice {

class WorkPool {
 public:
  using Call = void (*)(const void* ctx, int64_t begin, int64_t end);

  static WorkPool& get() {
    static WorkPool pool;  // joined at exit
    return pool;
  }

  // Threads a loop may use (the caller and threads - 1 workers; 1: loops run on the caller); 0: the pool is
  // off and parallel_for is at::parallel_for.
  void set_threads(int threads) {
    threads = std::max(0, threads);
    bool idle = false;
    while (!busy_.compare_exchange_weak(idle, true)) idle = false;  // a loop of another thread: wait for its end
    resize(std::max(1, threads) - 1);
    threads_.store(threads);
    busy_.store(false);
  }
  int threads() const { return threads_.load(); }

  // NOTE(lane-lend): at most this many of the threads run a loop (0: all of them); the workers stay,
  // so an engine that lends a core to another engine process and takes it back costs no thread start.
  void set_active(int active) { active_.store(std::max(0, active)); }
  int active() const { return active_.load(); }

  // Run call(ctx, b, e) over [begin, end) in chunks of at least ``grain``.
  void run(int64_t begin, int64_t end, int64_t grain, Call call, const void* ctx) {
    const int64_t range = end - begin;
    if (range <= 0) return;
    const int all = threads_.load(std::memory_order_relaxed), active = active_.load(std::memory_order_relaxed);
    const int threads = active > 0 ? std::min(all, active) : all;
    grain = std::max<int64_t>(1, grain);
    int64_t chunks = std::min<int64_t>((range + grain - 1) / grain, (int64_t)threads * kChunksPerThread);
    bool idle = false;
    if (threads <= 1 || chunks <= 1 || !busy_.compare_exchange_strong(idle, true)) {
      call(ctx, begin, end);
      return;
    }
    if ((int)workers_.size() != all - 1) resize(all - 1);  // after a fork: the child has none yet
    const int64_t size = (range + chunks - 1) / chunks;
    chunks = (range + size - 1) / size;
    const uint64_t gen = (last_gen_ + 1) & kGenMask;
    last_gen_ = gen;
    call_.store(call, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    begin_.store(begin, std::memory_order_relaxed);
    end_.store(end, std::memory_order_relaxed);
    size_.store(size, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    next_.store(pack(gen, chunks, 0), std::memory_order_release);
    gen_.store(gen);  // seq_cst: ordered before the read of sleepers_ below (the workers do the converse)
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    work(gen);
    if (done_.load(std::memory_order_acquire) < chunks) wait_for(chunks);
    std::exception_ptr err;
    if (failed_.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> lock(mu_);
      std::swap(err, error_);
      failed_.store(false);
    }
    busy_.store(false, std::memory_order_release);
    if (err) std::rethrow_exception(err);
  }

  ~WorkPool() { resize(0); }

  // NOTE(pool-waits): what the calling threads waited, after their last chunk, for chunks other
  // threads had started: the waits, their seconds, and those of the waits of kStallNs or more.
  struct Waits {
    int64_t waits, wait_ns, stalls, stall_ns;
  };
  Waits waits() const {
    return {waits_.load(std::memory_order_relaxed), wait_ns_.load(std::memory_order_relaxed),
            stalls_.load(std::memory_order_relaxed), stall_ns_.load(std::memory_order_relaxed)};
  }

 private:
  static constexpr int64_t kChunksPerThread = 4;
  static constexpr int kSpinIters = 4000;  // ~30-100 us of pause before a worker sleeps
  static constexpr int64_t kStallNs = 500000;  // a wait this long is a stall (NOTE(pool-waits))

  // Spin until every chunk is done, and count the wait (NOTE(pool-waits)).  Only the thread that
  // holds busy_ runs a loop, so the counters have one writer; readers load them relaxed.
  void wait_for(int64_t chunks) {
    const auto t0 = std::chrono::steady_clock::now();
    while (done_.load(std::memory_order_acquire) < chunks) SLUICE_PAUSE();
    const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    waits_.store(waits_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    wait_ns_.store(wait_ns_.load(std::memory_order_relaxed) + ns, std::memory_order_relaxed);
    if (ns >= kStallNs) {
      stalls_.store(stalls_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      stall_ns_.store(stall_ns_.load(std::memory_order_relaxed) + ns, std::memory_order_relaxed);
    }
  }

  static constexpr uint64_t kGenMask = (1ull << 24) - 1;
  // next_: generation (24 bits) | chunks of the loop (20) | next chunk to claim (20)
  static uint64_t pack(uint64_t gen, int64_t chunks, int64_t i) {
    return (gen << 40) | ((uint64_t)chunks << 20) | (uint64_t)i;
  }

  WorkPool() {
    pthread_atfork(nullptr, nullptr, [] { get().after_fork(); });
    const char* nice = std::getenv("SLUICE_POOL_NICE");
    nice_ = nice && *nice ? std::atoi(nice) : 19;
  }

  // A forked child has none of the workers (nor maybe the mutex, if a worker held it): start afresh. The old
  // std::thread objects are leaked, not destroyed (they name threads of the parent).
  void after_fork() {
    new (&workers_) std::vector<std::thread>();
    new (&mu_) std::mutex();
    new (&cv_) std::condition_variable();
    sleepers_.store(0);
    busy_.store(false);
    stop_.store(false);
  }

  // Claim and run chunks of loop ``gen`` until none is left (or a later loop began).
  void work(uint64_t gen) {
    const Call call = call_.load(std::memory_order_relaxed);
    const void* ctx = ctx_.load(std::memory_order_relaxed);
    const int64_t begin = begin_.load(std::memory_order_relaxed), end = end_.load(std::memory_order_relaxed);
    const int64_t size = size_.load(std::memory_order_relaxed);
    uint64_t v = next_.load(std::memory_order_acquire);
    for (;;) {
      // the counter names its loop: a stale reader's claim fails, and so never takes a chunk of a later loop;
      // a successful claim proves its loop unfinished, so the fields read above were that loop's
      const int64_t chunks = (int64_t)((v >> 20) & 0xfffff), i = (int64_t)(v & 0xfffff);
      if ((v >> 40) != gen || i >= chunks) return;
      if (!next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      const int64_t b = begin + i * size;
      try {
        call(ctx, b, std::min(end, b + size));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
        failed_.store(true, std::memory_order_release);
      }
      done_.fetch_add(1, std::memory_order_acq_rel);
      v = next_.load(std::memory_order_acquire);
    }
  }

  void worker_main() {
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), nice_);  // NOTE(work-pool): yield the core first
    uint64_t seen = gen_.load();
    for (;;) {
      uint64_t gen;
      int spins = 0;
      while ((gen = gen_.load()) == seen && !stop_.load()) {
        if (++spins < kSpinIters) {
          SLUICE_PAUSE();
          continue;
        }
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1);  // seq_cst: before the predicate's read of gen_
        cv_.wait(lock, [&] { return gen_.load() != seen || stop_.load(); });
        sleepers_.fetch_sub(1);
      }
      if (stop_.load()) return;
      seen = gen;
      work(gen);
    }
  }

  void resize(int workers) {
    if ((int)workers_.size() == workers) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true);
      cv_.notify_all();
    }
    for (auto& t : workers_) t.join();
    workers_.clear();
    stop_.store(false);
    for (int k = 0; k < workers; ++k) workers_.emplace_back([this] { worker_main(); });
  }

  std::atomic<int> threads_{0};  // off until set_threads
  std::atomic<int> active_{0};  // NOTE(lane-lend): 0, all threads_
  int nice_ = 19;
  std::atomic<bool> busy_{false}, stop_{false}, failed_{false};
  std::atomic<uint64_t> gen_{0}, next_{0};
  uint64_t last_gen_ = 0;
  std::atomic<Call> call_{nullptr};
  std::atomic<const void*> ctx_{nullptr};
  std::atomic<int64_t> begin_{0}, end_{0}, size_{1}, done_{0};
  std::atomic<int64_t> waits_{0}, wait_ns_{0}, stalls_{0}, stall_ns_{0};  // NOTE(pool-waits)
  std::atomic<int> sleepers_{0};
  std::exception_ptr error_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> workers_;
};

// at::parallel_for's signature: on the WorkPool once the engine turned it on (set_pool_threads), on
// at::parallel_for (torch's OpenMP threads) until then.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (WorkPool::get().threads() == 0) return at::parallel_for(begin, end, grain, f);
  WorkPool::get().run(
      begin, end, grain,
      [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); }, &f);
}

}  // namespace sluice

// The pool's Python bindings, for each extension module's PYBIND11_MODULE (which has torch/extension.h).
//   set_pool_threads(n)   threads a loop may use, the caller included (the engine sets it: NOTE(work-pool))
//   pool_threads()        ... as set
//   set_pool_active(n)    at most n of them run a loop, 0: all (NOTE(lane-lend)); pool_active() as set
//   pool_waits()          -> (waits, seconds, stalls, seconds) since start (NOTE(pool-waits))
//   pool_probe(n, grain, fail_at, nested, hold_us) -> (visits per index, threads that ran chunks): a loop over
//                         [0, n) that counts; the chunk holding fail_at throws; nested: each chunk runs a loop too;
//                         hold_us: a chunk another thread than the caller runs first sleeps this long
#define SLUICE_BIND_WORK_POOL(m)                                                                              \
  m.def("set_pool_threads", [](int64_t n) { sluice::WorkPool::get().set_threads((int)n); },                  \
        "threads a parallel loop of this module may use, the caller included (NOTE(work-pool))");           \
  m.def("pool_threads", [] { return (int64_t)sluice::WorkPool::get().threads(); });                         \
  m.def("set_pool_active", [](int64_t n) { sluice::WorkPool::get().set_active((int)n); },                    \
        "at most n of the threads run a loop, 0: all (NOTE(lane-lend))");                                  \
  m.def("pool_active", [] { return (int64_t)sluice::WorkPool::get().active(); });                           \
  m.def("pool_waits", [] {                                                                                   \
    const auto w = sluice::WorkPool::get().waits();                                                          \
    return std::make_tuple(w.waits, w.wait_ns * 1e-9, w.stalls, w.stall_ns * 1e-9);                          \
  }, "(waits, seconds, stalls, seconds): the callers' waits for chunks other threads held (NOTE(pool-waits))"); \
  m.def("pool_probe", [](int64_t n, int64_t grain, int64_t fail_at, bool nested, int64_t hold_us) {         \
    auto visits = torch::zeros({n}, torch::kInt32);                                                          \
    int32_t* v = visits.data_ptr<int32_t>();                                                                 \
    std::mutex mu;                                                                                           \
    std::vector<std::thread::id> ids;                                                                        \
    const auto caller = std::this_thread::get_id();                                                          \
    sluice::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {                                            \
      if (hold_us > 0 && std::this_thread::get_id() != caller)                                               \
        std::this_thread::sleep_for(std::chrono::microseconds(hold_us));                                     \
      {                                                                                                      \
        std::lock_guard<std::mutex> lock(mu);                                                                \
        if (std::find(ids.begin(), ids.end(), std::this_thread::get_id()) == ids.end())                     \
          ids.push_back(std::this_thread::get_id());                                                         \
      }                                                                                                      \
      for (int64_t i = b; i < e; ++i) {                                                                      \
        if (i == fail_at) throw std::runtime_error("pool_probe: failing at " + std::to_string(i));           \
        if (nested) {                                                                                        \
          std::atomic<int64_t> inner{0};                                                                     \
          sluice::parallel_for(0, 64, 1, [&](int64_t ib, int64_t ie) { inner += ie - ib; });                \
          if (inner.load() != 64) throw std::runtime_error("pool_probe: a nested loop missed indices");      \
        }                                                                                                    \
        __atomic_fetch_add(&v[i], 1, __ATOMIC_RELAXED);                                                      \
      }                                                                                                      \
    });                                                                                                      \
    return std::make_tuple(visits, (int64_t)ids.size());                                                    \
  }, "a counting loop over [0, n) on the pool (tests)", pybind11::arg("n"), pybind11::arg("grain") = 1,     \
        pybind11::arg("fail_at") = -1, pybind11::arg("nested") = false, pybind11::arg("hold_us") = 0)
