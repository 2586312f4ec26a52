#include "server/model/bert.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "server/model/kernels.h"
#include "server/util/process_env.h"

namespace collabserve::model {
namespace {

// How the CPU float32 dense layers run. kPacked: PackedLinear (weights packed at load, AVX-512)
// for up to kPackedMaxRows tokens, where oneDNN's sgemm spends much of a skinny product packing the
// weight (1.5-2x the GFLOP/s at 16 rows, on par at 128); dnnl_sgemm above that, where its own
// blocking beats ours. kDnnl: dnnl_sgemm for every size (the engine before PackedLinear).
// kAten: at::addmm and ATen attention everywhere. COLLABSERVE_GEMM=aten|dnnl|packed chooses;
// "packed" uses PackedLinear at every size (tests, benchmarks).
enum class GemmMode { kAten, kDnnl, kHybrid, kPacked };
constexpr int64_t kPackedMaxRows = 256;

// Up to this many tokens per pass the encoder runs in one ThreadTeam run (EncodeOnTeam); above,
// the per-operation path. No limit unless COLLABSERVE_TEAM_MAX_ROWS=N sets one (A/B measurements:
// 256 gives the engine before the team served long passes).
int64_t TeamMaxRows() {
  static const int64_t rows = util::EnvInt64("COLLABSERVE_TEAM_MAX_ROWS", int64_t{1} << 40);
  return rows;
}

// oneDNN's row-major SGEMM (dnnl_sgemm, oneDNN >= 1.0), looked up at run time in the libraries
// already loaded: Debian's LibTorch links libdnnl.so.2. Against OpenBLAS 0.3.21 (what at::addmm
// calls there) it saves 5-15% of the CPU time of a BERT-base pass at batch 1-8 (OpenBLAS spends
// most of a skinny product packing the weight), and it lets attention run fused per head
// (FusedAttention). When the symbol is absent (a LibTorch that hides its oneDNN) or
// COLLABSERVE_GEMM=aten, everything goes through ATen ops instead.
using SgemmFn = util::DnnlSgemmFn;

GemmMode ChosenGemmMode() {
  static const GemmMode mode = [] {
    const std::string choice = util::EnvString("COLLABSERVE_GEMM");
    if (choice == "aten") return GemmMode::kAten;
    if (choice == "dnnl") return GemmMode::kDnnl;
    if (choice == "packed") return GemmMode::kPacked;
    return GemmMode::kHybrid;
  }();
  return mode;
}

SgemmFn FindSgemm() {
  static const SgemmFn fn = [] {
    if (ChosenGemmMode() == GemmMode::kAten) return SgemmFn(nullptr);
    return util::DnnlSgemm();
  }();
  return fn;
}

bool UsePacking(const c10::Device& device, c10::ScalarType dtype) {
  const GemmMode mode = ChosenGemmMode();
  return device.is_cpu() && dtype == at::kFloat && PackedLinearSupported() &&
         (mode == GemmMode::kHybrid || mode == GemmMode::kPacked);
}

// Columns per block when the sgemm runs on a weight kept only packed: the block is unpacked into
// a per-thread buffer (K × 512 floats, 1.5-6 MB for BERT-base) right before its product, which
// reads it from cache. Wide enough that re-reading x once per block costs little next to the
// product itself.
constexpr int64_t kUnpackColumns = 512;

// out[:, n0:n1] += x[rows, K] · w[n0:n1, :]^T on the sgemm (one call per its threads, or a
// single-threaded one inside a ThreadTeam run): on the plain weight when the model has it, else on
// blocks of columns unpacked from the packed copy. n0 a multiple of PackedWeight::kPanel.
void SgemmAccumulate(SgemmFn sgemm, const float* x, int64_t ldx, int64_t rows, const DenseWeight& w,
                     float* out, int64_t ldo, int64_t n0, int64_t n1) {
  if (n1 <= n0 || rows == 0) return;
  if (w.plain.defined()) {
    const int64_t K = w.plain.size(1);
    const int st = sgemm('N', 'T', rows, n1 - n0, K, 1.0f, x, ldx, w.plain.data_ptr<float>() + n0 * K,
                         K, 1.0f, out + n0, ldo);
    TORCH_CHECK(st == 0, "dnnl_sgemm failed with status ", st, " for [", rows, ", ", K, "] x [",
                n1 - n0, ", ", K, "]^T");
    return;
  }
  TORCH_CHECK(w.packed != nullptr, "a dense weight has neither its plain nor its packed form");
  const PackedWeight& p = *w.packed;
  const int64_t K = p.k();
  thread_local std::vector<float> block;
  for (int64_t c0 = n0; c0 < n1; c0 += kUnpackColumns) {
    const int64_t c1 = std::min(n1, c0 + kUnpackColumns), n = c1 - c0;
    if (block.size() < static_cast<size_t>(K * n)) block.resize(K * n);
    p.UnpackColumns(c0, c1, block.data());
    const int st = sgemm('N', 'N', rows, n, K, 1.0f, x, ldx, block.data(), n, 1.0f, out + c0, ldo);
    TORCH_CHECK(st == 0, "dnnl_sgemm failed with status ", st, " for [", rows, ", ", K, "] x [", K,
                ", ", n, "]");
  }
}

// out[T, N] += x[T, K] · w[N, K]^T, in place (out holds the bias, or bias + residual).
void GemmAccumulate(at::Tensor& out, const at::Tensor& x, const DenseWeight& w) {
  SgemmFn sgemm = FindSgemm();
  if (sgemm != nullptr && out.is_cpu() && out.scalar_type() == at::kFloat &&
      x.scalar_type() == at::kFloat && x.is_contiguous() && out.is_contiguous() &&
      (!w.plain.defined() || (w.plain.scalar_type() == at::kFloat && w.plain.is_contiguous()))) {
    SgemmAccumulate(sgemm, x.data_ptr<float>(), x.size(1), x.size(0), w, out.data_ptr<float>(),
                    out.size(1), 0, out.size(1));
    return;
  }
  TORCH_CHECK(w.plain.defined(), "a dense weight kept only packed needs the sgemm");
  at::addmm_out(out, out, x, w.plain.t());
}

// Whether a product of `rows` rows with this packed weight (null: none) runs on PackedLinear.
bool UsePackedLinear(const PackedWeight* packed, int64_t rows) {
  return packed != nullptr &&
         (ChosenGemmMode() == GemmMode::kPacked || rows <= kPackedMaxRows || FindSgemm() == nullptr);
}
bool UsePackedLinear(const DenseWeight& w, int64_t rows) { return UsePackedLinear(w.packed.get(), rows); }

// x[T, K] · w[N, K]^T + b (+ residual[T, N]) as one pre-filled output and one accumulating GEMM,
// or, with a packed weight and few enough rows, one PackedLinear that writes each output once.
at::Tensor Dense(const at::Tensor& x, const DenseWeight& w, const at::Tensor& b,
                 const at::Tensor& residual = at::Tensor()) {
  const int64_t T = x.size(0), N = b.size(0);
  if (UsePackedLinear(w, T) && x.is_contiguous()) {
    at::Tensor out = at::empty({T, N}, x.options());
    at::Tensor r = residual.defined() ? residual.contiguous() : residual;
    PackedLinear(x.data_ptr<float>(), x.size(1), T, *w.packed, b.data_ptr<float>(),
                 r.defined() ? r.data_ptr<float>() : nullptr, N, out.data_ptr<float>(), N);
    return out;
  }
  // clone, not contiguous(): for T = 1 the expanded bias is already contiguous, and contiguous()
  // would return the bias parameter itself, which the accumulating GEMM then overwrote.
  at::Tensor out = residual.defined() ? at::add(residual, b)
                                      : b.unsqueeze(0).expand({T, N}).clone(at::MemoryFormat::Contiguous);
  GemmAccumulate(out, x.contiguous(), w);
  return out;
}

// out[:, n0:n1] = x · w[n0:n1, :]^T + bias[n0:n1] (+ residual[:, n0:n1]) on the calling thread:
// PackedLinearColumns when `packed` (w has its packed form), else the bias (+ residual) written
// first and the accumulating sgemm over those columns (inside a ThreadTeam run it is
// single-threaded). n0, n1 multiples of PackedWeight::kPanel (or n1 = N).
void DenseColumns(SgemmFn sgemm, const float* x, int64_t ldx, int64_t rows, const DenseWeight& w,
                  bool packed, const float* bias, const float* residual, int64_t ldr, float* out,
                  int64_t ldo, int64_t n0, int64_t n1) {
  if (n1 <= n0) return;
  if (packed) {
    PackedLinearColumns(x, ldx, rows, *w.packed, bias, residual, ldr, out, ldo, n0, n1);
    return;
  }
  const int64_t n = n1 - n0;
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * ldo + n0;
    if (residual != nullptr) {
      const float* res = residual + r * ldr + n0;
      for (int64_t j = 0; j < n; ++j) o[j] = res[j] + bias[n0 + j];
    } else {
      std::memcpy(o, bias + n0, n * sizeof(float));
    }
  }
  SgemmAccumulate(sgemm, x, ldx, rows, w, out, ldo, n0, n1);
}

// LayerNorm over the last dimension of x [T, D], in place on the CPU (x is a temporary).
at::Tensor LayerNormInPlace(at::Tensor x, const at::Tensor& w, const at::Tensor& b, double eps) {
  if (x.is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2 &&
      w.is_contiguous() && b.is_contiguous()) {
    LayerNormRowsInPlace(x.data_ptr<float>(), x.size(1), x.size(0), x.size(1), w.data_ptr<float>(),
                         b.data_ptr<float>(), eps);
    return x;
  }
  return at::layer_norm(x, {x.size(-1)}, w, b, eps);
}

// Up to this many positions a head's attention runs on SmallAttention (registers only) instead
// of two sgemm calls and an ATen softmax, whose fixed costs dominate short sequences. Default
// kSmallAttentionMaxS; COLLABSERVE_SMALL_ATTENTION_MAX_S=N lowers it (0: off; A/B measurements).
int64_t SmallAttentionMaxS() {
  static const int64_t s = util::EnvInt64("COLLABSERVE_SMALL_ATTENTION_MAX_S", kSmallAttentionMaxS);
  return s;
}

// Where a layer's attention operands sit in a row of its fused projection (EncoderLayer::fused),
// and how its scores are formed (AttentionHead): one description for standard and collaborative
// layers, so that both run on the same kernels.
struct AttentionLayout {
  int64_t ld = 0;     // floats per projection row
  int64_t fused_n = 0;  // columns the fused product writes (then the content scores, if any)
  int64_t width = 0;  // score width: d_k, or the collaborative rank R
  int64_t dk = 0;     // value width
  int64_t q0 = 0, k0 = 0, v0 = 0;  // columns of head 0's query, key and value
  int64_t head_step = 0;           // query/key column step per head: d_k, or 0 (shared)
  int64_t content0 = -1;           // column of head 0's content score, or -1 (standard)
  const float* mixing = nullptr;   // [H, R] (collaborative), 1/sqrt(d_k) folded in
  float scale = 1.0f;
};

// Scratch for AttendOneHead with S positions and scores `width` wide: the [S, S] scores, the mixed
// queries [S, width] and S key terms. Allocated per parallel region (not kept per thread), so a
// served model holds nothing between calls.
at::Tensor AttentionScratch(int64_t S, int64_t width, const at::TensorOptions& options) {
  return at::empty({S * S + S * width + S}, options);
}

AttentionLayout LayoutOf(const EncoderLayer& l, int64_t H, int64_t dk) {
  const int64_t D = H * dk;
  AttentionLayout a;
  a.dk = dk;
  if (l.collaborative) {
    const int64_t R = l.rank;
    a.ld = 2 * R + D + H;
    a.fused_n = 2 * R + D;
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

// One (sequence b, head h) of self-attention for the queries at the first Sq positions (Sq = S,
// or 1 for [CLS] alone): q, k and v read in place from the projection p (rows of L.ld floats;
// only the first Sq rows of a sequence's queries are read), the context written into its slot of
// ctx [B·Sq, D]. Short sequences run on SmallAttention; longer ones compute the [Sq, S] scores
// with the sgemm (cache-resident through mask and softmax), a collaborative head's mixing applied
// to a copy of its queries as it is formed (never a [B, H, S, R] tensor). scratch:
// AttentionScratch(S, L.width) or larger. Runs on the calling thread (inside a parallel region the
// sgemm and softmax do).
void AttendOneHead(SgemmFn sgemm, const float* p, const AttentionLayout& L, const float* mask,
                   int64_t b, int64_t h, int64_t S, int64_t Sq, int64_t D, at::Tensor& scratch,
                   float* ctx) {
  const int64_t ld = L.ld, dk = L.dk, width = L.width;
  const float* row0 = p + b * S * ld;
  const float* q = row0 + L.q0 + h * L.head_step;
  const float* k = row0 + L.k0 + h * L.head_step;
  const float* v = row0 + L.v0 + h * dk;
  float* out = ctx + b * Sq * D + h * dk;
  const float* m = mask != nullptr ? mask + b * S : nullptr;
  float* sc = scratch.data_ptr<float>();
  float* mixed = sc + S * S;
  float* add = mixed + S * width;
  // The additive term of each key: the padding mask, plus the head's content score.
  const float* key_add = m;
  if (L.content0 >= 0) {
    const float* c = row0 + L.content0 + h;
    for (int64_t j = 0; j < S; ++j) add[j] = c[j * ld] + (m != nullptr ? m[j] : 0.0f);
    key_add = add;
  }
  const float* mix = L.mixing != nullptr ? L.mixing + h * width : nullptr;
  if (S <= SmallAttentionMaxS() && SmallAttentionSupported(S, dk)) {
    AttentionHead a;
    a.q = q;
    a.k = k;
    a.v = v;
    a.ldq = a.ldk = a.ldv = ld;
    a.width = width;
    a.dv = dk;
    a.key_factor = mix;
    a.scale = L.scale;
    a.key_add = key_add;
    SmallAttention(a, S, Sq, out, D);
    return;
  }
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
  at::Tensor sq = scratch.narrow(0, 0, Sq * S).view({Sq, S});
  int st = sgemm('N', 'T', Sq, S, width, L.scale, qa, lda, k, ld, 0.0f, sc, S);
  TORCH_CHECK(st == 0, "dnnl_sgemm (attention scores) failed with status ", st);
  if (key_add != nullptr) {
    for (int64_t r = 0; r < Sq; ++r) {
      float* row = sc + r * S;
      for (int64_t j = 0; j < S; ++j) row[j] += key_add[j];
    }
  }
  at::_softmax_out(sq, sq, -1, false);
  st = sgemm('N', 'N', Sq, dk, S, 1.0f, sc, S, v, ld, 0.0f, out, D);
  TORCH_CHECK(st == 0, "dnnl_sgemm (attention context) failed with status ", st);
}

// Self-attention for one layer, fused per (sequence, head) (AttendOneHead) and split over threads
// by (sequence, head); proj [B·S, L.ld] -> ctx [B·Sq, D] (the queries at the first Sq positions of
// each sequence). Needs the sgemm.
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
    at::Tensor scratch = AttentionScratch(S, L.width, proj.options());
    for (int64_t i = begin; i < end; ++i) {
      AttendOneHead(sgemm, p, L, mask, i / H, i % H, S, Sq, D, scratch, c);
    }
  });
  return ctx;
}

