// BertForSequenceClassification in LibTorch, eval mode, with standard or collaborative
// self-attention per layer. Parameter names equal the Hugging Face checkpoint keys
// (`bert.encoder.layer.3.attention.self.query.weight`, `classifier.bias`, ...), so
// named_parameters() is the checkpoint's key set with no mapping table.
//
// Collaborative layers (Cordonnier et al. 2020) replace `query` and `key` by
//   attention.self.collab_query.weight  [R, D]   W~_Q transposed (nn.Linear layout [out, in])
//   attention.self.collab_key.weight    [R, D]   W~_K transposed
//   attention.self.mixing               [H, R]   M, with the original 1/sqrt(d_k) folded in
//   attention.self.content_bias         [H, D]   v_i = W_K^(i) b_Q^(i), with 1/sqrt(d_k) folded in
// and compute score_i(n, m) = (x_n W~_Q) diag(m_i) (W~_K^T y_m) + v_i^T y_m. The key bias is
// dropped: it adds x_n W_Q^(i) b_K^(i) + b_Q^(i)·b_K^(i), a constant for each query row n, which the
// softmax over m cancels. Value and output projections are unchanged.
#ifndef COLLABSERVE_SERVER_MODEL_BERT_H_
#define COLLABSERVE_SERVER_MODEL_BERT_H_

#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

#include "server/model/collab_attention.h"
#include "server/model/config.h"

namespace collabserve::model {

class PackedWeight;  // server/model/kernels.h

// A node in the parameter tree: exists only to give parameters their Hugging Face names.
class ParamNode : public torch::nn::Module {
 public:
  using torch::nn::Module::register_module;
  using torch::nn::Module::register_parameter;
  at::Tensor& Add(const std::string& name, std::vector<int64_t> shape);
  std::shared_ptr<ParamNode> Child(const std::string& name);
};

// A dense layer's weight [N, K] (nn.Linear layout) in the forms the forward pass reads: `plain`,
// and `packed` for PackedLinear (CPU float32 on an AVX-512 CPU). A model prepared for serving
// keeps only the packed form (plain undefined): products too large for PackedLinear run the
// sgemm on blocks of columns unpacked on the fly, so the weights are resident once.
struct DenseWeight {
  at::Tensor plain;
  std::shared_ptr<const PackedWeight> packed;
};

// One encoder layer's tensors (references into the parameter tree) plus the fused forms built by
// BertClassifier::Prepare.
struct EncoderLayer {
  bool collaborative = false;
  int rank = 0;  // collaborative only
  // Standard attention.
  at::Tensor query_w, query_b, key_w, key_b;
  // Collaborative attention.
  at::Tensor collab_query_w, collab_key_w, mixing, content_bias;
  at::Tensor value_w, value_b;
  at::Tensor attn_out_w, attn_out_b, attn_ln_w, attn_ln_b;
  at::Tensor inter_w, inter_b, out_w, out_b, out_ln_w, out_ln_b;
  // The input projection as one product, its rows the parameters stacked (exactly: no scale is
  // folded in): standard [3D, D] = [query; key; value]; collaborative packed [2R + D, D] =
  // [W~Q^T; W~K^T; value], and plain [W, D] = [W~Q^T; W~K^T; value; content_bias; zeros] (W =
  // internal::CollaborativeProjectionWidth, 2R + D + H rounded up to 16: one product writes a
  // whole projection row). fused_b: its bias, then (collaborative) zeros up to W.
  DenseWeight fused;
  at::Tensor fused_b;
  // Collaborative: content_bias [H, D], always plain (H rows: packing would pad them to a whole
  // panel; unpacked, a view of the fused weight's rows), its product x · content_bias^T the
  // content scores v_i·y, H columns beside the fused product's.
  DenseWeight content;
  // The other three dense weights (plain: the parameters themselves, until a served model drops
  // them).
  DenseWeight attn_out, inter, out;
};

class BertClassifier : public ParamNode {
 public:
  // Builds the parameter tree for `config` (collaborative layers where config.collaborative.ranks
  // is non-zero), every tensor uninitialised (torch::empty). Fill by LoadStateDict.
  explicit BertClassifier(const BertConfig& config);

  const BertConfig& config() const { return config_; }

  // Moves to `device`/`dtype` (the parameters themselves, so named_parameters() follows) and
  // builds the fused weights. Call once after loading, before Forward.
  // pack_weights: when this CPU and mode use PackedLinear, pack the dense weights for it and drop
  // their plain tensors (the query/key/value, attention-output and FFN weights become empty in
  // named_parameters(); weights_released() says so): the served form, one copy of each weight.
  // Without it, the q/k/v parameters become views of the fused weight: also one copy.
  void Prepare(const c10::Device& device, c10::ScalarType dtype, bool pack_weights = true);

  // True after Prepare dropped the plain dense weights: code that reads parameters (conversion,
  // saving) must load the model with pack_weights = false instead.
  bool weights_released() const { return weights_released_; }

  // Whether `param` is one of the dense weights Prepare packs and then drops when it packs: a
  // layer's query/key (or W~Q/W~K), value, attention-output and FFN weights.
  bool PackedOnPrepare(const at::Tensor& param) const;

