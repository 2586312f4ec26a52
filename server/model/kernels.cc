#include "server/model/kernels.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <immintrin.h>
#include <sanitizer/asan_interface.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "server/model/threads.h"
#include "server/util/process_memory.h"

// GCC 12's AVX-512 headers build many intrinsics (max, extract, scalef, ...) on
// _mm512_undefined_ps(), which -Wmaybe-uninitialized reports at every use (GCC PR 105593, fixed
// in GCC 13).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

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
// Query rows per block of PanelAttentionAvx512 (a multiple of kMr).
constexpr int64_t kAttentionBlock = 64;

// How far ahead of the micro-kernel the weight stream is prefetched, in k steps of one panel
// (128 bytes each): 32 steps = 4 KiB, enough to cover a DRAM miss at the rate a skinny product
// consumes the weights. The stream is contiguous (see LinearPanels), so the prefetched lines are
// the ones read next.
constexpr int64_t kPrefetchK = 32;
// In a weight-bound product (kStreamMaxRows) the first row tile also asks for the stream this many
// k steps ahead into L2 (256 steps = 32 KiB): one tile's 16 FMAs per 128 bytes of weights cannot
// hide a DRAM miss with the L1 distance alone, and the core then alternates between waiting for
// memory and computing. Alternated A/B, 4 rounds: 1 × 16 +12% (39.4 -> 44.3 seq/s); at 128 rows
// (not streamed) it cost ~2% and is not used.
constexpr int64_t kPrefetchFarK = 256;

// c[i, 0..31] (i < M, masked to the panel's valid columns) = bias + residual + sum_k a[i, k] · b[k, :].
// a: M rows packed k-major (a[k * kMr + i]); b: one panel (b[k * 32 + j]). prefetch: 0 none; 1
// the weight stream kPrefetchK ahead into L1 (only the first row tile of a sweep streams it from
// memory; the others find it in L1); 2 also kPrefetchFarK ahead into L2 (a weight-bound sweep,
// whose stream is contiguous in memory past this k block).
template <int M>
COLLABSERVE_AVX512 inline void MicroKernel(int64_t kc, const float* a, const float* b, float* c,
                                           int64_t ldc, bool first, const float* bias,
                                           const float* res, int64_t ldr, __mmask16 mk0,
                                           __mmask16 mk1, int prefetch) {
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
    if (prefetch > 0) {
      const char* ahead = reinterpret_cast<const char*>(b + (k + kPrefetchK) * kPanel);
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
      if (prefetch > 1) {
        const char* far = reinterpret_cast<const char*>(b + (k + kPrefetchFarK) * kPanel);
        _mm_prefetch(far, _MM_HINT_T1);
        _mm_prefetch(far + 64, _MM_HINT_T1);
      }
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

// The first `left` of 16 lanes (all of them from 16 on, none at 0 or below).
inline __mmask16 LaneMask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
}

// The masks of the valid columns of a 32-wide panel with `valid` of them.
inline std::pair<__mmask16, __mmask16> PanelMasks(int64_t valid) {
  return {LaneMask(valid), LaneMask(valid - 16)};
}

using MicroKernelFn = void (*)(int64_t, const float*, const float*, float*, int64_t, bool,
                               const float*, const float*, int64_t, __mmask16, __mmask16, int);
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

static_assert(kMr == kPackedRowTile, "the packed-rows layout is the micro-kernel's");

// The packed-rows layout (kernels.h) with tiles of TW rows: rows [r0, r1) × columns [k0, k1) of x
// into dst (K columns); row r, column k at dst[(r / TW) · K · TW + k · TW + r % TW]. TW = kMr: the
// micro-kernel's rows; TW = kPanel: keys in panels (PackKeys).
template <int64_t TW>
void PackRowsScalar(const float* x, int64_t ldx, int64_t r0, int64_t r1, int64_t k0, int64_t k1,
                    int64_t K, float* dst) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* src = x + r * ldx;
    float* d = dst + (r / TW) * K * TW + r % TW;
    for (int64_t k = k0; k < k1; ++k) d[k * TW] = src[k];
  }
}