// A collaborative layer's content scores for the rows [r0, r1) of x (leading dimension ldx) into
// their columns of proj (rows of L.ld): x · content_bias^T, on the calling thread's sgemm.
void ContentScores(SgemmFn sgemm, const EncoderLayer& l, const AttentionLayout& L, const float* x,
                   int64_t ldx, int64_t r0, int64_t r1, float* proj) {
  if (r1 <= r0) return;
  DenseColumns(sgemm, x + r0 * ldx, ldx, r1 - r0, l.content, /*packed=*/false,
               l.fused_b.data_ptr<float>() + L.fused_n, nullptr, 0, proj + r0 * L.ld + L.fused_n, L.ld,
               0, L.ld - L.fused_n);
}

// The input projection of layer l for x [T, D], [T, L.ld]: the fused product and, for a
// collaborative layer, its content scores beside it.
at::Tensor Project(SgemmFn sgemm, const EncoderLayer& l, const AttentionLayout& L, const at::Tensor& x) {
  if (!l.collaborative) return Dense(x, l.fused, l.fused_b);
  if (sgemm == nullptr || !x.is_cpu() || x.scalar_type() != at::kFloat) {
    return at::cat({at::linear(x, l.fused.plain, l.fused_b.narrow(0, 0, L.fused_n)),
                    at::linear(x, l.content.plain)}, 1);
  }
  const at::Tensor xc = x.contiguous();
  const int64_t T = xc.size(0), D = xc.size(1);
  at::Tensor proj = at::empty({T, L.ld}, x.options());
  float* p = proj.data_ptr<float>();
  const float* b = l.fused_b.data_ptr<float>();
  if (UsePackedLinear(l.fused, T)) {
    PackedLinear(xc.data_ptr<float>(), D, T, *l.fused.packed, b, nullptr, 0, p, L.ld);
  } else {
    DenseColumns(sgemm, xc.data_ptr<float>(), D, T, l.fused, false, b, nullptr, 0, p, L.ld, 0, L.fused_n);
  }
  ContentScores(sgemm, l, L, xc.data_ptr<float>(), D, 0, T, p);
  return proj;
}

