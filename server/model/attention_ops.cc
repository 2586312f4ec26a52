#include "server/model/attention_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "server/model/kernels.h"

// at::scaled_dot_product_attention with its scale argument: LibTorch 2.1 and later.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#define COLLABSERVE_HAVE_SDPA 1
#else
#define COLLABSERVE_HAVE_SDPA 0
#endif

namespace collabserve::model::internal {
namespace {

constexpr bool kHaveSdpa = COLLABSERVE_HAVE_SDPA;

// Up to this many positions a head's attention keeps its scores in registers (kernels.h:
// Attention) instead of forming them on the micro-kernel. Default kSmallAttentionDefaultMaxS;
// COLLABSERVE_SMALL_ATTENTION_MAX_S=N lowers it (0: off; A/B measurements).
int64_t SmallAttentionMaxS() {
  static const int64_t s = util::EnvInt64("COLLABSERVE_SMALL_ATTENTION_MAX_S", kSmallAttentionDefaultMaxS);
  return s;
}

// Whether attention runs on the AVX-512 kernel (kernels.h: Attention) rather than on the sgemm
// and ATen's softmax: wherever AVX-512F is, unless COLLABSERVE_ATTENTION=sgemm pins the sgemm
// (A/B measurements, and the tests of the path CPUs without AVX-512 take).
bool UseAttentionKernel() {
  static const bool use = PackedLinearSupported() && util::EnvString("COLLABSERVE_ATTENTION") != "sgemm";
  return use;
}

// One head on the sgemm: the [Sq, S] scores (a collaborative head's mixing applied to a copy of
// its queries), the key terms added, ATen's softmax, the context. work: S·S + S·width floats.
void SgemmHead(SgemmFn sgemm, const float* q, const float* k, const float* v, const AttentionLayout& L,
               const float* mix, const float* key_add, int64_t S, int64_t Sq, float* out, int64_t D,
               at::Tensor& scratch, int64_t work_offset) {
  const int64_t ld = L.ld, width = L.width;
  float* sc = scratch.data_ptr<float>() + work_offset;
  float* mixed = sc + S * S;
  const float* qa = q;
  int64_t lda = ld;
  if (mix != nullptr) {
    for (int64_t i = 0; i < Sq; ++i) {
      const float* src = q + i * ld;
      float* dst = mixed + i * width;
      for (int64_t d = 0; d < width; ++d) dst[d] = src[d] * mix[d];
    }
    qa = mixed;
    lda = width;
  }
  at::Tensor sq = scratch.narrow(0, work_offset, Sq * S).view({Sq, S});
  int st = sgemm('N', 'T', Sq, S, width, L.scale, qa, lda, k, ld, 0.0f, sc, S);
  TORCH_CHECK(st == 0, "dnnl_sgemm (attention scores) failed with status ", st);
  if (key_add != nullptr) {
    for (int64_t r = 0; r < Sq; ++r) {
      float* row = sc + r * S;
      for (int64_t j = 0; j < S; ++j) row[j] += key_add[j];
    }
  }
  at::_softmax_out(sq, sq, -1, false);
  st = sgemm('N', 'N', Sq, L.dk, S, 1.0f, sc, S, v, ld, 0.0f, out, D);
  TORCH_CHECK(st == 0, "dnnl_sgemm (attention context) failed with status ", st);
}

// Where AttendHeads' scratch goes: the S key terms, the packed keys, the packed queries, then the
// attention kernel's work space (or the sgemm path's [S, S] scores and mixed queries); offsets in
// floats, `size` the whole.
struct ScratchLayout {
  int64_t add, keys, queries, work, size;
};

ScratchLayout LayoutOfScratch(int64_t S, int64_t width, int64_t dk) {
  ScratchLayout l;
  l.add = 0;
  l.keys = l.add + S;
  l.queries = l.keys + PackedKeysSize(S, width);
  l.work = l.queries + PackedRowsSize(S, width);
  l.size = l.work + std::max(AttentionWorkSize(S, S, width, dk), S * S + S * width);
  return l;
}

}  // namespace

at::Tensor AttentionScratch(int64_t S, int64_t width, int64_t dk, const at::TensorOptions& options) {
  return at::empty({AttentionScratchSize(S, width, dk)}, options);
}

int64_t AttentionScratchSize(int64_t S, int64_t width, int64_t dk) { return LayoutOfScratch(S, width, dk).size; }

bool FusedAttentionAvailable(SgemmFn sgemm) {
  return sgemm != nullptr || (!AtenOnly() && UseAttentionKernel());
}

int64_t CollaborativeProjectionWidth(int64_t R, int64_t D, int64_t H) {
  return (2 * R + D + H + 15) / 16 * 16;
}

AttentionLayout LayoutOf(const EncoderLayer& l, int64_t H, int64_t dk) {
  const int64_t D = H * dk;
  AttentionLayout a;
  a.dk = dk;
  if (l.collaborative) {
    const int64_t R = l.rank;
    // Rows padded to whole cache lines (16 floats). Unpadded (2·384 + 768 + 12 = 1548 floats
    // at D~ = 384, 1164 at 192), every other 32-float store of the projection split a cache line:
    // PackedLinear ran that product at 140-145 GFLOP/s against 175-185 for 1552 or 1536 columns
    // (512 rows, one core, gemm_bench), and the attention kernels read the rows unaligned.
    a.ld = CollaborativeProjectionWidth(R, D, H);
    a.fused_n = 2 * R + D;
    a.content_n = H;
    a.width = R;
    a.q0 = 0;
    a.k0 = R;
    a.v0 = 2 * R;
    a.content0 = 2 * R + D;
    // Read by the CPU float32 kernels only; the ATen path (CUDA, half types) uses the tensor.
    if (l.mixing.is_cpu() && l.mixing.scalar_type() == at::kFloat) a.mixing = l.mixing.data_ptr<float>();
  } else {
    a.ld = 3 * D;
    a.fused_n = 3 * D;
    a.width = dk;
    a.q0 = 0;
    a.k0 = D;
    a.v0 = 2 * D;
    a.head_step = dk;
    a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dk)));
  }
  return a;
}

