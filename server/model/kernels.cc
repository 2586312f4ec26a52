#include "server/model/kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace collabserve::model {
namespace {

// Compiled for AVX-512 whatever the build's -march; only called after PackedLinearSupported().
#define COLLABSERVE_AVX512 __attribute__((target("avx512f,fma")))

constexpr int64_t kPanel = PackedWeight::kPanel;
// Register tile: kMr rows × 32 columns = 16 zmm accumulators, summed over the whole K before
// the tile is written (so every output element is summed in the same order, whatever the number
// of rows). Rows go in blocks of kMc (kMc × K of x stays in L2 while a thread walks its panels).
constexpr int kMr = 8;
constexpr int64_t kMc = 512;
constexpr int64_t kKc = 256;

// c[i, 0..31] (i < M, masked to the panel's valid columns) = bias + residual + sum_k a[i, k] · b[k, :].
// a: M rows packed k-major (a[k * kMr + i]); b: one panel (b[k * 32 + j]).
template <int M>
COLLABSERVE_AVX512 inline void MicroKernel(int64_t kc, const float* a, const float* b, float* c,
                                           int64_t ldc, bool first, const float* bias,
                                           const float* res, int64_t ldr, __mmask16 mk0,
                                           __mmask16 mk1) {
  __m512 acc0[M], acc1[M];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) {
    acc0[i] = _mm512_setzero_ps();
    acc1[i] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_loadu_ps(b + k * kPanel);
    const __m512 b1 = _mm512_loadu_ps(b + k * kPanel + 16);
#pragma GCC unroll 8
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
#pragma GCC unroll 8
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
                               const float*, const float*, int64_t, __mmask16, __mmask16);
constexpr MicroKernelFn kKernels[kMr + 1] = {nullptr,        MicroKernel<1>, MicroKernel<2>,
                                             MicroKernel<3>, MicroKernel<4>, MicroKernel<5>,
                                             MicroKernel<6>, MicroKernel<7>, MicroKernel<8>};

// The panels [p0, p1) of out (all rows). Per block of kMc rows, x is first copied k-major in tiles
// of kMr rows (the micro-kernel then reads both operands as sequential streams); each panel is
// then swept over the block with the whole K in registers, so every output is written once.
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
  for (int64_t m0 = 0; m0 < rows; m0 += kMc) {
    const int64_t m_end = std::min(rows, m0 + kMc);
    for (int64_t r = m0, t = 0; r < m_end; r += kMr, ++t) {
      const int64_t m = std::min<int64_t>(kMr, m_end - r);
      float* dst = apack.data() + t * K * kMr;
      for (int64_t i = 0; i < m; ++i) {
        const float* src = x + (r + i) * ldx;
        for (int64_t k = 0; k < K; ++k) dst[k * kMr + i] = src[k];
      }
    }
    for (int64_t k0 = 0; k0 < K; k0 += kc_len) {
      const int64_t kc = std::min(kc_len, K - k0);
      for (int64_t p = p0; p < p1; ++p) {
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
                      bias_p, residual != nullptr ? residual + r * ldr + n0 : nullptr, ldr, mk0,
                      mk1);
        }
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

void PackedLinear(const float* x, int64_t ldx, int64_t rows, const PackedWeight& w,
                  const float* bias, const float* residual, int64_t ldr, float* out, int64_t ldo) {
  TORCH_CHECK(PackedLinearSupported(), "PackedLinear needs AVX-512F");
  if (rows <= 0) return;
  // At least ~1 MFLOP per task: a thread wake-up costs more than a smaller share of the work.
  const int64_t flops_per_panel = 2 * rows * w.k() * kPanel;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, flops_per_panel));
  at::parallel_for(0, w.panels(), grain, [&](int64_t p0, int64_t p1) {
    LinearPanels(x, ldx, rows, w, bias, residual, ldr, out, ldo, p0, p1);
  });
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

}  // namespace collabserve::model