// Heads [h0, h1) of a standard layer, on the calling thread: their q, k and v columns of the
// fused projection into proj [B·S, 3D] (whole panels when dk is a multiple of the panel width),
// then their attention for every sequence into ctx [B·Sq, D]. Keys and values are projected for
// every row; queries for every row when Sq = S, or with Sq = 1 (the [CLS] queries alone) for x's
// rows b·S only, a matrix of B rows with leading dimension S·D, into proj's rows b·S. x: [B·S, D];
// x_packed: the same rows already packed (PackRows) for PackedLinearColumnsPacked, or null;
// packed: run on w's packed form (else the sgemm); scratch: AttentionScratch(S, L.width).
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
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t b = 0; b < B; ++b) {
      AttendOneHead(sgemm, proj, L, mask, b, h, S, Sq, D, scratch, ctx);
    }
  }
}

// The q/k/v projection and the attention of a standard layer in one parallel region, split by
// head (ProjectAndAttendHeads), so no thread waits for another between the two. For token counts
// where PackedLinear runs (the pass is short and a thread wake-up per operation is a visible
// cost). x [B·S, D] -> ctx [B·Sq, D]; Sq = S, or 1 for the [CLS] queries alone.
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
    at::Tensor scratch = AttentionScratch(S, L.width, x.options());
    ProjectAndAttendHeads(sgemm, x.data_ptr<float>(), nullptr, l.fused, /*packed=*/true,
                          l.fused_b.data_ptr<float>(), L, mask, B, S, Sq, D, h0, h1, scratch,
                          proj.data_ptr<float>(), ctx.data_ptr<float>());
  });
  return ctx;
}

}  // namespace

at::Tensor& ParamNode::Add(const std::string& name, std::vector<int64_t> shape) {
  return register_parameter(name, torch::empty(shape), /*requires_grad=*/false);
}

std::shared_ptr<ParamNode> ParamNode::Child(const std::string& name) {
  return register_module(name, std::make_shared<ParamNode>());
}