void AttendHeads(SgemmFn sgemm, const float* p, const AttentionLayout& L, const float* mask,
                 int64_t b, int64_t h0, int64_t h1, int64_t S, int64_t Sq, int64_t D,
                 at::Tensor& scratch, float* ctx) {
  if (h1 <= h0) return;
  const int64_t ld = L.ld, dk = L.dk, width = L.width;
  const float* row0 = p + b * S * ld;
  const float* m = mask != nullptr ? mask + b * S : nullptr;
  const ScratchLayout sl = LayoutOfScratch(S, width, dk);
  float* base = scratch.data_ptr<float>();
  float* add = base + sl.add;
  float* keys = base + sl.keys;
  float* queries = base + sl.queries;
  float* work = base + sl.work;
  const bool kernel = UseAttentionKernel();
  // A collaborative layer's heads share their keys and queries (head_step 0): packed once for all
  // of them (the queries where the kernel's micro-kernel form reads them packed).
  const bool shared = L.head_step == 0;
  const bool shared_queries = kernel && shared && !AttentionInRegisters(S, dk, SmallAttentionMaxS());
  if (kernel && shared) PackKeys(row0 + L.k0, ld, S, width, keys);
  if (shared_queries) PackRows(row0 + L.q0, ld, 0, Sq, 0, width, width, queries);
  for (int64_t h = h0; h < h1; ++h) {
    const float* q = row0 + L.q0 + h * L.head_step;
    const float* k = row0 + L.k0 + h * L.head_step;
    const float* v = row0 + L.v0 + h * dk;
    float* out = ctx + b * Sq * D + h * dk;
    // The additive term of each key: the padding mask, plus the head's content score.
    const float* key_add = m;
    if (L.content0 >= 0) {
      const float* c = row0 + L.content0 + h;
      for (int64_t j = 0; j < S; ++j) add[j] = c[j * ld] + (m != nullptr ? m[j] : 0.0f);
      key_add = add;
    }
    const float* mix = L.mixing != nullptr ? L.mixing + h * width : nullptr;
    if (!kernel) {
      SgemmHead(sgemm, q, k, v, L, mix, key_add, S, Sq, out, D, scratch, sl.work);
      continue;
    }
    if (!shared) PackKeys(k, ld, S, width, keys);
    AttentionHead a;
    a.q = q;
    a.keys = keys;
    a.v = v;
    a.ldq = a.ldv = ld;
    a.width = width;
    a.dv = dk;
    a.query_factor = mix;
    a.scale = L.scale;
    a.key_add = key_add;
    a.packed_q = shared_queries ? queries : nullptr;
    Attention(a, S, Sq, out, D, work, SmallAttentionMaxS());
  }
}