  // input_ids, token_type_ids: int64 [B, S]; attention_mask: int64 [B, S] of 0/1 or an undefined
  // tensor (no padding). Returns float32 logits [B, num_labels] on the CPU. Call under
  // c10::InferenceMode. Thread-safe (reads parameters only).
  at::Tensor Forward(const at::Tensor& input_ids, const at::Tensor& token_type_ids,
                     const at::Tensor& attention_mask) const;

  // Forward's logits [B, num_labels] where the pass leaves them: on the model's device, in its dtype
  // (float32 on the CPU). Inputs may already be on the device. Reads no value back to the host and
  // copies nothing to it, so a CUDA graph can capture it (forward_graphs.h).
  at::Tensor DeviceLogits(const at::Tensor& input_ids, const at::Tensor& token_type_ids,
                          const at::Tensor& attention_mask) const;

  // Hidden states after the embeddings and after each layer (for tests and the fidelity report).
  at::Tensor EncoderOutput(const at::Tensor& input_ids, const at::Tensor& token_type_ids,
                           const at::Tensor& attention_mask) const;

  // The hidden states entering each layer, [B, S, D] each (element 0: the embeddings' output), on
  // the per-operation path: what the activation-aware compression measures. Same arguments and
  // thread-safety as Forward.
  std::vector<at::Tensor> LayerInputs(const at::Tensor& input_ids, const at::Tensor& token_type_ids,
                                      const at::Tensor& attention_mask) const;

  // The per-operation path in pieces, for measurements that rerun part of a model (the rank search
  // measures a layer's compression from the original's hidden states entering it). h: the hidden
  // states [B, S, D] entering layer `first` (Embeddings' output for layer 0, LayerInputs' element
  // `first`), on the model's device; attention_mask as Forward's. Same thread-safety as Forward.
  at::Tensor Embeddings(const at::Tensor& input_ids, const at::Tensor& token_type_ids) const;
  // Layers [first, last) on h: the hidden states leaving layer last - 1.
  at::Tensor RunLayers(size_t first, size_t last, const at::Tensor& h, const at::Tensor& attention_mask) const;
  // Layers [first, L) on h, then the classifier: Forward's logits (float32 [B, num_labels], CPU).
  at::Tensor LogitsFrom(size_t first, const at::Tensor& h, const at::Tensor& attention_mask) const;

  std::vector<EncoderLayer>& layers() { return layers_; }
  const std::vector<EncoderLayer>& layers() const { return layers_; }

  c10::Device device() const { return device_; }
  c10::ScalarType dtype() const { return dtype_; }
  // How collaborative layers hand their attention to ATen's (collab_attention.h; where attention
  // runs on ATen ops: CUDA, half types, the CPU without the sgemm). Set before the first pass.
  void set_collab_attention(CollabAttention way) { collab_attention_ = way; }
  CollabAttention collab_attention() const { return collab_attention_; }

 private:
  at::Tensor Embed(const at::Tensor& input_ids, const at::Tensor& token_type_ids) const;
  // HF's additive mask, (1 - mask) * lowest, [B, 1, 1, S]; undefined for an undefined mask.
  at::Tensor MaskAdd(const at::Tensor& attention_mask, int64_t B, int64_t S) const;
  // The encoder's output [B, S, D]; with cls_only, [B, 1, D]: the last layer computes the [CLS]
  // position's output alone (all Forward needs), equal to EncoderOutput's position 0.
  at::Tensor Encode(const at::Tensor& input_ids, const at::Tensor& token_type_ids,
                    const at::Tensor& attention_mask, bool cls_only) const;
  at::Tensor Layer(const EncoderLayer& l, const at::Tensor& h, const at::Tensor& mask_add,
                   bool cls_only) const;
  at::Tensor Activation(const at::Tensor& x) const;
  // The pooler and classifier on the [CLS] positions' hidden states [B, D]: logits on the device.
  at::Tensor Classify(const at::Tensor& first) const;
  // The constructor's last step: the small tensors (biases, LayerNorm, mixing, content vectors,
  // and room for the fused biases) become views of one mapping of their own.
  void KeepSmallTensorsTogether();
  // Every layer in one ThreadTeam run (encoder_team.cc); false when that path does not apply (then h
  // is unchanged). cls_only as in Encode.
  bool EncodeOnTeam(at::Tensor& h, const at::Tensor& mask_add, bool cls_only) const;

  BertConfig config_;
  at::Tensor word_emb_, pos_emb_, type_emb_, emb_ln_w_, emb_ln_b_;
  at::Tensor pooler_w_, pooler_b_, cls_w_, cls_b_;
  std::vector<EncoderLayer> layers_;
  c10::Device device_ = c10::Device(c10::kCPU);
  c10::ScalarType dtype_ = c10::kFloat;
  bool weights_released_ = false;
  CollabAttention collab_attention_ = CollabAttention::kBias;
};

}  // namespace collabserve::model

#endif  // COLLABSERVE_SERVER_MODEL_BERT_H_
