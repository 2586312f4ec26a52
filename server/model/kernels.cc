#include "server/model/kernels.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>
#include <vector>

#include "server/model/threads.h"

namespace collabserve::model {
namespace {

// Compiled for AVX-512 whatever the build's -march; only called after PackedLinearSupported().
#define COLLABSERVE_AVX512 __attribute__((target("avx512f,fma")))

constexpr int64_t kPanel = PackedWeight::kPanel;
// Register tile: kMr rows × 32 columns = 16 zmm accumulators, summed over one k block of kc_len
// (a function of K only) before being added to the output, so every output element is summed in
// the same order whatever the number of rows. Rows go in blocks of kMc (a kMc × kc_len block of x
// stays in L2 while a thread walks its panels).
constexpr int kMr = 8;
constexpr int64_t kMc = 512;
constexpr int64_t kKc = 256;

// How far ahead of the micro-kernel the weight stream is prefetched, in k steps of one panel
// (128 bytes each): 32 steps = 4 KiB, enough to cover a DRAM miss at the rate a skinny product
// consumes the weights. The stream is contiguous (see LinearPanels), so the prefetched lines are
// the ones read next.
constexpr int64_t kPrefetchK = 32;

// c[i, 0..31] (i < M, masked to the panel's valid columns) = bias + residual + sum_k a[i, k] · b[k, :].
// a: M rows packed k-major (a[k * kMr + i]); b: one panel (b[k * 32 + j]). prefetch: also prefetch
// the weight stream ahead (only the first row tile of a sweep streams it from memory; the others
// find it in L1).
template <int M>
COLLABSERVE_AVX512 inline void MicroKernel(int64_t kc, const float* a, const float* b, float* c,
                                           int64_t ldc, bool first, const float* bias,
                                           const float* res, int64_t ldr, __mmask16 mk0,
                                           __mmask16 mk1, bool prefetch) {
  // The output (or residual) tile is read after the k loop: ask for it now so that the loads
  // there do not wait on L3.
  const float* base_rows = first ? res : c;
  const int64_t base_ld = first ? ldr : ldc;
  if (base_rows != nullptr) {
#pragma GCC unroll 16
    for (int i = 0; i < M; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(base_rows + i * base_ld), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(base_rows + i * base_ld + 16), _MM_HINT_T0);
    }
  }
  __m512 acc0[M], acc1[M];
#pragma GCC unroll 16
  for (int i = 0; i < M; ++i) {
    acc0[i] = _mm512_setzero_ps();
    acc1[i] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < kc; ++k) {
    if (prefetch) {
      const char* ahead = reinterpret_cast<const char*>(b + (k + kPrefetchK) * kPanel);
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
    }
    const __m512 b0 = _mm512_loadu_ps(b + k * kPanel);
    const __m512 b1 = _mm512_loadu_ps(b + k * kPanel + 16);
#pragma GCC unroll 16
    for (int i = 0; i < M; ++i) {
      const __m512 av = _mm512_set1_ps(a[k * kMr + i]);
      acc0[i] = _mm512_fmadd_ps(av, b0, acc0[i]);
      acc1[i] = _mm512_fmadd_ps(av, b1, acc1[i]);
    }
  }
  __m512 bias0 = _mm512_setzero_ps(), bias1 = _mm512_setzero_ps();
  if (first && bias != nullptr) {
    bias0 = _mm512_maskz_loadu_ps(mk0, bias);
    bias1 = _mm512_maskz_loadu_ps(mk1, bias + 16);
  }
#pragma GCC unroll 16
  for (int i = 0; i < M; ++i) {
    __m512 base0 = bias0, base1 = bias1;
    if (!first) {
      base0 = _mm512_maskz_loadu_ps(mk0, c + i * ldc);
      base1 = _mm512_maskz_loadu_ps(mk1, c + i * ldc + 16);
    } else if (res != nullptr) {
      base0 = _mm512_add_ps(base0, _mm512_maskz_loadu_ps(mk0, res + i * ldr));
      base1 = _mm512_add_ps(base1, _mm512_maskz_loadu_ps(mk1, res + i * ldr + 16));
    }
    _mm512_mask_storeu_ps(c + i * ldc, mk0, _mm512_add_ps(base0, acc0[i]));
    _mm512_mask_storeu_ps(c + i * ldc + 16, mk1, _mm512_add_ps(base1, acc1[i]));
  }
}

using MicroKernelFn = void (*)(int64_t, const float*, const float*, float*, int64_t, bool,
                               const float*, const float*, int64_t, __mmask16, __mmask16, bool);
template <size_t... M>
constexpr std::array<MicroKernelFn, sizeof...(M) + 1> KernelTable(std::index_sequence<M...>) {
  return {nullptr, &MicroKernel<static_cast<int>(M) + 1>...};
}
// kKernels[m]: the kernel for a tile of m rows, 1 <= m <= kMr.
constexpr auto kKernels = KernelTable(std::make_index_sequence<kMr>());

// Up to this many rows, a product is bound by streaming the weights from memory rather than by
// arithmetic: LinearPanels then walks the weights once, in memory order (panel by panel, each
// panel's k blocks in turn), so the stream is contiguous and prefetched ahead.
constexpr int64_t kStreamMaxRows = 64;
// From this many rows on, PackedLinear splits the rows rather than the panels over threads.
constexpr int64_t kRowSplitMinRows = 256;

// Copies rows [r0, r1) of x k-major in tiles of kMr rows: tile t holds rows r0 + t·kMr.. at
// dst[t·K·kMr + k·kMr + i]. Rows of a partial tile beyond r1 are left as they are (never read).
void PackRows(const float* x, int64_t ldx, int64_t r0, int64_t r1, int64_t K, float* dst) {
  for (int64_t r = r0, t = 0; r < r1; r += kMr, ++t) {
    const int64_t m = std::min<int64_t>(kMr, r1 - r);
    float* d = dst + t * K * kMr;
    for (int64_t i = 0; i < m; ++i) {
      const float* src = x + (r + i) * ldx;
      for (int64_t k = 0; k < K; ++k) d[k * kMr + i] = src[k];
    }
  }
}

// The panels [p0, p1) of out (all rows). Per block of kMc rows, x is first copied k-major in tiles
// of kMr rows (the micro-kernel then reads both operands as sequential streams). Every output
// element is summed the same way whatever the number of rows: per k block of kc_len (which depends
// on K only) in registers, the blocks added to the output in k order.
COLLABSERVE_AVX512 void LinearPanels(const float* x, int64_t ldx, int64_t rows,
                                     const PackedWeight& w, const float* bias,
                                     const float* residual, int64_t ldr, float* out, int64_t ldo,
                                     int64_t p0, int64_t p1) {
  const int64_t K = w.k(), N = w.n();
  const int64_t k_blocks = (K + kKc - 1) / kKc;
  const int64_t kc_len = (K + k_blocks - 1) / k_blocks;
  // Grown, never shrunk: resizing down and up again would zero the buffer on every call.
  thread_local std::vector<float> apack;
  const int64_t block_rows = (std::min(rows, kMc) + kMr - 1) / kMr * kMr;
  if (apack.size() < static_cast<size_t>(block_rows * K)) apack.resize(static_cast<size_t>(block_rows * K));
  const bool stream = rows <= kStreamMaxRows;
  for (int64_t m0 = 0; m0 < rows; m0 += kMc) {
    const int64_t m_end = std::min(rows, m0 + kMc);
    PackRows(x, ldx, m0, m_end, K, apack.data());
    // One panel × one k block × every row tile of the block.
    auto sweep = [&](int64_t p, int64_t k0) {
      const int64_t kc = std::min(kc_len, K - k0);
      const float* bp = w.data() + (p * K + k0) * kPanel;
      const int64_t n0 = p * kPanel;
      const int64_t valid = std::min(kPanel, N - n0);
      const __mmask16 mk0 = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
      const __mmask16 mk1 = valid >= 32  ? 0xFFFF
                            : valid > 16 ? static_cast<__mmask16>((1u << (valid - 16)) - 1)
                                         : 0;
      const float* bias_p = bias != nullptr ? bias + n0 : nullptr;
      for (int64_t r = m0, t = 0; r < m_end; r += kMr, ++t) {
        const int m = static_cast<int>(std::min<int64_t>(kMr, m_end - r));
        kKernels[m](kc, apack.data() + (t * K + k0) * kMr, bp, out + r * ldo + n0, ldo, k0 == 0,
                    bias_p, residual != nullptr ? residual + r * ldr + n0 : nullptr, ldr, mk0, mk1,
                    stream && t == 0);
      }
    };
    if (stream) {
      // Weight-bound: the panels in memory order, so the weights stream once, contiguously.
      for (int64_t p = p0; p < p1; ++p) {
        for (int64_t k0 = 0; k0 < K; k0 += kc_len) sweep(p, k0);
      }
    } else {
      // Arithmetic-bound: one k block of x (kMc × kc_len) stays in L2 across all the panels.
      for (int64_t k0 = 0; k0 < K; k0 += kc_len) {
        for (int64_t p = p0; p < p1; ++p) sweep(p, k0);
      }
    }
  }
}

// Lane-wise partial sums (independent lanes, so the compiler vectorises without reordering any
// sum), then the lanes in order: the same result whichever instruction set compiles it.
inline void LayerNormRow(float* row, int64_t d, const float* gamma, const float* beta, float eps) {
  constexpr int kLanes = 16;
  float part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= d; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) part[l] += row[j + l];
  }
  float sum = 0;
  for (int l = 0; l < kLanes; ++l) sum += part[l];
  for (; j < d; ++j) sum += row[j];
  const float mean = sum / static_cast<float>(d);
  float sq[kLanes] = {};
  for (j = 0; j + kLanes <= d; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float t = row[j + l] - mean;
      sq[l] += t * t;
    }
  }
  float var = 0;
  for (int l = 0; l < kLanes; ++l) var += sq[l];
  for (; j < d; ++j) var += (row[j] - mean) * (row[j] - mean);
  var /= static_cast<float>(d);
  const float rstd = 1.0f / std::sqrt(var + eps);
  for (j = 0; j < d; ++j) row[j] = (row[j] - mean) * rstd * gamma[j] + beta[j];
}