BertClassifier::BertClassifier(const BertConfig& c) : config_(c) {
  const int64_t D = c.hidden_size, H = c.num_attention_heads, F = c.intermediate_size;
  auto bert = Child("bert");
  auto emb = bert->Child("embeddings");
  word_emb_ = emb->Child("word_embeddings")->Add("weight", {c.vocab_size, D});
  pos_emb_ = emb->Child("position_embeddings")->Add("weight", {c.max_position_embeddings, D});
  type_emb_ = emb->Child("token_type_embeddings")->Add("weight", {c.type_vocab_size, D});
  auto eln = emb->Child("LayerNorm");
  emb_ln_w_ = eln->Add("weight", {D});
  emb_ln_b_ = eln->Add("bias", {D});

  auto encoder = bert->Child("encoder");
  auto layer_list = encoder->Child("layer");
  layers_.resize(c.num_hidden_layers);
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    EncoderLayer& l = layers_[i];
    auto layer = layer_list->Child(std::to_string(i));
    auto attention = layer->Child("attention");
    auto self = attention->Child("self");
    int rank = c.collaborative.present() ? c.collaborative.ranks[i] : 0;
    if (rank > 0) {
      l.collaborative = true;
      l.rank = rank;
      l.collab_query_w = self->Child("collab_query")->Add("weight", {rank, D});
      l.collab_key_w = self->Child("collab_key")->Add("weight", {rank, D});
      l.mixing = self->Add("mixing", {H, rank});
      l.content_bias = self->Add("content_bias", {H, D});
    } else {
      auto q = self->Child("query");
      l.query_w = q->Add("weight", {D, D});
      l.query_b = q->Add("bias", {D});
      auto k = self->Child("key");
      l.key_w = k->Add("weight", {D, D});
      l.key_b = k->Add("bias", {D});
    }
    auto v = self->Child("value");
    l.value_w = v->Add("weight", {D, D});
    l.value_b = v->Add("bias", {D});
    auto aout = attention->Child("output");
    auto aout_dense = aout->Child("dense");
    l.attn_out_w = aout_dense->Add("weight", {D, D});
    l.attn_out_b = aout_dense->Add("bias", {D});
    auto aln = aout->Child("LayerNorm");
    l.attn_ln_w = aln->Add("weight", {D});
    l.attn_ln_b = aln->Add("bias", {D});
    auto inter = layer->Child("intermediate")->Child("dense");
    l.inter_w = inter->Add("weight", {F, D});
    l.inter_b = inter->Add("bias", {F});
    auto out = layer->Child("output");
    auto out_dense = out->Child("dense");
    l.out_w = out_dense->Add("weight", {D, F});
    l.out_b = out_dense->Add("bias", {D});
    auto oln = out->Child("LayerNorm");
    l.out_ln_w = oln->Add("weight", {D});
    l.out_ln_b = oln->Add("bias", {D});
  }
  auto pooler = bert->Child("pooler")->Child("dense");
  pooler_w_ = pooler->Add("weight", {D, D});
  pooler_b_ = pooler->Add("bias", {D});
  auto cls = Child("classifier");
  cls_w_ = cls->Add("weight", {c.num_labels(), D});
  cls_b_ = cls->Add("bias", {c.num_labels()});
}

void BertClassifier::Prepare(const c10::Device& device, c10::ScalarType dtype, bool pack_weights) {
  // The tensors built here are parameters (or views of them), never inference tensors, whatever
  // mode the caller is in: set_data needs that.
  c10::InferenceMode normal_tensors(false);
  device_ = device;
  dtype_ = dtype;
  // In place (set_data): the module's own tensors and the layers' handles are one TensorImpl, so
  // named_parameters() follows and no copy stays behind on the CPU after a move to a GPU.
  auto mv = [&](at::Tensor& t) {
    if (!t.defined()) return;
    at::Tensor moved = t.to(device, dtype).contiguous();
    if (!moved.is_same(t)) t.set_data(moved);
  };
  for (at::Tensor* t : {&word_emb_, &pos_emb_, &type_emb_, &emb_ln_w_, &emb_ln_b_, &pooler_w_,
                        &pooler_b_, &cls_w_, &cls_b_}) {
    mv(*t);
  }
  const int64_t H = config_.num_attention_heads;
  const bool pack = pack_weights && UsePacking(device, dtype);
  // A dropped parameter keeps its handle (and name) but no storage.
  auto release = [](at::Tensor& t) { t.set_data(at::empty({0}, t.options())); };
  for (EncoderLayer& l : layers_) {
    for (at::Tensor* t : {&l.query_w, &l.query_b, &l.key_w, &l.key_b, &l.collab_query_w,
                          &l.collab_key_w, &l.mixing, &l.content_bias, &l.value_w, &l.value_b,
                          &l.attn_out_w, &l.attn_out_b, &l.attn_ln_w, &l.attn_ln_b, &l.inter_w,
                          &l.inter_b, &l.out_w, &l.out_b, &l.out_ln_w, &l.out_ln_b}) {
      mv(*t);
    }
    std::vector<at::Tensor*> sections;
    if (l.collaborative) {
      sections = {&l.collab_query_w, &l.collab_key_w, &l.value_w};
      auto zeros = at::zeros({l.rank}, l.value_b.options());
      l.fused_b = at::cat({zeros, zeros, l.value_b, at::zeros({H}, l.value_b.options())}, 0);
    } else {
      sections = {&l.query_w, &l.key_w, &l.value_w};
      l.fused_b = at::cat({l.query_b, l.key_b, l.value_b}, 0);
    }
    std::vector<at::Tensor> parts;
    for (at::Tensor* t : sections) parts.push_back(*t);
    at::Tensor fused = at::cat(parts, 0);
    l.fused = l.attn_out = l.inter = l.out = l.content = DenseWeight();
    if (l.collaborative) l.content.plain = l.content_bias;
    if (pack) {
      l.fused.packed = std::make_shared<const PackedWeight>(fused);
      l.attn_out.packed = std::make_shared<const PackedWeight>(l.attn_out_w);
      l.inter.packed = std::make_shared<const PackedWeight>(l.inter_w);
      l.out.packed = std::make_shared<const PackedWeight>(l.out_w);
      for (at::Tensor* t : sections) release(*t);
      for (at::Tensor* t : {&l.attn_out_w, &l.inter_w, &l.out_w}) release(*t);
      weights_released_ = true;
    } else {
      // The sections become views of the fused weight: one copy of each.
      int64_t row = 0;
      for (at::Tensor* t : sections) {
        const int64_t n = t->size(0);
        t->set_data(fused.narrow(0, row, n));
        row += n;
      }
      l.fused.plain = fused;
      l.attn_out.plain = l.attn_out_w;
      l.inter.plain = l.inter_w;
      l.out.plain = l.out_w;
    }
  }
}

// In place: x is a temporary (any view of one, e.g. some rows or columns of the FFN output). The
// exact-erf GELU of a float32 CPU matrix whose rows are contiguous runs GeluRowsInPlace over the
// rows (in parallel outside a parallel region): ATen's CPU GELU runs Sleef's AVX2 erf here (6% of an
// 8 × 16 pass in a profile); ours runs 16 lanes at a time on the same Abramowitz-Stegun formula.
at::Tensor BertClassifier::Activation(const at::Tensor& x) const {
  at::Tensor y = x;
  switch (config_.hidden_act) {
    case Activation::kGelu:
      if (PackedLinearSupported() && y.is_cpu() && y.scalar_type() == at::kFloat && y.dim() == 2 &&
          y.stride(1) == 1 && y.stride(0) >= y.size(1)) {
        const int64_t rows = y.size(0), cols = y.size(1), ld = y.stride(0);
        float* p = y.data_ptr<float>();
        at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, cols)),
                         [&](int64_t r0, int64_t r1) { GeluRowsInPlace(p + r0 * ld, ld, r1 - r0, 0, cols); });
        return y;
      }
      return at::gelu_(y);
    case Activation::kGeluNew:
    case Activation::kGeluPytorchTanh: return at::gelu_(y, "tanh");
    case Activation::kRelu: return at::relu_(y);
  }
  return at::gelu_(y);
}