void AttendUnits(SgemmFn sgemm, const float* p, const AttentionLayout& L, const float* mask,
                 int64_t u0, int64_t u1, int64_t H, int64_t S, int64_t Sq, int64_t D,
                 at::Tensor& scratch, float* ctx) {
  for (int64_t u = u0; u < u1;) {
    const int64_t b = u / H, h0 = u % H, h1 = std::min(H, h0 + (u1 - u));
    AttendHeads(sgemm, p, L, mask, b, h0, h1, S, Sq, D, scratch, ctx);
    u += h1 - h0;
  }
}

at::Tensor FusedAttention(SgemmFn sgemm, const at::Tensor& proj, const AttentionLayout& L,
                          const at::Tensor& mask_add, int64_t B, int64_t S, int64_t Sq, int64_t H) {
  const int64_t D = H * L.dk;
  at::Tensor ctx = at::empty({B * Sq, D}, proj.options());
  const float* p = proj.data_ptr<float>();
  float* c = ctx.data_ptr<float>();
  const float* mask = mask_add.defined() ? mask_add.data_ptr<float>() : nullptr;  // [B, S]
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    // OpenMP workers do not inherit the caller's InferenceMode (thread-local).
    c10::InferenceMode guard(inference);
    at::Tensor scratch = AttentionScratch(S, L.width, L.dk, proj.options());
    AttendUnits(sgemm, p, L, mask, begin, end, H, S, Sq, D, scratch, c);
  });
  return ctx;
}

void ContentScores(SgemmFn sgemm, const EncoderLayer& l, const AttentionLayout& L, const float* x,
                   int64_t ldx, int64_t r0, int64_t r1, float* proj) {
  if (r1 <= r0) return;
  if (PackedLinearSupported()) {
    // (The content scores have no bias: fused_b's last H entries are zeros.)
    NarrowProduct(x + r0 * ldx, ldx, r1 - r0, l.content.plain.data_ptr<float>(), L.content_n,
                  l.content.plain.size(1), proj + r0 * L.ld + L.fused_n, L.ld);
    return;
  }
  DenseColumns(sgemm, x + r0 * ldx, ldx, r1 - r0, l.content, /*packed=*/false,
               l.fused_b.data_ptr<float>() + L.fused_n, nullptr, 0, proj + r0 * L.ld + L.fused_n, L.ld,
               0, L.content_n);
}

at::Tensor Project(SgemmFn sgemm, const EncoderLayer& l, const AttentionLayout& L, const at::Tensor& x) {
  if (!l.collaborative) return Dense(x, l.fused, l.fused_b);
  // ATen ops on the plain weights: CUDA, half types, and the CPU without the sgemm while the plain
  // fused weight is kept (COLLABSERVE_GEMM=aten: nothing packed). A served model whose weights are
  // packed and plain ones released takes the CPU path below, on PackedLinear where there is no sgemm.
  // The plain fused weight holds every column of the row ([W~Q^T; W~K^T; value; content_bias;
  // zeros], L.ld rows): one product, its rows L.ld apart.
  if (!x.is_cpu() || x.scalar_type() != at::kFloat || (sgemm == nullptr && l.fused.plain.defined())) {
    return at::linear(x, l.fused.plain, l.fused_b);
  }
  const at::Tensor xc = x.contiguous();
  const int64_t T = xc.size(0), D = xc.size(1);
  at::Tensor proj = at::empty({T, L.ld}, x.options());
  float* p = proj.data_ptr<float>();
  const float* b = l.fused_b.data_ptr<float>();
  if (UsePackedLinear(l.fused, T)) {  // always, without the sgemm
    PackedLinear(xc.data_ptr<float>(), D, T, *l.fused.packed, b, nullptr, 0, p, L.ld);
  } else {
    TORCH_CHECK(sgemm != nullptr, "a collaborative projection kept only packed needs PackedLinear or the sgemm");
    DenseColumns(sgemm, xc.data_ptr<float>(), D, T, l.fused, false, b, nullptr, 0, p, L.ld, 0, L.fused_n);
  }
  ContentScores(sgemm, l, L, xc.data_ptr<float>(), D, 0, T, p);
  return proj;
}