COLLABSERVE_AVX512 void LayerNormRowsAvx512(float* x, int64_t ldx, int64_t begin, int64_t end,
                                            int64_t d, const float* gamma, const float* beta,
                                            float eps) {
  for (int64_t r = begin; r < end; ++r) LayerNormRow(x + r * ldx, d, gamma, beta, eps);
}

void LayerNormRowsGeneric(float* x, int64_t ldx, int64_t begin, int64_t end, int64_t d,
                          const float* gamma, const float* beta, float eps) {
  for (int64_t r = begin; r < end; ++r) LayerNormRow(x + r * ldx, d, gamma, beta, eps);
}

}  // namespace

bool PackedLinearSupported() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  }();
  return supported;
}

PackedWeight::PackedWeight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "PackedWeight: want a float32 CPU matrix, got ", w.sizes(), " ", w.scalar_type(),
              " on ", w.device());
  n_ = w.size(0);
  k_ = w.size(1);
  const at::Tensor src = w.contiguous();
  data_ = at::zeros({panels(), k_, kPanel}, w.options());
  const float* s = src.data_ptr<float>();
  float* d = data_.data_ptr<float>();
  for (int64_t p = 0; p < panels(); ++p) {
    const int64_t cols = std::min(kPanel, n_ - p * kPanel);
    for (int64_t j = 0; j < cols; ++j) {
      const float* col = s + (p * kPanel + j) * k_;
      float* dst = d + p * k_ * kPanel + j;
      for (int64_t k = 0; k < k_; ++k) dst[k * kPanel] = col[k];
    }
  }
}