// The same; whole groups of 8 rows go through 8 × 8 transposes in ymm registers (one load per
// row, eight 32-byte stores), the rest element by element.
template <int64_t TW>
COLLABSERVE_AVX512 void PackRowsAvx512(const float* x, int64_t ldx, int64_t r0, int64_t r1,
                                       int64_t k0, int64_t k1, int64_t K, float* dst) {
  static_assert(TW % 8 == 0, "groups of 8 rows");
  int64_t r = r0;
  if (r % 8 != 0) {
    const int64_t head = std::min(r1, (r / 8 + 1) * 8);
    PackRowsScalar<TW>(x, ldx, r, head, k0, k1, K, dst);
    r = head;
  }
  for (; r + 8 <= r1; r += 8) {
    const float* s = x + r * ldx;
    float* d = dst + (r / TW) * K * TW + r % TW;
    int64_t k = k0;
    for (; k + 8 <= k1; k += 8) {
      const __m256 a0 = _mm256_loadu_ps(s + k), a1 = _mm256_loadu_ps(s + ldx + k);
      const __m256 a2 = _mm256_loadu_ps(s + 2 * ldx + k), a3 = _mm256_loadu_ps(s + 3 * ldx + k);
      const __m256 a4 = _mm256_loadu_ps(s + 4 * ldx + k), a5 = _mm256_loadu_ps(s + 5 * ldx + k);
      const __m256 a6 = _mm256_loadu_ps(s + 6 * ldx + k), a7 = _mm256_loadu_ps(s + 7 * ldx + k);
      const __m256 t0 = _mm256_unpacklo_ps(a0, a1), t1 = _mm256_unpackhi_ps(a0, a1);
      const __m256 t2 = _mm256_unpacklo_ps(a2, a3), t3 = _mm256_unpackhi_ps(a2, a3);
      const __m256 t4 = _mm256_unpacklo_ps(a4, a5), t5 = _mm256_unpackhi_ps(a4, a5);
      const __m256 t6 = _mm256_unpacklo_ps(a6, a7), t7 = _mm256_unpackhi_ps(a6, a7);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
      float* o = d + k * TW;
      _mm256_storeu_ps(o + 0 * TW, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(o + 1 * TW, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(o + 2 * TW, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(o + 3 * TW, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(o + 4 * TW, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(o + 5 * TW, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(o + 6 * TW, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(o + 7 * TW, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
    if (k < k1) PackRowsScalar<TW>(x, ldx, r, r + 8, k, k1, K, dst);
  }
  if (r < r1) PackRowsScalar<TW>(x, ldx, r, r1, k0, k1, K, dst);
}

// Rows [m0, m_end) (at most kMc of them, m0 a multiple of kMr) × the panels [p0, p1) of out, with
// those rows already packed at `a` (its tile 0 holds row m0). Every output element is summed the
// same way whatever the number of rows: per k block of kc_len (which depends on K only) in
// registers, the blocks added to the output in k order. stream: walk the weights in memory order
// (weight-bound products, see kStreamMaxRows); it changes the order of the tiles, not of any sum.
COLLABSERVE_AVX512 void PanelsOnPacked(const float* a, int64_t m0, int64_t m_end,
                                       const PackedWeight& w, const float* bias,
                                       const float* residual, int64_t ldr, float* out,
                                       int64_t ldo, int64_t p0, int64_t p1, bool stream) {
  const int64_t K = w.k(), N = w.n();
  const int64_t k_blocks = (K + kKc - 1) / kKc;
  const int64_t kc_len = (K + k_blocks - 1) / k_blocks;
  // One panel × one k block × every row tile of the block.
  auto sweep = [&](int64_t p, int64_t k0) {
    const int64_t kc = std::min(kc_len, K - k0);
    const float* bp = w.data() + (p * K + k0) * kPanel;
    const int64_t n0 = p * kPanel;
    const int64_t valid = std::min(kPanel, N - n0);
    const auto [mk0, mk1] = PanelMasks(valid);
    const float* bias_p = bias != nullptr ? bias + n0 : nullptr;
    // The first row tile brings the weight block in (prefetched ahead, in both orders: at 128
    // rows, 9 alternated runs each, 8 × 16 went 86.7 -> 88.3 seq/s and 1 × 128 10.5 -> 10.6 with
    // it); the others find it in L1.
    for (int64_t r = m0, t = 0; r < m_end; r += kMr, ++t) {
      const int m = static_cast<int>(std::min<int64_t>(kMr, m_end - r));
      kKernels[m](kc, a + (t * K + k0) * kMr, bp, out + r * ldo + n0, ldo, k0 == 0, bias_p,
                  residual != nullptr ? residual + r * ldr + n0 : nullptr, ldr, mk0, mk1,
                  t == 0 ? (stream ? 2 : 1) : 0);
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

// The panels [p0, p1) of out (all rows). Per block of kMc rows, x is first copied k-major in tiles
// of kMr rows (the micro-kernel then reads both operands as sequential streams).
COLLABSERVE_AVX512 void LinearPanels(const float* x, int64_t ldx, int64_t rows,
                                     const PackedWeight& w, const float* bias,
                                     const float* residual, int64_t ldr, float* out, int64_t ldo,
                                     int64_t p0, int64_t p1) {
  const int64_t K = w.k();
  // Grown, never shrunk: resizing down and up again would zero the buffer on every call.
  thread_local std::vector<float> apack;
  const int64_t block_rows = (std::min(rows, kMc) + kMr - 1) / kMr * kMr;
  if (apack.size() < static_cast<size_t>(block_rows * K)) apack.resize(static_cast<size_t>(block_rows * K));
  const bool stream = rows <= kStreamMaxRows;
  for (int64_t m0 = 0; m0 < rows; m0 += kMc) {
    const int64_t m_end = std::min(rows, m0 + kMc);
    PackRowsAvx512<kMr>(x + m0 * ldx, ldx, 0, m_end - m0, 0, K, K, apack.data());
    PanelsOnPacked(apack.data(), m0, m_end, w, bias, residual, ldr, out, ldo, p0, p1, stream);
  }
}

// exp(x) lane-wise (Cephes' single-precision polynomial on x - n·ln 2, scaled by 2^n with
// vscalefps; about 1 ulp). Inputs below -104 give 0, as expf does.
COLLABSERVE_AVX512 inline __m512 Exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// 0.5 · x · (1 + erf(x / sqrt 2)) lane-wise, erf as ATen's Vectorized<float>::erf computes it.
COLLABSERVE_AVX512 inline __m512 Gelu512(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 u = _mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f));
  // (Sign bits with integer ops: the float and/xor need AVX-512DQ.)
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(u), _mm512_set1_epi32(INT32_MIN));
  const __m512 a = _mm512_abs_ps(u);
  const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), a, one));
  __m512 r = _mm512_fmadd_ps(_mm512_set1_ps(1.061405429f), t, _mm512_set1_ps(-1.453152027f));
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(1.421413741f));
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(-0.284496736f));
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(0.254829592f));
  const __m512 e = Exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(u, u)));
  // erf(|u|) = 1 - r · t · exp(-u²), the sign of u put back.
  const __m512 erf = _mm512_castsi512_ps(_mm512_xor_si512(
      sign, _mm512_castps_si512(_mm512_fnmadd_ps(_mm512_mul_ps(e, t), r, one))));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_add_ps(erf, one), x), _mm512_set1_ps(0.5f));
}

