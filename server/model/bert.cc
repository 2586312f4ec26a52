// BertClassifier: the parameter tree, Prepare, and the forward pass. Which path runs a pass:
//  - the ThreadTeam path (encoder_team.cc): a CPU float32 pass with more than one thread, and
//    oneDNN's sgemm or (where LibTorch hides it) packed weights and AVX-512, runs every layer in one
//    team run, standard and collaborative layers alike;
//  - the per-operation path (Layer, below): the other CPU float32 passes (one thread, a caller
//    already in a parallel region, d_k not a multiple of 16, more tokens than
//    COLLABSERVE_TEAM_MAX_ROWS), one parallel region per operation, on the same kernels
//    (attention_ops.h, dense_ops.h);
//  - ATen ops (Layer with AtenAttention, at::linear): CUDA, float16 / bfloat16,
//    COLLABSERVE_GEMM=aten, or a CPU with neither the sgemm nor AVX-512.
// Every path computes the same function (engine_reference_test checks each against the Python
// reference).
#include "server/model/bert.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <sanitizer/asan_interface.h>

#include <algorithm>
#include <array>
#include <vector>

#include "server/model/attention_ops.h"
#include "server/model/dense_ops.h"
#include "server/model/kernels.h"

namespace collabserve::model {

using internal::AtenAttention;
using internal::AttentionLayout;
using internal::CollaborativeProjectionWidth;
using internal::Dense;
using internal::FindSgemm;
using internal::FusedAttention;
using internal::FusedAttentionAvailable;
using internal::LayerNormInPlace;
using internal::LayoutOf;
using internal::Project;
using internal::ProjectAndAttend;
using internal::SgemmFn;
using internal::UsePacking;
using internal::UsePackedLinear;

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
  KeepSmallTensorsTogether();
}

namespace {

// The dense weights of layer l that Prepare packs (and, when it packs, drops): first the three its
// fused projection stacks, in order ([query; key; value], or [W~Q^T; W~K^T; value]), then the
// attention-output and FFN weights. Layer: EncoderLayer or const EncoderLayer.
template <typename Layer>
auto PackedWeightsOf(Layer& l) {
  using Ptr = decltype(&l.value_w);
  return l.collaborative
             ? std::array<Ptr, 6>{&l.collab_query_w, &l.collab_key_w, &l.value_w, &l.attn_out_w, &l.inter_w, &l.out_w}
             : std::array<Ptr, 6>{&l.query_w, &l.key_w, &l.value_w, &l.attn_out_w, &l.inter_w, &l.out_w};
}

}  // namespace

bool BertClassifier::PackedOnPrepare(const at::Tensor& param) const {
  for (const EncoderLayer& l : layers_) {
    for (const at::Tensor* t : PackedWeightsOf(l)) {
      if (t->defined() && t->is_same(param)) return true;
    }
  }
  return false;
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
  const int64_t H = config_.num_attention_heads, D = config_.hidden_size;
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
    // (Pointers into one array, not a vector assigned in each branch: GCC 12 warned of a null
    // argument, -Wnonnull, inside the vector's assignment.)
    const std::array<at::Tensor*, 6> dense = PackedWeightsOf(l);
    const std::array<at::Tensor*, 3> sections = {dense[0], dense[1], dense[2]};
    std::vector<at::Tensor> biases;
    // Collaborative: the projection's row is CollaborativeProjectionWidth wide (the content scores
    // and padding after the fused columns), and so is the bias (zeros there).
    const int64_t width = l.collaborative ? CollaborativeProjectionWidth(l.rank, D, H) : 3 * D;
    if (l.collaborative) {
      auto zeros = at::zeros({l.rank}, l.value_b.options());
      biases = {zeros, zeros, l.value_b, at::zeros({width - 2 * l.rank - D}, l.value_b.options())};
    } else {
      biases = {l.query_b, l.key_b, l.value_b};
    }
    // Into the place the constructor kept for it (same size), while it is of this device and type.
    if (l.fused_b.defined() && l.fused_b.device() == l.value_b.device() &&
        l.fused_b.scalar_type() == l.value_b.scalar_type()) {
      at::cat_out(l.fused_b, biases, 0);
    } else {
      l.fused_b = at::cat(biases, 0);
    }
    std::vector<at::Tensor*> rows(sections.begin(), sections.end());
    std::vector<at::Tensor> parts;
    for (at::Tensor* t : rows) parts.push_back(*t);
    // Unpacked, a collaborative layer's fused weight also holds the content vectors and zero rows
    // up to the row width, so that one product (Project's ATen path: CUDA, half types) writes the
    // whole projection. Packed, it holds the fused columns alone (PackedLinear would pad the H
    // content rows to a whole panel; NarrowProduct computes them from content_bias).
    if (l.collaborative && !pack) {
      rows.push_back(&l.content_bias);
      parts.push_back(l.content_bias);
      parts.push_back(at::zeros({width - 2 * l.rank - D - H, D}, l.content_bias.options()));
    }
    at::Tensor fused = at::cat(parts, 0);
    l.fused = l.attn_out = l.inter = l.out = l.content = DenseWeight();
    if (pack) {
      l.fused.packed = std::make_shared<const PackedWeight>(fused);
      l.attn_out.packed = std::make_shared<const PackedWeight>(l.attn_out_w);
      l.inter.packed = std::make_shared<const PackedWeight>(l.inter_w);
      l.out.packed = std::make_shared<const PackedWeight>(l.out_w);
      for (at::Tensor* t : dense) release(*t);
      weights_released_ = true;
    } else {
      // The sections become views of the fused weight: one copy of each.
      int64_t row = 0;
      for (at::Tensor* t : rows) {
        const int64_t n = t->size(0);
        t->set_data(fused.narrow(0, row, n));
        row += n;
      }
      l.fused.plain = fused;
      l.attn_out.plain = l.attn_out_w;
      l.inter.plain = l.inter_w;
      l.out.plain = l.out_w;
    }
    if (l.collaborative) l.content.plain = l.content_bias;
  }
}