int64_t PanelGrain(const PackedWeight& w, int64_t rows) {
  const int64_t flops_per_panel = 2 * std::max<int64_t>(1, rows) * std::max<int64_t>(1, w.k()) * kPanel;
  return std::max<int64_t>(1, (int64_t{1} << 20) / flops_per_panel);
}

void PackedLinear(const float* x, int64_t ldx, int64_t rows, const PackedWeight& w,
                  const float* bias, const float* residual, int64_t ldr, float* out, int64_t ldo) {
  TORCH_CHECK(PackedLinearSupported(), "PackedLinear needs AVX-512F");
  if (rows <= 0) return;
  if (rows >= kRowSplitMinRows && at::get_num_threads() > 1) {
    // Arithmetic-bound: each thread takes whole row tiles and every panel, so x is copied k-major
    // once (not once per thread) and each thread's output rows stay its own.
    const int64_t tiles = (rows + kMr - 1) / kMr;
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      const int64_t r0 = t0 * kMr, r1 = std::min(rows, t1 * kMr);
      LinearPanels(x + r0 * ldx, ldx, r1 - r0, w, bias,
                   residual != nullptr ? residual + r0 * ldr : nullptr, ldr, out + r0 * ldo, ldo,
                   0, w.panels());
    });
    return;
  }
  // Weight-bound: the threads split the panels, so each streams its own part of the weights.
  at::parallel_for(0, w.panels(), PanelGrain(w, rows), [&](int64_t p0, int64_t p1) {
    LinearPanels(x, ldx, rows, w, bias, residual, ldr, out, ldo, p0, p1);
  });
}