COLLABSERVE_AVX512 void GeluRowsAvx512(float* x, int64_t ldx, int64_t rows, int64_t c0,
                                       int64_t c1) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * ldx;
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16) _mm512_storeu_ps(row + c, Gelu512(_mm512_loadu_ps(row + c)));
    if (c < c1) {
      const __mmask16 m = LaneMask(c1 - c);
      _mm512_mask_storeu_ps(row + c, m, Gelu512(_mm512_maskz_loadu_ps(m, row + c)));
    }
  }
}

// Horizontal sum / max of 16 lanes (by halves; GCC 12's _mm512_reduce_* warn of uninitialised
// temporaries).
COLLABSERVE_AVX512 inline __m128 Halve512(__m512 v, bool max) {
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 a = max ? _mm256_max_ps(lo, hi) : _mm256_add_ps(lo, hi);
  const __m128 l = _mm256_castps256_ps128(a), h = _mm256_extractf128_ps(a, 1);
  return max ? _mm_max_ps(l, h) : _mm_add_ps(l, h);
}
COLLABSERVE_AVX512 inline float HorizontalSum(__m512 v) {
  __m128 x = Halve512(v, false);
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
COLLABSERVE_AVX512 inline float HorizontalMax(__m512 v) {
  __m128 x = Halve512(v, true);
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// Attention in registers for NT tiles of 16 keys (S <= 16·NT) and blocks of MR query rows (NT·MR =
// 16 score accumulators, or 8 for NT = 1). q: the queries, factors and scale applied; keys: packed
// (PackKeys: tile j is half j % 2 of panel j / 2); mask: the S additive terms, or null.
template <int NT>
COLLABSERVE_AVX512 void SmallAttentionTiles(const float* q, int64_t ldq, const float* keys,
                                            int64_t width, const float* v, int64_t ldv, int64_t dv,
                                            const float* mask, int64_t S, float* ctx, int64_t ldc,
                                            int64_t queries) {
  constexpr int MR = NT == 1 ? 8 : 16 / NT;
  // Valid keys of each tile; the mask row, -inf beyond S (so padding keys get probability 0).
  __mmask16 valid[NT];
  __m512 madd[NT];
  for (int j = 0; j < NT; ++j) {
    const int64_t left = S - 16 * j;
    valid[j] = LaneMask(left);
    const __m512 m = mask != nullptr ? _mm512_maskz_loadu_ps(valid[j], mask + 16 * j) : _mm512_setzero_ps();
    madd[j] = _mm512_mask_blend_ps(valid[j], _mm512_set1_ps(-INFINITY), m);
  }
  alignas(64) float probs[MR][16 * NT];
  for (int64_t i0 = 0; i0 < queries; i0 += MR) {
    const int rows = static_cast<int>(std::min<int64_t>(MR, queries - i0));
    // Scores of rows i0.. against every key: acc[r][j] = q_r · keys of tile j.
    __m512 acc[MR][NT];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
      for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_setzero_ps();
    }
    for (int64_t d = 0; d < width; ++d) {
      __m512 kv[NT];
#pragma GCC unroll 4
      for (int j = 0; j < NT; ++j) kv[j] = _mm512_loadu_ps(keys + ((j >> 1) * width + d) * kPanel + (j & 1) * 16);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        // Rows past the sequence re-read row i0 (valid memory); their results are dropped.
        const __m512 qv = _mm512_set1_ps(q[(i0 + (r < rows ? r : 0)) * ldq + d]);
#pragma GCC unroll 4
        for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_fmadd_ps(qv, kv[j], acc[r][j]);
      }
    }
    // Softmax of each row, into probs.
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      if (r >= rows) break;
      __m512 mx = _mm512_set1_ps(-INFINITY);
#pragma GCC unroll 4
      for (int j = 0; j < NT; ++j) {
        acc[r][j] = _mm512_add_ps(acc[r][j], madd[j]);
        mx = _mm512_max_ps(mx, acc[r][j]);
      }
      const __m512 m = _mm512_set1_ps(HorizontalMax(mx));
      __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int j = 0; j < NT; ++j) {
        acc[r][j] = _mm512_maskz_mov_ps(valid[j], Exp512(_mm512_sub_ps(acc[r][j], m)));
        sum = _mm512_add_ps(sum, acc[r][j]);
      }
      const __m512 inv = _mm512_set1_ps(1.0f / HorizontalSum(sum));
#pragma GCC unroll 4
      for (int j = 0; j < NT; ++j) _mm512_store_ps(probs[r] + 16 * j, _mm512_mul_ps(acc[r][j], inv));
    }
    // ctx rows = probs · v, two rows at a time, 64 columns at a time (8 accumulators).
    for (int r = 0; r < rows; r += 2) {
      const bool two = r + 1 < rows;
      for (int64_t c0 = 0; c0 < dv; c0 += 64) {
        const int nz = static_cast<int>(std::min<int64_t>(4, (dv - c0) / 16));
        __m512 o0[4], o1[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) o0[c] = o1[c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < S; ++j) {
          const __m512 p0 = _mm512_set1_ps(probs[r][j]);
          const __m512 p1 = _mm512_set1_ps(probs[two ? r + 1 : r][j]);
          const float* vr = v + j * ldv + c0;
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) {
            if (c < nz) {
              const __m512 vv = _mm512_loadu_ps(vr + 16 * c);
              o0[c] = _mm512_fmadd_ps(p0, vv, o0[c]);
              o1[c] = _mm512_fmadd_ps(p1, vv, o1[c]);
            }
          }
        }
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          if (c < nz) {
            _mm512_storeu_ps(ctx + (i0 + r) * ldc + c0 + 16 * c, o0[c]);
            if (two) _mm512_storeu_ps(ctx + (i0 + r + 1) * ldc + c0 + 16 * c, o1[c]);
          }
        }
      }
    }
  }
}