at::Tensor BertClassifier::Embed(const at::Tensor& ids, const at::Tensor& types) const {
  const int64_t S = ids.size(1);
  auto h = at::embedding(word_emb_, ids);
  h.add_(pos_emb_.narrow(0, 0, S).unsqueeze(0));
  h.add_(at::embedding(type_emb_, types));
  return at::layer_norm(h, {config_.hidden_size}, emb_ln_w_, emb_ln_b_, config_.layer_norm_eps);
}

// h: [B, S, D] contiguous. Every projection runs on the [B·S, D] view; biases and residuals are
// folded into the GEMM's output (Dense). cls_only: only the [CLS] position's output is wanted (the
// last layer of a classifier): the keys and values are projected for every position, the queries
// and everything after the attention for position 0 alone; returns [B, 1, D].
at::Tensor BertClassifier::Layer(const EncoderLayer& l, const at::Tensor& h,
                                 const at::Tensor& mask_add, bool cls_only) const {
  const int64_t B = h.size(0), S = h.size(1), D = config_.hidden_size, T = B * S;
  const int64_t H = config_.num_attention_heads, dk = config_.head_size();
  const int64_t Sq = cls_only ? 1 : S, Tq = B * Sq;
  const at::Tensor h2 = h.view({T, D});
  // The rows the rest of the layer works on (and adds back as the residual).
  const at::Tensor hq = cls_only ? h.select(1, 0) : h2;
  at::Tensor ctx;
  SgemmFn sgemm = FindSgemm();
  const bool fused_attention = sgemm != nullptr && h.scalar_type() == at::kFloat && h.is_cpu();
  at::Tensor mask2;
  if (fused_attention && mask_add.defined()) mask2 = mask_add.view({B, S}).contiguous();
  if (fused_attention) {
    const AttentionLayout L = LayoutOf(l, H, dk);
    if (!l.collaborative && UsePackedLinear(l.fused, T) && dk % PackedWeight::kPanel == 0 &&
        h2.is_contiguous()) {
      ctx = ProjectAndAttend(sgemm, h2, l, L, mask2, B, S, Sq, H);
    } else {
      ctx = FusedAttention(sgemm, Project(sgemm, l, L, h2), L, mask2, B, S, Sq, H);
    }
  } else {
    ctx = Attention(l, Project(nullptr, l, LayoutOf(l, H, dk), h2), mask_add, B, S, Sq);
  }
  auto h1 = LayerNormInPlace(Dense(ctx, l.attn_out, l.attn_out_b, hq), l.attn_ln_w, l.attn_ln_b,
                             config_.layer_norm_eps);
  at::Tensor inter;
  if (UsePackedLinear(l.inter, Tq) && h1.is_contiguous()) {
    // The intermediate projection and its activation in one parallel region: each thread applies
    // the activation to the columns it has just computed (still in cache; no second wake-up).
    const PackedWeight& w = *l.inter.packed;
    const int64_t F = w.n();
    inter = at::empty({Tq, F}, h1.options());
    const bool inference = c10::InferenceMode::is_enabled();
    at::parallel_for(0, w.panels(), PanelGrain(w, Tq), [&](int64_t p0, int64_t p1) {
      c10::InferenceMode guard(inference);  // not inherited by OpenMP workers
      const int64_t n0 = p0 * PackedWeight::kPanel, n1 = std::min(F, p1 * PackedWeight::kPanel);
      PackedLinearColumns(h1.data_ptr<float>(), D, Tq, w, l.inter_b.data_ptr<float>(), nullptr, 0,
                          inter.data_ptr<float>(), F, n0, n1);
      Activation(inter.narrow(1, n0, n1 - n0));
    });
  } else {
    inter = Activation(Dense(h1, l.inter, l.inter_b));
  }
  auto out = Dense(inter, l.out, l.out_b, h1);
  return LayerNormInPlace(out, l.out_ln_w, l.out_ln_b, config_.layer_norm_eps).view({B, Sq, D});
}