void PackedLinearColumns(const float* x, int64_t ldx, int64_t rows, const PackedWeight& w,
                         const float* bias, const float* residual, int64_t ldr, float* out,
                         int64_t ldo, int64_t n_begin, int64_t n_end) {
  TORCH_CHECK(PackedLinearSupported(), "PackedLinearColumns needs AVX-512F");
  TORCH_CHECK(0 <= n_begin && n_begin <= n_end && n_end <= w.n() &&
                  (n_begin == n_end || (n_begin % kPanel == 0 && (n_end % kPanel == 0 || n_end == w.n()))),
              "PackedLinearColumns: columns [", n_begin, ", ", n_end, ") of ", w.n(),
              " are not whole panels of ", kPanel);
  if (rows <= 0 || n_begin == n_end) return;
  LinearPanels(x, ldx, rows, w, bias, residual, ldr, out, ldo, n_begin / kPanel,
               (n_end + kPanel - 1) / kPanel);
}

void LayerNormRowsInPlace(float* x, int64_t ldx, int64_t rows, int64_t d, const float* gamma,
                          const float* beta, double eps) {
  const float e = static_cast<float>(eps);
  const bool avx512 = PackedLinearSupported();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, d));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    if (avx512) {
      LayerNormRowsAvx512(x, ldx, begin, end, d, gamma, beta, e);
    } else {
      LayerNormRowsGeneric(x, ldx, begin, end, d, gamma, beta, e);
    }
  });
}

namespace {

// Waiting members spin this many pause instructions (a pause is ~40-140 cycles: roughly 0.05-0.2
// ms in all) before they start yielding the CPU (at a barrier) or sleeping (between runs).
constexpr int kSpinBarrier = 2000;
constexpr int kSpinIdle = 4000;

inline void CpuRelax() { _mm_pause(); }

}  // namespace

ThreadTeam& ThreadTeam::Shared() {
  static ThreadTeam* team = new ThreadTeam();  // never destroyed: workers may outlive statics
  return *team;
}