// Where Attention's work space goes: the query factors, the queries (premixed rows, or packed
// tiles for the micro-kernel), the scores of one block of kAttentionBlock query rows, their
// probabilities packed, the values packed; offsets in floats, `size` the whole.
struct AttentionWorkLayout {
  int64_t factors, queries, scores, probs, values, size;
};

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

AttentionWorkLayout WorkLayout(int64_t S, int64_t queries, int64_t width, int64_t dv) {
  const int64_t rows = RoundUp(queries, kMr);
  const int64_t block = RoundUp(std::min(queries, kAttentionBlock), kMr);
  AttentionWorkLayout l;
  l.factors = 0;
  l.queries = l.factors + RoundUp(width, 16);
  l.scores = l.queries + rows * width;
  l.probs = l.scores + block * S;
  l.values = l.probs + block * S;
  l.size = l.values + RoundUp(dv, kPanel) * S;
  return l;
}

struct AttentionWork {
  float* factors;
  float* queries;
  float* scores;
  float* probs;
  float* values;
};

AttentionWork CarveAttentionWork(float* work, int64_t S, int64_t queries, int64_t width, int64_t dv) {
  const AttentionWorkLayout l = WorkLayout(S, queries, width, dv);
  return {work + l.factors, work + l.queries, work + l.scores, work + l.probs, work + l.values};
}