// The whole encoder in one ThreadTeam run, standard and collaborative layers alike, with the
// sgemm. Short passes: each parallel ATen/OpenMP op would wake the other threads and let them go
// back to sleep (dozens of times per pass at batch 1). Long passes (above kPackedMaxRows tokens,
// the products on oneDNN's sgemm): oneDNN's own 2-thread split of one product left a core idle
// (CPU 147-166% of 2 cores); here every member runs a single-threaded sgemm on its own share.
// Member t of n takes, per layer, up to kPackedMaxRows tokens: the q/k/v columns and attention of
// heads [t·H/n, (t+1)·H/n) (no wait between the two, as in ProjectAndAttend); 1/n of the output
// projection's panels (+ residual); 1/n of the rows of the LayerNorm; 1/n of the intermediate
// panels and their activation; 1/n of the output panels (+ residual); 1/n of the rows of the
// LayerNorm; with a barrier after each. Above: the same with 1/n of the rows of every product
// (all columns), and a barrier between the q/k/v product and the attention, which is split by
// (sequence, head). A collaborative layer's heads share its query/key projections, so it always
// has the barrier: first 1/n of the fused projection (panels, or rows above kPackedMaxRows), then
// its heads' attention (by head when prepacked, else by (sequence, head)); the rest of the layer
// as a standard one's. Every element is computed by the same kernels as on the per-operation path
// (PackedLinear bit for bit; the sgemm's blocking may differ with the shape it is given).
// cls_only: the last layer as in Layer(..., cls_only): keys and values for every row, the rest
// for the B [CLS] rows (x's rows b·S: leading dimension S·D), and h becomes [B, 1, D].
bool BertClassifier::EncodeOnTeam(at::Tensor& h, const at::Tensor& mask_add, bool cls_only) const {
  const int n = at::get_num_threads();
  const int64_t B = h.size(0), S = h.size(1), D = config_.hidden_size, T = B * S;
  const int64_t H = config_.num_attention_heads, dk = config_.head_size();
  const int64_t F = config_.intermediate_size;
  SgemmFn sgemm = FindSgemm();
  if (n <= 1 || at::in_parallel_region() || sgemm == nullptr || !h.is_cpu() ||
      h.scalar_type() != at::kFloat || T > TeamMaxRows() || dk % PackedWeight::kPanel != 0) {
    return false;
  }
  // Each layer's layout; the widest projection row and score width size the shared buffers.
  std::vector<AttentionLayout> layouts;
  int64_t proj_ld = 0, width = 0;
  for (const EncoderLayer& l : layers_) {
    layouts.push_back(LayoutOf(l, H, dk));
    proj_ld = std::max(proj_ld, layouts.back().ld);
    width = std::max(width, layouts.back().width);
  }
  at::Tensor mask2;
  if (mask_add.defined()) mask2 = mask_add.view({B, S}).contiguous();
  const float* mask = mask2.defined() ? mask2.data_ptr<float>() : nullptr;
  at::Tensor cur = h.contiguous().view({T, D});
  at::Tensor proj = at::empty({T, proj_ld}, cur.options());
  at::Tensor ctx = at::empty({T, D}, cur.options());
  at::Tensor mid = at::empty({T, D}, cur.options());
  at::Tensor inter = at::empty({T, F}, cur.options());
  at::Tensor next = at::empty({T, D}, cur.options());
  const float eps = static_cast<float>(config_.layer_norm_eps);
  // [begin, end) of `count` units for member t of n, in whole multiples of `unit`.
  auto share = [](int64_t count, int64_t unit, int t, int n) {
    const int64_t units = (count + unit - 1) / unit;
    const int64_t b = units * t / n, e = units * (t + 1) / n;
    return std::make_pair(std::min(count, b * unit), std::min(count, e * unit));
  };
  // Per layer: the query positions per sequence (Sq), the rows after the attention (Tq = B·Sq) and
  // the leading dimension of those rows in the layer's input x (the residual).
  const size_t L = layers_.size();
  auto queries = [&](size_t li) { return cls_only && li + 1 == L ? int64_t{1} : S; };
  // Above kPackedMaxRows tokens the products run on the sgemm, each member on its share of the
  // rows (and all columns): each packs the whole weight but only its rows of x, and the rows of x
  // (up to 16384 × 3072 floats here) outgrow the weight. Splitting the columns instead (each member
  // reading all of x) was slower there (8 × 512: 2.07 vs 2.27 seq/s, 32 × 512: 2.17 vs 2.72).
  const bool split_rows = T > kPackedMaxRows;
  // When every product runs on PackedLinear, each activation a product reads is packed once, by
  // the members together, in the step that produces it (each its rows after a LayerNorm, or its
  // columns = k range after the q/k/v + attention and the intermediate product), instead of by
  // every member inside each of its products (three times per layer for the q/k/v parts).
  bool prepacked = !split_rows;
  for (const EncoderLayer& l : layers_) {
    for (const DenseWeight* w : {&l.fused, &l.attn_out, &l.inter, &l.out}) {
      prepacked = prepacked && UsePackedLinear(*w, T);
    }
  }
  at::Tensor xpack, cpack, ipack;  // packed rows of the layer input / mid, of ctx, of inter
  if (prepacked) {
    xpack = at::empty({PackedRowsSize(T, D)}, cur.options());
    cpack = at::empty({PackedRowsSize(T, D)}, cur.options());
    ipack = at::empty({PackedRowsSize(T, F)}, cur.options());
  }
  const bool ran = ThreadTeam::Shared().TryRun(n, [&](int t, int n) {
    ThreadTeam& team = ThreadTeam::Shared();
    at::Tensor scores = AttentionScratch(S, width, cur.options());
    at::Tensor x = cur, y = next;  // this layer's input and output (swapped after each layer)
    if (prepacked) {
      const std::pair<int64_t, int64_t> rows = share(T, kPackedRowTile, t, n);
      team.Step([&] {
        PackRows(cur.data_ptr<float>(), D, rows.first, rows.second, 0, D, D, xpack.data_ptr<float>());
      });
    }
    for (size_t li = 0; li < L; ++li) {
      const EncoderLayer& l = layers_[li];
      const AttentionLayout& La = layouts[li];
      const float* xp = x.data_ptr<float>();
      const int64_t Sq = queries(li), Tq = B * Sq, ldq = Sq == S ? D : S * D;
      if (prepacked) {
        // (Plain variables, not structured bindings: C++17 lambdas cannot capture those.)
        int64_t h0, h1, r0, r1, d0, d1, f0, f1;
        std::tie(h0, h1) = share(H, 1, t, n);
        std::tie(r0, r1) = share(Tq, kPackedRowTile, t, n);
        std::tie(d0, d1) = share(D, PackedWeight::kPanel, t, n);
        std::tie(f0, f1) = share(F, PackedWeight::kPanel, t, n);
        float* xk = xpack.data_ptr<float>();
        float* ck = cpack.data_ptr<float>();
        float* ik = ipack.data_ptr<float>();
        if (l.collaborative) {
          // The shared query/key projections serve every head: all of the fused projection
          // first (each member its panels), then each member its heads' attention.
          int64_t c0, c1, q0, q1;
          std::tie(c0, c1) = share(La.fused_n, PackedWeight::kPanel, t, n);
          std::tie(q0, q1) = share(T, 1, t, n);
          team.Step([&] {
            PackedLinearColumnsPacked(xk, T, *l.fused.packed, l.fused_b.data_ptr<float>(), nullptr, 0,
                                      proj.data_ptr<float>(), La.ld, c0, c1);
            ContentScores(sgemm, l, La, xp, D, q0, q1, proj.data_ptr<float>());
          });
          team.Step([&] {
            for (int64_t hh = h0; hh < h1; ++hh) {
              for (int64_t b = 0; b < B; ++b) {
                AttendOneHead(sgemm, proj.data_ptr<float>(), La, mask, b, hh, S, Sq, D, scores,
                              ctx.data_ptr<float>());
              }
            }
            PackRows(ctx.data_ptr<float>(), D, 0, Tq, h0 * dk, h1 * dk, D, ck);
          });
        } else {
          team.Step([&] {
            ProjectAndAttendHeads(sgemm, xp, xk, l.fused, /*packed=*/true, l.fused_b.data_ptr<float>(),
                                  La, mask, B, S, Sq, D, h0, h1, scores, proj.data_ptr<float>(),
                                  ctx.data_ptr<float>());
            PackRows(ctx.data_ptr<float>(), D, 0, Tq, h0 * dk, h1 * dk, D, ck);
          });
        }
        team.Step([&] {
          PackedLinearColumnsPacked(ck, Tq, *l.attn_out.packed, l.attn_out_b.data_ptr<float>(), xp, ldq,
                                    mid.data_ptr<float>(), D, d0, d1);
        });
        team.Step([&] {
          LayerNormRowsInPlace(mid.data_ptr<float>() + r0 * D, D, r1 - r0, D,
                               l.attn_ln_w.data_ptr<float>(), l.attn_ln_b.data_ptr<float>(), eps);
          PackRows(mid.data_ptr<float>(), D, r0, r1, 0, D, D, xk);
        });
        team.Step([&] {
          PackedLinearColumnsPacked(xk, Tq, *l.inter.packed, l.inter_b.data_ptr<float>(), nullptr, 0,
                                    inter.data_ptr<float>(), F, f0, f1);
          if (f1 > f0) Activation(inter.narrow(0, 0, Tq).narrow(1, f0, f1 - f0));
          PackRows(inter.data_ptr<float>(), F, 0, Tq, f0, f1, F, ik);
        });
        team.Step([&] {
          PackedLinearColumnsPacked(ik, Tq, *l.out.packed, l.out_b.data_ptr<float>(),
                                    mid.data_ptr<float>(), D, y.data_ptr<float>(), D, d0, d1);
        });
        const bool last = li + 1 == L;
        team.Step([&] {
          LayerNormRowsInPlace(y.data_ptr<float>() + r0 * D, D, r1 - r0, D,
                               l.out_ln_w.data_ptr<float>(), l.out_ln_b.data_ptr<float>(), eps);
          if (!last) PackRows(y.data_ptr<float>(), D, r0, r1, 0, D, D, xk);
        });
        std::swap(x, y);
        continue;
      }
      // The weights each product of `rows` rows runs on: packed where the per-operation path
      // would use PackedLinear, else the sgemm on the plain weight.
      auto pick = [&](const DenseWeight& w, int64_t rows) { return UsePackedLinear(w, rows); };
      // A product's output [rows, N] for member t: on the sgemm with many rows, its share of the
      // rows (each member packs the whole weight, but only its rows of x); otherwise its share of
      // the columns (whole panels). res: the residual, leading dimension ldr.
      // out: leading dimension ldo (0: N).
      auto product = [&](const float* in, int64_t ldx, int64_t rows, const DenseWeight& w, bool p,
                         const at::Tensor& bias, const float* res, int64_t ldr, float* out,
                         int64_t N, int64_t ldo = 0) {
        if (ldo == 0) ldo = N;
        if (!p && rows > kPackedMaxRows) {
          const auto [r0, r1] = share(rows, 1, t, n);
          if (r1 > r0) {
            DenseColumns(sgemm, in + r0 * ldx, ldx, r1 - r0, w, false, bias.data_ptr<float>(),
                         res == nullptr ? nullptr : res + r0 * ldr, ldr, out + r0 * ldo, ldo, 0, N);
          }
          return std::make_pair(r0, r1);
        }
        const auto [n0, n1] = share(N, PackedWeight::kPanel, t, n);
        DenseColumns(sgemm, in, ldx, rows, w, p, bias.data_ptr<float>(), res, ldr, out, ldo, n0, n1);
        return std::make_pair(int64_t{-1}, int64_t{-1});
      };
      const bool fused_packed = pick(l.fused, T);
      if (l.collaborative) {
        // Every row's shared query/key projections, values and content scores (each member its
        // share; a few [CLS]-only rows would save little), then attention by (sequence, head).
        team.Step([&] {
          product(xp, D, T, l.fused, fused_packed, l.fused_b, nullptr, 0, proj.data_ptr<float>(),
                  La.fused_n, La.ld);
          const auto [r0, r1] = share(T, 1, t, n);
          ContentScores(sgemm, l, La, xp, D, r0, r1, proj.data_ptr<float>());
        });
        team.Step([&] {
          const auto [u0, u1] = share(B * H, 1, t, n);
          for (int64_t u = u0; u < u1; ++u) {
            AttendOneHead(sgemm, proj.data_ptr<float>(), La, mask, u / H, u % H, S, Sq, D, scores,
                          ctx.data_ptr<float>());
          }
        });
      } else if (!fused_packed && split_rows) {
        team.Step([&] {
          if (Sq == S) {
            product(xp, D, T, l.fused, false, l.fused_b, nullptr, 0, proj.data_ptr<float>(), 3 * D);
            return;
          }
          // Keys and values of every row, queries of the [CLS] rows: each member its share of
          // both (rows of the sgemm).
          float* pr = proj.data_ptr<float>();
          const float* bias = l.fused_b.data_ptr<float>();
          const auto [r0, r1] = share(T, 1, t, n);
          if (r1 > r0) {
            DenseColumns(sgemm, xp + r0 * D, D, r1 - r0, l.fused, false, bias, nullptr, 0,
                         pr + r0 * 3 * D, 3 * D, D, 3 * D);
          }
          const auto [c0, c1] = share(B, 1, t, n);
          if (c1 > c0) {
            DenseColumns(sgemm, xp + c0 * ldq, ldq, c1 - c0, l.fused, false, bias, nullptr, 0,
                         pr + c0 * S * 3 * D, S * 3 * D, 0, D);
          }
        });
        team.Step([&] {
          const auto [u0, u1] = share(B * H, 1, t, n);
          for (int64_t u = u0; u < u1; ++u) {
            AttendOneHead(sgemm, proj.data_ptr<float>(), La, mask, u / H, u % H, S, Sq, D, scores,
                          ctx.data_ptr<float>());
          }
        });
      } else {
        team.Step([&] {
          const auto [h0, h1] = share(H, 1, t, n);
          ProjectAndAttendHeads(sgemm, xp, nullptr, l.fused, fused_packed, l.fused_b.data_ptr<float>(),
                                La, mask, B, S, Sq, D, h0, h1, scores, proj.data_ptr<float>(),
                                ctx.data_ptr<float>());
        });
      }
      team.Step([&] {
        product(ctx.data_ptr<float>(), D, Tq, l.attn_out, pick(l.attn_out, Tq), l.attn_out_b,
                xp, ldq, mid.data_ptr<float>(), D);
      });
      team.Step([&] {
        const auto [r0, r1] = share(Tq, 1, t, n);
        LayerNormRowsInPlace(mid.data_ptr<float>() + r0 * D, D, r1 - r0, D,
                            l.attn_ln_w.data_ptr<float>(), l.attn_ln_b.data_ptr<float>(), eps);
      });
      team.Step([&] {
        const auto [r0, r1] = product(mid.data_ptr<float>(), D, Tq, l.inter, pick(l.inter, Tq), l.inter_b,
                                      nullptr, 0, inter.data_ptr<float>(), F);
        if (r0 >= 0) {
          if (r1 > r0) Activation(inter.narrow(0, r0, r1 - r0));
        } else {
          const auto [n0, n1] = share(F, PackedWeight::kPanel, t, n);
          if (n1 > n0) Activation(inter.narrow(0, 0, Tq).narrow(1, n0, n1 - n0));
        }
      });
      team.Step([&] {
        product(inter.data_ptr<float>(), F, Tq, l.out, pick(l.out, Tq), l.out_b,
                mid.data_ptr<float>(), D, y.data_ptr<float>(), D);
      });
      team.Step([&] {
        const auto [r0, r1] = share(Tq, 1, t, n);
        LayerNormRowsInPlace(y.data_ptr<float>() + r0 * D, D, r1 - r0, D,
                            l.out_ln_w.data_ptr<float>(), l.out_ln_b.data_ptr<float>(), eps);
      });
      std::swap(x, y);
    }
  });
  if (!ran) return false;
  // After an even number of layers the result is back in `cur`'s buffer, else in `next`'s; with
  // cls_only, in its first B rows.
  const at::Tensor& out = L % 2 == 0 ? cur : next;
  h = cls_only && L > 0 ? out.narrow(0, 0, B).view({B, 1, D}) : out.view({B, S, D});
  return true;
}

