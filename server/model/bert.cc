#include "server/model/bert.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "server/model/kernels.h"

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

// oneDNN's row-major SGEMM (dnnl_sgemm, oneDNN >= 1.0), looked up at run time in the libraries
// already loaded: Debian's LibTorch links libdnnl.so.2. Against OpenBLAS 0.3.21 (what at::addmm
// calls there) it saves 5-15% of the CPU time of a BERT-base pass at batch 1-8 (OpenBLAS spends
// most of a skinny product packing the weight), and it lets attention run fused per head
// (FusedAttention). When the symbol is absent (a LibTorch that hides its oneDNN) or
// COLLABSERVE_GEMM=aten, everything goes through ATen ops instead.
using SgemmFn = int (*)(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha,
                        const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                        float* c, int64_t ldc);

GemmMode ChosenGemmMode() {
  static const GemmMode mode = [] {
    const char* choice = std::getenv("COLLABSERVE_GEMM");
    if (choice == nullptr || *choice == '\0') return GemmMode::kHybrid;
    if (std::strcmp(choice, "aten") == 0) return GemmMode::kAten;
    if (std::strcmp(choice, "dnnl") == 0) return GemmMode::kDnnl;
    if (std::strcmp(choice, "packed") == 0) return GemmMode::kPacked;
    return GemmMode::kHybrid;
  }();
  return mode;
}

SgemmFn FindSgemm() {
  static const SgemmFn fn = [] {
    if (ChosenGemmMode() == GemmMode::kAten) return SgemmFn(nullptr);
    return reinterpret_cast<SgemmFn>(dlsym(RTLD_DEFAULT, "dnnl_sgemm"));
  }();
  return fn;
}

bool UsePacking(const c10::Device& device, c10::ScalarType dtype) {
  const GemmMode mode = ChosenGemmMode();
  return device.is_cpu() && dtype == at::kFloat && PackedLinearSupported() &&
         (mode == GemmMode::kHybrid || mode == GemmMode::kPacked);
}

// out[T, N] += x[T, K] · w[N, K]^T, in place (out holds the bias, or bias + residual).
void GemmAccumulate(at::Tensor& out, const at::Tensor& x, const at::Tensor& w) {
  SgemmFn sgemm = FindSgemm();
  if (sgemm != nullptr && out.is_cpu() && out.scalar_type() == at::kFloat &&
      x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.is_contiguous() &&
      w.is_contiguous() && out.is_contiguous()) {
    const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
    int status = sgemm('N', 'T', T, N, K, 1.0f, x.data_ptr<float>(), K, w.data_ptr<float>(), K, 1.0f,
                       out.data_ptr<float>(), N);
    TORCH_CHECK(status == 0, "dnnl_sgemm failed with status ", status, " for [", T, ", ", K,
                "] x [", N, ", ", K, "]^T");
    return;
  }
  at::addmm_out(out, out, x, w.t());
}