// The query factors of a head: query_factor[d] · scale (scale alone without factors).
void QueryFactors(const AttentionHead& a, float* g) {
  for (int64_t d = 0; d < a.width; ++d) g[d] = a.query_factor != nullptr ? a.query_factor[d] * a.scale : a.scale;
}

COLLABSERVE_AVX512 void SmallAttentionAvx512(const AttentionHead& a, int64_t S, int64_t queries,
                                             float* ctx, int64_t ldc, const AttentionWork& w) {
  const int nt = static_cast<int>((S + 15) / 16);
  const int64_t width = a.width;
  // The queries with their factors applied, [queries][width].
  const float* g = w.factors;
  float* q = w.queries;
  for (int64_t i = 0; i < queries; ++i) {
    const float* src = a.q + i * a.ldq;
    float* dst = q + i * width;
    int64_t d = 0;
    for (; d + 16 <= width; d += 16) {
      _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(src + d), _mm512_loadu_ps(g + d)));
    }
    for (; d < width; ++d) dst[d] = src[d] * g[d];
  }
  const float* v = a.v;
  const float* mask = a.key_add;
  switch (nt) {
    case 1: SmallAttentionTiles<1>(q, width, a.keys, width, v, a.ldv, a.dv, mask, S, ctx, ldc, queries); break;
    case 2: SmallAttentionTiles<2>(q, width, a.keys, width, v, a.ldv, a.dv, mask, S, ctx, ldc, queries); break;
    case 3: SmallAttentionTiles<3>(q, width, a.keys, width, v, a.ldv, a.dv, mask, S, ctx, ldc, queries); break;
    default: SmallAttentionTiles<4>(q, width, a.keys, width, v, a.ldv, a.dv, mask, S, ctx, ldc, queries); break;
  }
}

// In place over the first S entries of each of `rows` rows (leading dimension ld): the softmax.
// Lane j % 16 of a chunk accumulates key j, so keys past a sequence's own (probability 0) change
// neither the maximum nor the sum.
COLLABSERVE_AVX512 void SoftmaxRowsAvx512(float* x, int64_t ld, int64_t rows, int64_t S) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * ld;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < S; j += 16) {
      const __mmask16 m = LaneMask(S - j);
      mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, row + j));
    }
    const __m512 top = _mm512_set1_ps(HorizontalMax(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < S; j += 16) {
      const __mmask16 m = LaneMask(S - j);
      const __m512 e = _mm512_maskz_mov_ps(m, Exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + j), top)));
      _mm512_mask_storeu_ps(row + j, m, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / HorizontalSum(sum));
    for (int64_t j = 0; j < S; j += 16) {
      const __mmask16 m = LaneMask(S - j);
      _mm512_mask_storeu_ps(row + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + j), inv));
    }
  }
}