void ProjectAndAttendHeads(SgemmFn sgemm, const float* x, const float* x_packed,
                           const DenseWeight& w, bool packed, const float* bias,
                           const AttentionLayout& L, const float* mask, int64_t B, int64_t S,
                           int64_t Sq, int64_t D, int64_t h0, int64_t h1, at::Tensor& scratch,
                           float* proj, float* ctx) {
  const int64_t T = B * S, dk = L.dk;
  for (int64_t part = 0; part < 3; ++part) {
    const int64_t n0 = part * D + h0 * dk, n1 = part * D + h1 * dk;
    if (part == 0 && Sq != S) {
      DenseColumns(sgemm, x, S * D, B, w, packed, bias, nullptr, 0, proj, S * 3 * D, n0, n1);
    } else if (x_packed != nullptr) {
      PackedLinearColumnsPacked(x_packed, T, *w.packed, bias, nullptr, 0, proj, 3 * D, n0, n1);
    } else {
      DenseColumns(sgemm, x, D, T, w, packed, bias, nullptr, 0, proj, 3 * D, n0, n1);
    }
  }
  for (int64_t b = 0; b < B; ++b) AttendHeads(sgemm, proj, L, mask, b, h0, h1, S, Sq, D, scratch, ctx);
}

at::Tensor ProjectAndAttend(SgemmFn sgemm, const at::Tensor& x, const EncoderLayer& l,
                            const AttentionLayout& L, const at::Tensor& mask_add, int64_t B,
                            int64_t S, int64_t Sq, int64_t H) {
  const int64_t D = H * L.dk;
  at::Tensor proj = at::empty({B * S, 3 * D}, x.options());
  at::Tensor ctx = at::empty({B * Sq, D}, x.options());
  const float* mask = mask_add.defined() ? mask_add.data_ptr<float>() : nullptr;  // [B, S]
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    c10::InferenceMode guard(inference);  // not inherited by OpenMP workers
    at::Tensor scratch = AttentionScratch(S, L.width, L.dk, x.options());
    ProjectAndAttendHeads(sgemm, x.data_ptr<float>(), nullptr, l.fused, /*packed=*/true,
                          l.fused_b.data_ptr<float>(), L, mask, B, S, Sq, D, h0, h1, scratch,
                          proj.data_ptr<float>(), ctx.data_ptr<float>());
  });
  return ctx;
}

double LowestValue(c10::ScalarType dtype) {
  return dtype == c10::kHalf       ? -65504.0
         : dtype == c10::kBFloat16 ? -3.3895313892515355e38
                                   : static_cast<double>(std::numeric_limits<float>::lowest());
}

bool SdpaAvailable() { return kHaveSdpa; }

bool UseSdpa(const at::Tensor& x) {
  if (!kHaveSdpa) return false;
  static const bool forced = util::EnvString("COLLABSERVE_ATTENTION") == "sdpa";
  return x.is_cuda() || forced;
}