// x[T, K] · w[N, K]^T + b (+ residual[T, N]) as one pre-filled output and one accumulating GEMM,
// or, with a packed weight and few enough rows, one PackedLinear that writes each output once.
at::Tensor Dense(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                 const PackedWeight* packed, const at::Tensor& residual = at::Tensor()) {
  const int64_t T = x.size(0), N = w.size(0);
  if (packed != nullptr && x.is_contiguous() &&
      (ChosenGemmMode() == GemmMode::kPacked || T <= kPackedMaxRows || FindSgemm() == nullptr)) {
    at::Tensor out = at::empty({T, N}, x.options());
    at::Tensor r = residual.defined() ? residual.contiguous() : residual;
    PackedLinear(x.data_ptr<float>(), x.size(1), T, *packed, b.data_ptr<float>(),
                 r.defined() ? r.data_ptr<float>() : nullptr, N, out.data_ptr<float>(), N);
    return out;
  }
  at::Tensor out = residual.defined() ? at::add(residual, b)
                                      : b.unsqueeze(0).expand({T, N}).contiguous();
  GemmAccumulate(out, x, w);
  return out;
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

// Standard self-attention for one layer, fused per (sequence, head): q, k and v are read in place
// from the projection proj [B·S, 3D] (rows [q/sqrt(dk) | k | v], heads side by side), the [S, S]
// scores stay in cache through mask and softmax, and the context is written straight into its
// [B·S, D] slot. Needs the sgemm; returns ctx [B·S, D].
at::Tensor FusedAttention(SgemmFn sgemm, const at::Tensor& proj, const at::Tensor& mask_add,
                          int64_t B, int64_t S, int64_t H, int64_t dk) {
  const int64_t D = H * dk, ld = 3 * D;
  at::Tensor ctx = at::empty({B * S, D}, proj.options());
  const float* p = proj.data_ptr<float>();
  float* c = ctx.data_ptr<float>();
  const float* mask = mask_add.defined() ? mask_add.data_ptr<float>() : nullptr;  // [B, S]
  // Each task owns whole (b, h) slices; inside at::parallel_for the sgemm and softmax run on the
  // calling thread.
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    at::Tensor scores = at::empty({S, S}, proj.options());
    float* sc = scores.data_ptr<float>();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, h = i % H;
      const float* q = p + b * S * ld + h * dk;
      const float* k = q + D;
      const float* v = q + 2 * D;
      int st = sgemm('N', 'T', S, S, dk, 1.0f, q, ld, k, ld, 0.0f, sc, S);
      TORCH_CHECK(st == 0, "dnnl_sgemm (attention scores) failed with status ", st);
      if (mask != nullptr) {
        const float* m = mask + b * S;
        for (int64_t r = 0; r < S; ++r) {
          float* row = sc + r * S;
          for (int64_t j = 0; j < S; ++j) row[j] += m[j];
        }
      }
      at::_softmax_out(scores, scores, -1, false);
      st = sgemm('N', 'N', S, dk, S, 1.0f, sc, S, v, ld, 0.0f, c + b * S * D + h * dk, D);
      TORCH_CHECK(st == 0, "dnnl_sgemm (attention context) failed with status ", st);
    }
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
  device_ = device;
  dtype_ = dtype;
  auto mv = [&](at::Tensor& t) {
    if (t.defined()) t = t.to(device, dtype).contiguous();
  };
  for (at::Tensor* t : {&word_emb_, &pos_emb_, &type_emb_, &emb_ln_w_, &emb_ln_b_, &pooler_w_,
                        &pooler_b_, &cls_w_, &cls_b_}) {
    mv(*t);
  }
  const int64_t H = config_.num_attention_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(config_.head_size()));
  for (EncoderLayer& l : layers_) {
    for (at::Tensor* t : {&l.query_w, &l.query_b, &l.key_w, &l.key_b, &l.collab_query_w,
                          &l.collab_key_w, &l.mixing, &l.content_bias, &l.value_w, &l.value_b,
                          &l.attn_out_w, &l.attn_out_b, &l.attn_ln_w, &l.attn_ln_b, &l.inter_w,
                          &l.inter_b, &l.out_w, &l.out_b, &l.out_ln_w, &l.out_ln_b}) {
      mv(*t);
    }
    if (l.collaborative) {
      auto zeros = at::zeros({2 * l.rank}, l.value_b.options());
      auto zeros_h = at::zeros({H}, l.value_b.options());
      l.fused_w = at::cat({l.collab_query_w, l.collab_key_w, l.value_w, l.content_bias}, 0).contiguous();
      l.fused_b = at::cat({zeros, l.value_b, zeros_h}, 0).contiguous();
      l.mixing_4d = l.mixing.view({1, H, 1, l.rank}).contiguous();
    } else {
      // Fold the 1/sqrt(d_k) score scale into the query projection.
      l.fused_w = at::cat({l.query_w * scale, l.key_w, l.value_w}, 0).contiguous();
      l.fused_b = at::cat({l.query_b * scale, l.key_b, l.value_b}, 0).contiguous();
    }
    l.fused_p = l.attn_out_p = l.inter_p = l.out_p = nullptr;
    if (pack_weights && UsePacking(device, dtype)) {
      l.fused_p = std::make_shared<const PackedWeight>(l.fused_w);
      l.attn_out_p = std::make_shared<const PackedWeight>(l.attn_out_w);
      l.inter_p = std::make_shared<const PackedWeight>(l.inter_w);
      l.out_p = std::make_shared<const PackedWeight>(l.out_w);
    }
  }
}