// Self-attention with ATen ops (without the sgemm: CUDA, other dtypes, COLLABSERVE_GEMM=aten):
// proj [B·S, *] -> ctx [B·Sq, D], for the queries at the first Sq positions of each sequence.
at::Tensor BertClassifier::Attention(const EncoderLayer& l, const at::Tensor& proj,
                                     const at::Tensor& mask_add, int64_t B, int64_t S,
                                     int64_t Sq) const {
  const int64_t D = config_.hidden_size;
  const int64_t H = config_.num_attention_heads, dk = config_.head_size();
  at::Tensor scores, v;
  if (l.collaborative) {
    const int64_t R = l.rank;
    auto p3 = proj.view({B, S, -1});
    auto qc = p3.narrow(2, 0, R).narrow(1, 0, Sq).unsqueeze(1);  // [B, 1, Sq, R]
    auto kc = p3.narrow(2, R, R).unsqueeze(1);                    // [B, 1, S, R]
    v = p3.narrow(2, 2 * R, D).view({B, S, H, dk}).transpose(1, 2);
    auto content = p3.narrow(2, 2 * R + D, H).transpose(1, 2).unsqueeze(2);  // [B, H, 1, S]
    scores = at::matmul(qc * l.mixing.view({1, H, 1, R}), kc.transpose(-1, -2));  // [B, H, Sq, S]
    scores.add_(content);
  } else {
    // One copy to [3, B, H, S, dk] makes q, k and v contiguous batches of [S, dk] matrices.
    auto qkv = proj.view({B, S, 3, H, dk}).permute({2, 0, 3, 1, 4}).contiguous().view({3, B * H, S, dk});
    scores = at::bmm(qkv[0].narrow(1, 0, Sq), qkv[1].transpose(1, 2)).view({B, H, Sq, S});
    scores.mul_(1.0 / std::sqrt(static_cast<double>(dk)));
    v = qkv[2].view({B, H, S, dk});
  }
  if (mask_add.defined()) scores.add_(mask_add);
  auto probs = at::_softmax(scores, -1, false);
  // [B, H, Sq, dk] -> [B, Sq, H, dk] = [B·Sq, D].
  return at::matmul(probs, v).transpose(1, 2).reshape({B * Sq, D});
}