// Attention on the micro-kernel, kAttentionBlock query rows at a time: their scores = (queries ·
// factors) keysᵀ + key terms, one k block of the whole width (so a score is summed in d order
// whatever S and `queries` are); softmax; context = probabilities · values, one k block of all S
// keys (a padding key adds an exact 0). The block's scores and probabilities stay in L2 (two
// [64, 512] blocks: 256 KiB) instead of a [queries, S] matrix that at 512 positions (1 MiB, then 1
// MiB more packed) went through L3 between the scores, the softmax, the packing and the context.
COLLABSERVE_AVX512 void PanelAttentionAvx512(const AttentionHead& a, int64_t S, int64_t queries,
                                             float* ctx, int64_t ldc, const AttentionWork& w) {
  const int64_t width = a.width, dv = a.dv;
  const int64_t tiles = (queries + kMr - 1) / kMr;
  // The queries packed in tiles of kMr rows (the last one's missing rows zero unless the caller
  // packed them), factors applied.
  const float* packed_q = a.packed_q;
  if (packed_q == nullptr) {
    if (queries % kMr != 0) std::fill_n(w.queries + (tiles - 1) * width * kMr, width * kMr, 0.0f);
    PackRowsAvx512<kMr>(a.q, a.ldq, 0, queries, 0, width, width, w.queries);
    packed_q = w.queries;
  }
  for (int64_t t = 0; t < tiles; ++t) {
    const float* src = packed_q + t * width * kMr;
    float* tile = w.queries + t * width * kMr;
    for (int64_t d = 0; d < width; ++d) {
      _mm256_storeu_ps(tile + d * kMr, _mm256_mul_ps(_mm256_loadu_ps(src + d * kMr), _mm256_set1_ps(w.factors[d])));
    }
  }
  // The values in panels of 32 columns, [S][32] each (missing columns zero).
  const int64_t value_panels = (dv + kPanel - 1) / kPanel;
  for (int64_t c = 0; c < value_panels; ++c) {
    const auto [mk0, mk1] = PanelMasks(std::min(kPanel, dv - c * kPanel));
    float* vp = w.values + c * S * kPanel;
    for (int64_t j = 0; j < S; ++j) {
      const float* src = a.v + j * a.ldv + c * kPanel;
      _mm512_storeu_ps(vp + j * kPanel, _mm512_maskz_loadu_ps(mk0, src));
      _mm512_storeu_ps(vp + j * kPanel + 16, _mm512_maskz_loadu_ps(mk1, src + 16));
    }
  }
  const int64_t key_panels = (S + kPanel - 1) / kPanel;
  for (int64_t r0 = 0; r0 < queries; r0 += kAttentionBlock) {
    const int64_t rows = std::min(kAttentionBlock, queries - r0);
    const int64_t t0 = r0 / kMr, t1 = (r0 + rows + kMr - 1) / kMr;
    // Scores of the block, [rows, S]: the key panels in turn, every query tile against each.
    for (int64_t p = 0; p < key_panels; ++p) {
      const auto [mk0, mk1] = PanelMasks(std::min(kPanel, S - p * kPanel));
      const float* bp = a.keys + p * width * kPanel;
      const float* add = a.key_add != nullptr ? a.key_add + p * kPanel : nullptr;
      for (int64_t t = t0; t < t1; ++t) {
        const int m = static_cast<int>(std::min<int64_t>(kMr, queries - t * kMr));
        kKernels[m](width, w.queries + t * width * kMr, bp, w.scores + (t - t0) * kMr * S + p * kPanel, S,
                    true, add, nullptr, 0, mk0, mk1, t == t0 ? 1 : 0);
      }
    }
    SoftmaxRowsAvx512(w.scores, S, rows, S);
    if (rows % kMr != 0) std::fill_n(w.probs + (t1 - t0 - 1) * S * kMr, S * kMr, 0.0f);
    PackRowsAvx512<kMr>(w.scores, S, 0, rows, 0, S, S, w.probs);
    for (int64_t c = 0; c < value_panels; ++c) {
      const auto [mk0, mk1] = PanelMasks(std::min(kPanel, dv - c * kPanel));
      for (int64_t t = t0; t < t1; ++t) {
        const int m = static_cast<int>(std::min<int64_t>(kMr, queries - t * kMr));
        kKernels[m](S, w.probs + (t - t0) * S * kMr, w.values + c * S * kPanel, ctx + t * kMr * ldc + c * kPanel,
                    ldc, true, nullptr, nullptr, 0, mk0, mk1, t == t0 ? 1 : 0);
      }
    }
  }
}

// NarrowProduct, columns in groups of up to 12 (one zmm accumulator each, 16 lanes of k), the
// lanes summed at the end.
COLLABSERVE_AVX512 void NarrowProductAvx512(const float* x, int64_t ldx, int64_t rows, const float* w,
                                            int64_t N, int64_t K, float* out, int64_t ldo) {
  constexpr int kGroup = 12;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    for (int64_t n0 = 0; n0 < N; n0 += kGroup) {
      const int g = static_cast<int>(std::min<int64_t>(kGroup, N - n0));
      __m512 acc[kGroup];
#pragma GCC unroll 12
      for (int i = 0; i < kGroup; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = LaneMask(K - k);
        const __m512 xv = _mm512_maskz_loadu_ps(m, xr + k);
#pragma GCC unroll 12
        for (int i = 0; i < kGroup; ++i) {
          if (i < g) acc[i] = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(m, w + (n0 + i) * K + k), acc[i]);
        }
      }
      for (int i = 0; i < g; ++i) out[r * ldo + n0 + i] = HorizontalSum(acc[i]);
    }
  }
}

// Keys as rows packed in tiles of kPanel (the padding keys of the last panel 0).
COLLABSERVE_AVX512 void PackKeysAvx512(const float* k, int64_t ldk, int64_t S, int64_t width, float* packed) {
  const int64_t n = S % kPanel;
  if (n != 0) std::fill_n(packed + (S / kPanel) * width * kPanel, width * kPanel, 0.0f);
  PackRowsAvx512<kPanel>(k, ldk, 0, S, 0, width, width, packed);
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

// n_begin, n_end: whole panels of w (n_end may be w.n()).
void CheckColumns(const PackedWeight& w, int64_t n_begin, int64_t n_end) {
  TORCH_CHECK(0 <= n_begin && n_begin <= n_end && n_end <= w.n() &&
                  (n_begin == n_end || (n_begin % kPanel == 0 && (n_end % kPanel == 0 || n_end == w.n()))),
              "PackedLinearColumns: columns [", n_begin, ", ", n_end, ") of ", w.n(),
              " are not whole panels of ", kPanel);
}

}  // namespace