// In place: x is a temporary.
at::Tensor BertClassifier::Activation(const at::Tensor& x) const {
  at::Tensor y = x;
  switch (config_.hidden_act) {
    case Activation::kGelu: return at::gelu_(y);
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
// folded into the GEMM's output (Dense).
at::Tensor BertClassifier::Layer(const EncoderLayer& l, const at::Tensor& h,
                                 const at::Tensor& mask_add) const {
  const int64_t B = h.size(0), S = h.size(1), D = config_.hidden_size, T = B * S;
  const int64_t H = config_.num_attention_heads, dk = config_.head_size();
  const at::Tensor h2 = h.view({T, D});
  at::Tensor proj = Dense(h2, l.fused_w, l.fused_b, l.fused_p.get());  // [T, *]
  at::Tensor ctx;
  SgemmFn sgemm = FindSgemm();
  if (!l.collaborative && sgemm != nullptr && proj.scalar_type() == at::kFloat && proj.is_cpu()) {
    at::Tensor mask2;
    if (mask_add.defined()) mask2 = mask_add.view({B, S}).contiguous();
    ctx = FusedAttention(sgemm, proj, mask2, B, S, H, dk);
  } else {
    ctx = Attention(l, proj, mask_add, B, S);
  }
  auto h1 = LayerNormInPlace(Dense(ctx, l.attn_out_w, l.attn_out_b, l.attn_out_p.get(), h2),
                             l.attn_ln_w, l.attn_ln_b, config_.layer_norm_eps);
  auto inter = Activation(Dense(h1, l.inter_w, l.inter_b, l.inter_p.get()));
  auto out = Dense(inter, l.out_w, l.out_b, l.out_p.get(), h1);
  return LayerNormInPlace(out, l.out_ln_w, l.out_ln_b, config_.layer_norm_eps).view({B, S, D});
}

// Self-attention with ATen ops (collaborative layers, and standard ones without the sgemm):
// proj [B·S, *] -> ctx [B·S, D].
at::Tensor BertClassifier::Attention(const EncoderLayer& l, const at::Tensor& proj,
                                     const at::Tensor& mask_add, int64_t B, int64_t S) const {
  const int64_t D = config_.hidden_size, T = B * S;
  const int64_t H = config_.num_attention_heads, dk = config_.head_size();
  at::Tensor scores, v;
  if (l.collaborative) {
    const int64_t R = l.rank;
    auto p3 = proj.view({B, S, -1});
    auto qc = p3.narrow(2, 0, R).unsqueeze(1);                 // [B, 1, S, R]
    auto kc = p3.narrow(2, R, R).unsqueeze(1);                 // [B, 1, S, R]
    v = p3.narrow(2, 2 * R, D).view({B, S, H, dk}).transpose(1, 2);
    auto content = p3.narrow(2, 2 * R + D, H).transpose(1, 2).unsqueeze(2);  // [B, H, 1, S]
    scores = at::matmul(qc * l.mixing_4d, kc.transpose(-1, -2));             // [B, H, S, S]
    scores.add_(content);
  } else {
    // One copy to [3, B, H, S, dk] makes q, k and v contiguous batches of [S, dk] matrices.
    auto qkv = proj.view({B, S, 3, H, dk}).permute({2, 0, 3, 1, 4}).contiguous().view({3, B * H, S, dk});
    scores = at::bmm(qkv[0], qkv[1].transpose(1, 2)).view({B, H, S, S});
    v = qkv[2].view({B, H, S, dk});
  }
  if (mask_add.defined()) scores.add_(mask_add);
  auto probs = at::_softmax(scores, -1, false);
  // [B, H, S, dk] -> [B, S, H, dk] = [T, D].
  return at::matmul(probs, v).transpose(1, 2).reshape({T, D});
}

at::Tensor BertClassifier::EncoderOutput(const at::Tensor& input_ids,
                                         const at::Tensor& token_type_ids,
                                         const at::Tensor& attention_mask) const {
  auto ids = input_ids.to(device_);
  auto types = token_type_ids.to(device_);
  at::Tensor mask_add;
  if (attention_mask.defined()) {
    // HF: (1 - mask) * finfo(dtype).min, broadcast over heads and query positions.
    auto m = attention_mask.to(device_).to(dtype_).view({ids.size(0), 1, 1, ids.size(1)});
    double lowest = dtype_ == c10::kHalf       ? -65504.0
                    : dtype_ == c10::kBFloat16 ? -3.3895313892515355e38
                                               : static_cast<double>(std::numeric_limits<float>::lowest());
    mask_add = (1.0 - m) * lowest;
  }
  auto h = Embed(ids, types);
  for (const EncoderLayer& l : layers_) h = Layer(l, h, mask_add);
  return h;
}

at::Tensor BertClassifier::Forward(const at::Tensor& input_ids, const at::Tensor& token_type_ids,
                                   const at::Tensor& attention_mask) const {
  auto h = EncoderOutput(input_ids, token_type_ids, attention_mask);
  auto pooled = at::tanh(at::linear(h.select(1, 0), pooler_w_, pooler_b_));
  return at::linear(pooled, cls_w_, cls_b_).to(at::kCPU, at::kFloat);
}

}  // namespace collabserve::model