at::Tensor BertClassifier::EncoderOutput(const at::Tensor& input_ids,
                                         const at::Tensor& token_type_ids,
                                         const at::Tensor& attention_mask) const {
  return Encode(input_ids, token_type_ids, attention_mask, /*cls_only=*/false);
}

at::Tensor BertClassifier::Encode(const at::Tensor& input_ids, const at::Tensor& token_type_ids,
                                  const at::Tensor& attention_mask, bool cls_only) const {
  auto ids = input_ids.to(device_);
  auto types = token_type_ids.to(device_);
  const at::Tensor mask_add = MaskAdd(attention_mask, ids.size(0), ids.size(1));
  auto h = Embed(ids, types);
  if (EncodeOnTeam(h, mask_add, cls_only)) return h;
  for (size_t i = 0; i < layers_.size(); ++i) {
    h = Layer(layers_[i], h, mask_add, cls_only && i + 1 == layers_.size());
  }
  return h;
}

std::vector<at::Tensor> BertClassifier::LayerInputs(const at::Tensor& input_ids,
                                                    const at::Tensor& token_type_ids,
                                                    const at::Tensor& attention_mask) const {
  auto ids = input_ids.to(device_);
  const at::Tensor mask_add = MaskAdd(attention_mask, ids.size(0), ids.size(1));
  std::vector<at::Tensor> out;
  out.reserve(layers_.size());
  at::Tensor h = Embed(ids, token_type_ids.to(device_));
  for (const EncoderLayer& l : layers_) {
    out.push_back(h);
    h = Layer(l, h, mask_add, /*cls_only=*/false);
  }
  return out;
}

at::Tensor BertClassifier::MaskAdd(const at::Tensor& attention_mask, int64_t B, int64_t S) const {
  if (!attention_mask.defined()) return at::Tensor();
  // HF: (1 - mask) * finfo(dtype).min, broadcast over heads and query positions.
  auto m = attention_mask.to(device_).to(dtype_).view({B, 1, 1, S});
  double lowest = dtype_ == c10::kHalf       ? -65504.0
                  : dtype_ == c10::kBFloat16 ? -3.3895313892515355e38
                                             : static_cast<double>(std::numeric_limits<float>::lowest());
  return (1.0 - m) * lowest;
}

at::Tensor BertClassifier::Forward(const at::Tensor& input_ids, const at::Tensor& token_type_ids,
                                   const at::Tensor& attention_mask) const {
  // The pooler reads the [CLS] position alone, so the last layer computes only that one (its keys
  // and values still for every position): 1/12 of BERT-base's work at 16-128 tokens.
  auto h = Encode(input_ids, token_type_ids, attention_mask, /*cls_only=*/true);
  const at::Tensor first = h.select(1, 0);  // [B, D]: the [CLS] position
  if (FindSgemm() != nullptr && first.is_cpu() && first.scalar_type() == at::kFloat) {
    // Pooler and classifier on oneDNN's sgemm (OpenMP: its idle workers sleep, as
    // OMP_WAIT_POLICY=PASSIVE asks), not at::linear: ATen's addmm is OpenBLAS here, whose pool
    // wakes for a product of a few rows and then spin-yields (~0.1 s), i.e. through the whole
    // next pass, on one of the cores the pass's ThreadTeam runs on (a third thread at 6.7% of an
    // 8 × 16 pass's samples, and the team members waited for each other at their barriers).
    at::Tensor pooled = Dense(first.contiguous(), DenseWeight{pooler_w_, nullptr}, pooler_b_);
    pooled.tanh_();
    return Dense(pooled, DenseWeight{cls_w_, nullptr}, cls_b_);
  }
  auto pooled = at::tanh(at::linear(first, pooler_w_, pooler_b_));
  return at::linear(pooled, cls_w_, cls_b_).to(at::kCPU, at::kFloat);
}

}  // namespace collabserve::model