bool PackedLinearSupported() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  }();
  return supported;
}

// A packed weight (and the block of a model's small tensors) lives as long as its model; in the
// allocator it would be rounded up to a size class (jemalloc's are a quarter apart: 4.5 MiB takes
// 5, 9 MiB takes 10), whose tail, touched by earlier allocations, stayed resident (the D~=384
// model's resident saving fell 3 MiB short of its parameter saving). In pages of its own it holds
// its bytes and nothing more, and gives them back to the system when freed. (Transparent huge
// pages for it, MADV_HUGEPAGE, made no difference in speed at 1-8 x 16-128: not asked for.)
// populate (the weights, which are written whole right away): one populating call costs less than
// a fault per 4 KiB page (loading BERT-base served: 2.29-2.35 -> 1.84-1.93 s, three alternated
// rounds). Not for PassArena, which maps up to twice what a pass needs.
at::Tensor PagesOfItsOwn(int64_t floats, const at::TensorOptions& options, bool populate) {
  const size_t bytes = std::max<size_t>(1, static_cast<size_t>(floats) * sizeof(float));
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | (populate ? MAP_POPULATE : 0),
                 -1, 0);
  TORCH_CHECK(p != MAP_FAILED, "could not map ", bytes, " bytes for model weights: ", std::strerror(errno));
  // (Under ASan a user may have poisoned parts of it: the next mapping at these addresses must not
  // inherit that.)
  return at::from_blob(
      p, {floats},
      [bytes](void* q) {
        ASAN_UNPOISON_MEMORY_REGION(q, bytes);
        munmap(q, bytes);
      },
      options.dtype(at::kFloat));
}

PackedWeight::PackedWeight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "PackedWeight: want a float32 CPU matrix, got ", w.sizes(), " ", w.scalar_type(),
              " on ", w.device());
  n_ = w.size(0);
  k_ = w.size(1);
  const at::Tensor src = w.contiguous();
  data_ = PagesOfItsOwn(panels() * k_ * kPanel, w.options(), /*populate=*/true).view({panels(), k_, kPanel});
  const float* s = src.data_ptr<float>();
  float* d = data_.data_ptr<float>();
  ptr_ = d;
  for (int64_t p = 0; p < panels(); ++p) {
    const int64_t cols = std::min(kPanel, n_ - p * kPanel);
    for (int64_t j = 0; j < cols; ++j) {
      const float* col = s + (p * kPanel + j) * k_;
      float* dst = d + p * k_ * kPanel + j;
      for (int64_t k = 0; k < k_; ++k) dst[k * kPanel] = col[k];
    }
  }
}

void PackedWeight::UnpackColumns(int64_t n_begin, int64_t n_end, float* out, int64_t ldo) const {
  TORCH_CHECK(0 <= n_begin && n_begin <= n_end && n_end <= n_ && n_begin % kPanel == 0 &&
                  (ldo == 0 || ldo >= n_end - n_begin),
              "PackedWeight::UnpackColumns: columns [", n_begin, ", ", n_end, ") of ", n_,
              " with leading dimension ", ldo);
  const int64_t width = ldo == 0 ? n_end - n_begin : ldo;
  // Row k of the block gathers, panel by panel, runs of up to 32 contiguous floats.
  for (int64_t p = n_begin / kPanel; p * kPanel < n_end; ++p) {
    const int64_t c0 = p * kPanel - n_begin, cols = std::min(kPanel, n_end - p * kPanel);
    const float* src = ptr_ + p * k_ * kPanel;
    if (cols == kPanel) {
      // A fixed-size copy, inlined as vector moves rather than a call to memmove per 128 bytes.
      for (int64_t k = 0; k < k_; ++k) std::memcpy(out + k * width + c0, src + k * kPanel, kPanel * sizeof(float));
      continue;
    }
    for (int64_t k = 0; k < k_; ++k) {
      std::copy(src + k * kPanel, src + k * kPanel + cols, out + k * width + c0);
    }
  }
}

at::Tensor PackedWeight::Unpack() const {
  at::Tensor t = at::empty({k_, n_}, data_.options());
  UnpackColumns(0, n_, t.data_ptr<float>());
  return t.t().contiguous();
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
  CheckColumns(w, n_begin, n_end);
  if (rows <= 0 || n_begin == n_end) return;
  LinearPanels(x, ldx, rows, w, bias, residual, ldr, out, ldo, n_begin / kPanel,
               (n_end + kPanel - 1) / kPanel);
}