at::Tensor AtenAttention(const EncoderLayer& l, const at::Tensor& proj, const at::Tensor& mask_add,
                         int64_t B, int64_t S, int64_t Sq, int64_t H, int64_t dk, CollabAttention way) {
  const int64_t D = H * dk;
  const bool fused = UseSdpa(proj);
  // Every head's queries q [B, H, Sq, w], keys k ([B, H, S, w]; [B, 1, S, w] shared by the heads of
  // a collaborative layer), values v [B, H, S, w_v], a bias added to the scores [B, H, Sq, S] (a
  // collaborative layer's content term v_i^T y, the padding mask) and the scores' scale. The
  // context is the first d_k columns of the values' product (v-fold: divided by column d_k).
  at::Tensor q, k, v, bias;
  double scale = 1.0;
  bool fold = false;
  if (l.collaborative) {
    const int64_t R = l.rank;
    auto p3 = proj.view({B, S, -1});
    // Head i's queries x W~_Q scaled by m_i (the mixing has 1/sqrt(d_k) folded in).
    q = p3.narrow(2, 0, R).narrow(1, 0, Sq).unsqueeze(1) * l.mixing.view({1, H, 1, R});
    k = p3.narrow(2, R, R).unsqueeze(1);
    v = p3.narrow(2, 2 * R, D).view({B, S, H, dk}).transpose(1, 2);
    bias = p3.narrow(2, 2 * R + D, H).transpose(1, 2).unsqueeze(2);  // [B, H, 1, S]
    if (mask_add.defined()) bias = bias + mask_add;
    // The widths the product and the values need; on SDPA, multiples of 8. A rank that is not
    // one (a target search's grid has 12, 17, 34, 68, ...) fails two checks of the fused kernels:
    // the keys' and values' first columns are off a 16-byte boundary in the projection's rows, and
    // the memory-efficient kernel takes head widths of multiples of 8 in half types (4 in float32)
    // only, else SDPA falls back to its math kernel (scores written out in full). Zero columns
    // leave the scores as they are (the scale is explicit).
    const bool column = way == CollabAttention::kQkColumn || way == CollabAttention::kQkColumnPadded;
    fold = way == CollabAttention::kVFold || way == CollabAttention::kVFoldPadded;
    const auto round = [&](int64_t n) { return fused ? (n + 7) / 8 * 8 : n; };
    int64_t qk_width = round(column ? R + 1 : R), v_width = round(fold ? dk + 1 : dk);
    if (way == CollabAttention::kQkColumnPadded || way == CollabAttention::kVFoldPadded) {
      qk_width = v_width = std::max(qk_width, v_width);  // flash attention: one width
    }
    at::Tensor b;  // [B, H, S]: the content scores plus the mask, for the ways that fold them in
    if (way != CollabAttention::kBias) {
      b = bias.squeeze(2);
      bias = at::Tensor();
    }
    if (qk_width != R) q = at::constant_pad_nd(q, {0, qk_width - R});
    if (column) {
      q.select(3, R).fill_(1);
      // Per head: [k~, b_i, 0...]. In half types a masked key's b is the lowest value plus its
      // content score, which may round to -inf: clamped, so that no product meets an infinity.
      at::Tensor k2 = at::zeros({B, H, S, qk_width}, k.options());
      k2.narrow(3, 0, R).copy_(k.expand({B, H, S, R}));
      k2.select(3, R).copy_(b.clamp_min(LowestValue(proj.scalar_type())));
      k = k2;
    } else {
      if (qk_width != R) k = at::constant_pad_nd(k, {0, qk_width - R});
      if (fused) k = k.expand({B, H, S, qk_width});  // SDPA takes as many key heads as query heads
    }
    if (fold) {
      // w_j = e^(b_j - max_j b) per head, in float32 (a masked key's is 0); values [w v, w, 0...].
      const at::Tensor bf = b.to(at::kFloat);
      const at::Tensor w = (bf - bf.amax(-1, true)).exp_().to(v.scalar_type()).unsqueeze(-1);
      at::Tensor v2 = at::zeros({B, H, S, v_width}, v.options());
      v2.narrow(3, 0, dk).copy_(v * w);
      v2.narrow(3, dk, 1).copy_(w);
      v = v2;
    } else if (v_width != dk) {
      v = at::constant_pad_nd(v, {0, v_width - dk});
    } else if (fused && R % 8 != 0) {
      v = v.contiguous();  // its first column off a 16-byte boundary in the projection's rows
    }
  } else {
    // [3, B, H, S, dk]: read in place by the fused kernel; one copy makes q, k and v contiguous
    // batches of [S, dk] matrices for the products.
    at::Tensor qkv = proj.view({B, S, 3, H, dk}).permute({2, 0, 3, 1, 4});
    if (!fused) qkv = qkv.contiguous();
    q = qkv[0].narrow(2, 0, Sq);
    k = qkv[1];
    v = qkv[2];
    bias = mask_add;  // [B, 1, 1, S], or none (no padding)
    scale = 1.0 / std::sqrt(static_cast<double>(dk));
  }
  at::Tensor ctx;  // [B, H, Sq, w_v]
#if COLLABSERVE_HAVE_SDPA
  if (fused) {
    // One kernel (flash attention without a bias, memory-efficient attention with one): the
    // scores are never written to memory. Keys and values are read in place from the
    // projection, whose rows are whole 64-byte lines (CollaborativeProjectionWidth). SDPA picks
    // its kernel by the current device's properties: on cuda:N, the model's GPU made current
    // whichever the thread's is (ATen's kernels themselves launch on their tensors' device).
    const c10::DeviceGuard on_device(q.device());
    ctx = bias.defined() ? at::scaled_dot_product_attention(q, k, v, bias.contiguous(), 0.0, false, scale)
                         : at::scaled_dot_product_attention(q, k, v, {}, 0.0, false, scale);
  }
#endif
  if (!ctx.defined()) {
    at::Tensor scores = at::matmul(q, k.transpose(-1, -2));  // [B, H, Sq, S]
    if (scale != 1.0) scores.mul_(scale);
    if (bias.defined()) scores.add_(bias);
    ctx = at::matmul(at::_softmax(scores, -1, false), v);
  }
  if (fold) {
    ctx = ctx.narrow(3, 0, dk) / ctx.narrow(3, dk, 1);
  } else if (ctx.size(3) != dk) {
    ctx = ctx.narrow(3, 0, dk);
  }
  // [B, H, Sq, dk] -> [B, Sq, H, dk] = [B·Sq, D].
  return ctx.transpose(1, 2).reshape({B * Sq, D});
}

}  // namespace collabserve::model::internal