ThreadTeam::~ThreadTeam() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadTeam::WorkerLoop(int member) {
  // This thread's own ATen/OpenMP intra-op count: ops inside a run must not fork teams of their own.
  SetThisThreadIntraOpThreads(1);
  uint64_t seen = 0;
  for (;;) {
    for (int i = 0; generation_.load(std::memory_order_acquire) == seen && i < kSpinIdle; ++i) {
      CpuRelax();
    }
    // The run to join: its generation, job and size read together under mu_ (TryRun publishes
    // them together under mu_). Reading them apart let a worker that woke late for one run take
    // the next run's job under the old generation and run that job twice - its second pass's
    // Barrier arrivals then counted in the run after, and a member waited forever.
    const std::function<void(int, int)>* job = nullptr;
    int n = 0;
    bool inference_mode = false;
    {
      std::unique_lock<std::mutex> l(mu_);
      wake_.wait(l, [&] { return stop_ || generation_.load(std::memory_order_acquire) != seen; });
      if (stop_) return;
      seen = generation_.load(std::memory_order_acquire);
      job = job_;
      n = job_n_.load(std::memory_order_relaxed);
      inference_mode = job_inference_mode_;
    }
    if (member < n) {
      c10::InferenceMode guard(inference_mode);
      try {
        (*job)(member, n);
      } catch (...) {
        // fn itself (outside a Step) failed: record; the other members' Steps still complete.
        std::lock_guard<std::mutex> l(error_mu_);
        if (!error_) error_ = std::current_exception();
        failed_.store(true);
      }
      finished_.fetch_add(1, std::memory_order_acq_rel);
    }
  }
}

bool ThreadTeam::TryRun(int n, const std::function<void(int, int)>& fn) {
  TORCH_CHECK(n >= 1, "ThreadTeam::TryRun: n = ", n);
  std::unique_lock<std::mutex> run(run_mu_, std::try_to_lock);
  if (!run.owns_lock()) return false;
  {
    std::lock_guard<std::mutex> l(mu_);
    while (static_cast<int>(workers_.size()) < n - 1) {
      const int member = static_cast<int>(workers_.size()) + 1;
      workers_.emplace_back([this, member] { WorkerLoop(member); });
    }
    job_ = &fn;
    job_n_.store(n, std::memory_order_relaxed);
    job_inference_mode_ = c10::InferenceMode::is_enabled();
    finished_.store(0);
    arrived_.store(0);
    failed_.store(false);
    error_ = nullptr;
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  // The caller's ops run single-threaded too for the length of the run.
  const int caller_threads = at::get_num_threads();
  SetThisThreadIntraOpThreads(1);
  try {
    fn(0, n);
  } catch (...) {
    std::lock_guard<std::mutex> l(error_mu_);
    if (!error_) error_ = std::current_exception();
    failed_.store(true);
  }
  SetThisThreadIntraOpThreads(caller_threads);
  for (int i = 0; finished_.load(std::memory_order_acquire) < n - 1; ++i) {
    if (i < kSpinBarrier) {
      CpuRelax();
    } else {
      std::this_thread::yield();
    }
  }
  if (error_) std::rethrow_exception(error_);
  return true;
}

void ThreadTeam::Barrier() {
  const int n = job_n_.load(std::memory_order_relaxed);
  if (n <= 1) return;
  const uint64_t g = barrier_generation_.load(std::memory_order_acquire);
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
    arrived_.store(0, std::memory_order_relaxed);
    barrier_generation_.fetch_add(1, std::memory_order_release);
    return;
  }
  for (int i = 0; barrier_generation_.load(std::memory_order_acquire) == g; ++i) {
    if (i < kSpinBarrier) {
      CpuRelax();
    } else {
      std::this_thread::yield();
    }
  }
}

void ThreadTeam::Step(const std::function<void()>& f) {
  if (!failed_.load(std::memory_order_acquire)) {
    try {
      f();
    } catch (...) {
      std::lock_guard<std::mutex> l(error_mu_);
      if (!error_) error_ = std::current_exception();
      failed_.store(true, std::memory_order_release);
    }
  }
  Barrier();
}

}  // namespace collabserve::model