int64_t PackedRowsSize(int64_t rows, int64_t K) {
  return (std::max<int64_t>(0, rows) + kMr - 1) / kMr * kMr * std::max<int64_t>(0, K);
}

void PackRows(const float* x, int64_t ldx, int64_t r0, int64_t r1, int64_t k0, int64_t k1,
              int64_t K, float* packed) {
  TORCH_CHECK(0 <= r0 && 0 <= k0 && k0 <= k1 && k1 <= K, "PackRows: columns [", k0, ", ", k1,
              ") of ", K, ", rows from ", r0);
  if (r1 <= r0 || k1 == k0) return;
  if (PackedLinearSupported()) {
    PackRowsAvx512<kMr>(x, ldx, r0, r1, k0, k1, K, packed);
  } else {
    PackRowsScalar<kMr>(x, ldx, r0, r1, k0, k1, K, packed);
  }
}

void PackedLinearColumnsPacked(const float* packed, int64_t rows, const PackedWeight& w,
                               const float* bias, const float* residual, int64_t ldr, float* out,
                               int64_t ldo, int64_t n_begin, int64_t n_end) {
  TORCH_CHECK(PackedLinearSupported(), "PackedLinearColumnsPacked needs AVX-512F");
  CheckColumns(w, n_begin, n_end);
  if (rows <= 0 || n_begin == n_end) return;
  const int64_t p0 = n_begin / kPanel, p1 = (n_end + kPanel - 1) / kPanel;
  const bool stream = rows <= kStreamMaxRows;
  for (int64_t m0 = 0; m0 < rows; m0 += kMc) {
    PanelsOnPacked(packed + m0 * w.k(), m0, std::min(rows, m0 + kMc), w, bias, residual, ldr, out,
                   ldo, p0, p1, stream);
  }
}

void GeluRowsInPlace(float* x, int64_t ldx, int64_t rows, int64_t c0, int64_t c1) {
  TORCH_CHECK(PackedLinearSupported(), "GeluRowsInPlace needs AVX-512F");
  if (rows <= 0 || c1 <= c0) return;
  GeluRowsAvx512(x, ldx, rows, c0, c1);
}

int64_t PackedKeysSize(int64_t S, int64_t width) { return RoundUp(S, kPanel) * width; }

void PackKeys(const float* k, int64_t ldk, int64_t S, int64_t width, float* packed) {
  TORCH_CHECK(PackedLinearSupported(), "PackKeys needs AVX-512F");
  TORCH_CHECK(S >= 1 && width >= 1, "PackKeys: S = ", S, ", width = ", width, " (want both >= 1)");
  PackKeysAvx512(k, ldk, S, width, packed);
}

void NarrowProduct(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t N, int64_t K,
                   float* out, int64_t ldo) {
  TORCH_CHECK(PackedLinearSupported(), "NarrowProduct needs AVX-512F");
  if (rows <= 0 || N <= 0) return;
  NarrowProductAvx512(x, ldx, rows, w, N, K, out, ldo);
}

bool AttentionInRegisters(int64_t S, int64_t dv, int64_t small_max_s) {
  return S <= std::min(small_max_s, kSmallAttentionMaxS) && dv % 16 == 0;
}

int64_t AttentionWorkSize(int64_t S, int64_t queries, int64_t width, int64_t dv) {
  return WorkLayout(S, queries, width, dv).size;
}

void Attention(const AttentionHead& head, int64_t S, int64_t queries, float* ctx, int64_t ldc,
               float* work, int64_t small_max_s) {
  TORCH_CHECK(PackedLinearSupported(), "Attention needs AVX-512F");
  TORCH_CHECK(head.width >= 1 && head.dv >= 1, "Attention: score width ", head.width, ", value width ",
              head.dv, " (want both >= 1)");
  TORCH_CHECK(S >= 1 && queries >= 1 && queries <= S, "Attention: S = ", S, ", queries = ", queries,
              " (want 1 <= queries <= S)");
  const AttentionWork w = CarveAttentionWork(work, S, queries, head.width, head.dv);
  QueryFactors(head, w.factors);
  if (AttentionInRegisters(S, head.dv, small_max_s)) {
    SmallAttentionAvx512(head, S, queries, ctx, ldc, w);
  } else {
    PanelAttentionAvx512(head, S, queries, ctx, ldc, w);
  }
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
  // Its share of a pass's allocations (the sgemm's workspace above 512 tokens) from the arena that
  // keeps freed pages for the next pass, as the caller's (PassArena::BeginPass).
  util::BindThreadToRetainingArena();
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