// The small tensors (48 B to 36 KiB, ~14 a layer: biases, LayerNorm, mixing, content vectors,
// and the fused biases Prepare fills) take their places in one mapping before anything is loaded
// into them. Each in the allocator would take a size class (36 KiB takes 40, 9 KiB takes 10), and
// those tails were most of what a collaborative model kept resident beyond its parameters (~110
// KiB at D~=384, whose parameter saving is 26.4 MiB); moved there after loading, the originals
// left holes in the allocator's pages. Here each sits at a 64-byte boundary and the whole takes
// its bytes rounded up to a page once. The embedding tables and the pooler (0.6 to 89 MiB, whole
// size classes or close) stay where they are.
void BertClassifier::KeepSmallTensorsTogether() {
  const int64_t D = config_.hidden_size, H = config_.num_attention_heads;
  for (EncoderLayer& l : layers_) {
    l.fused_b = torch::empty({l.collaborative ? CollaborativeProjectionWidth(l.rank, D, H) : 3 * D});
  }
  std::vector<at::Tensor*> small = {&emb_ln_w_, &emb_ln_b_, &type_emb_, &pooler_b_, &cls_w_, &cls_b_};
  for (EncoderLayer& l : layers_) {
    for (at::Tensor* t : {&l.query_b, &l.key_b, &l.value_b, &l.mixing, &l.content_bias, &l.fused_b,
                          &l.attn_out_b, &l.attn_ln_w, &l.attn_ln_b, &l.inter_b, &l.out_b,
                          &l.out_ln_w, &l.out_ln_b}) {
      if (t->defined() && t->numel() > 0) small.push_back(t);
    }
  }
  constexpr int64_t kAlign = 16;  // floats: 64 bytes
  // Under ASan, 64 poisoned bytes after each tensor, so that reading past one is still caught as it
  // was in an allocation of its own.
#if defined(__SANITIZE_ADDRESS__)
  constexpr int64_t kRedZone = 16;
#else
  constexpr int64_t kRedZone = 0;
#endif
  auto padded = [](const at::Tensor* t) { return (t->numel() + kAlign - 1) / kAlign * kAlign + kRedZone; };
  int64_t total = 0;
  for (const at::Tensor* t : small) total += padded(t);
  const at::Tensor block = PagesOfItsOwn(total, at::TensorOptions().dtype(at::kFloat), /*populate=*/true);
  int64_t offset = 0;
  for (at::Tensor* t : small) {
    t->set_data(block.narrow(0, offset, t->numel()).view(t->sizes()));
    ASAN_POISON_MEMORY_REGION(t->data_ptr<float>() + t->numel(), (padded(t) - t->numel()) * sizeof(float));
    offset += padded(t);
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
  const bool fused_attention = FusedAttentionAvailable(sgemm) && h.scalar_type() == at::kFloat && h.is_cpu();
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
    ctx = AtenAttention(l, Project(nullptr, l, LayoutOf(l, H, dk), h2), mask_add, B, S, Sq, H, dk,
                        collab_attention_);
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
  std::vector<at::Tensor> out;
  out.reserve(layers_.size());
  at::Tensor h = Embeddings(input_ids, token_type_ids).contiguous();
  // The mask once for every layer (on a GPU its copy there waits for the queue).
  const at::Tensor mask_add = MaskAdd(attention_mask, h.size(0), h.size(1));
  for (size_t i = 0; i < layers_.size(); ++i) {
    out.push_back(h);
    // The last layer's output enters no layer: not computed (1/L of the pass).
    if (i + 1 < layers_.size()) h = Layer(layers_[i], h, mask_add, /*cls_only=*/false);
  }
  return out;
}

at::Tensor BertClassifier::Embeddings(const at::Tensor& input_ids, const at::Tensor& token_type_ids) const {
  return Embed(input_ids.to(device_), token_type_ids.to(device_));
}

at::Tensor BertClassifier::RunLayers(size_t first, size_t last, const at::Tensor& h,
                                     const at::Tensor& attention_mask) const {
  TORCH_CHECK(first <= last && last <= layers_.size(), "RunLayers: layers [", first, ", ", last,
              ") of a model of ", layers_.size());
  const at::Tensor mask_add = MaskAdd(attention_mask, h.size(0), h.size(1));
  at::Tensor x = h.contiguous();
  for (size_t i = first; i < last; ++i) x = Layer(layers_[i], x, mask_add, /*cls_only=*/false);
  return x;
}

at::Tensor BertClassifier::LogitsFrom(size_t first, const at::Tensor& h, const at::Tensor& attention_mask) const {
  TORCH_CHECK(first <= layers_.size(), "LogitsFrom: layer ", first, " of a model of ", layers_.size());
  const at::Tensor mask_add = MaskAdd(attention_mask, h.size(0), h.size(1));
  at::Tensor x = h.contiguous();
  for (size_t i = first; i < layers_.size(); ++i) x = Layer(layers_[i], x, mask_add, i + 1 == layers_.size());
  return Classify(x.select(1, 0)).to(at::kCPU, at::kFloat);
}

at::Tensor BertClassifier::MaskAdd(const at::Tensor& attention_mask, int64_t B, int64_t S) const {
  if (!attention_mask.defined()) return at::Tensor();
  // No padding: no mask (it would add zeros), as Hugging Face's SDPA attention drops it; on CUDA
  // that lets the flash-attention kernel run. Checked where the tokenizer built the mask, on its
  // values in place: no operator that reads a value back (aten::item), which on a device would wait
  // for it (tests/model/op_profile_test.cc).
  if (attention_mask.is_cpu()) {
    const at::Tensor m = attention_mask.to(at::kLong).contiguous();
    const int64_t* p = m.data_ptr<int64_t>();
    if (std::all_of(p, p + m.numel(), [](int64_t v) { return v == 1; })) return at::Tensor();
  }
  // HF: (1 - mask) * finfo(dtype).min, broadcast over heads and query positions.
  auto m = attention_mask.to(device_).to(dtype_).view({B, 1, 1, S});
  return (1.0 - m) * internal::LowestValue(dtype_);
}

at::Tensor BertClassifier::Forward(const at::Tensor& input_ids, const at::Tensor& token_type_ids,
                                   const at::Tensor& attention_mask) const {
  return DeviceLogits(input_ids, token_type_ids, attention_mask).to(at::kCPU, at::kFloat);
}

at::Tensor BertClassifier::DeviceLogits(const at::Tensor& input_ids, const at::Tensor& token_type_ids,
                                        const at::Tensor& attention_mask) const {
  // The pooler reads the [CLS] position alone, so the last layer computes only that one (its keys
  // and values still for every position): 1/12 of BERT-base's work at 16-128 tokens.
  auto h = Encode(input_ids, token_type_ids, attention_mask, /*cls_only=*/true);
  return Classify(h.select(1, 0));  // [B, D]: the [CLS] position
}

at::Tensor BertClassifier::Classify(const at::Tensor& first) const {
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
  return at::linear(pooled, cls_w_, cls_b_);
}

}  // namespace collabserve::model

