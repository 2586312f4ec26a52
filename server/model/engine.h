// The inference engine: one loaded BERT sequence classifier (standard or collaborative), its
// tokenizer and its metadata. This header is torch-free so that the service layer does not pay for
// LibTorch's headers.
#ifndef COLLABSERVE_SERVER_MODEL_ENGINE_H_
#define COLLABSERVE_SERVER_MODEL_ENGINE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/model/collab_attention.h"

namespace collabserve::text {
class BertTokenizer;
}

namespace collabserve::model {

class BertClassifier;

struct EngineOptions {
  // "cpu", "cuda" or "cuda:N".
  std::string device = "cpu";
  // "float32" everywhere; "float16" / "bfloat16" on CUDA only.
  std::string dtype = "float32";
  // CPU float32 on an AVX-512 CPU: keep the dense weights only packed for PackedLinear (the
  // served form: one copy of each weight; products above 256 tokens run the sgemm on blocks
  // unpacked on the fly). The classifier's plain dense parameters are then released, so models
  // that are converted or saved (admin jobs, `collabserve-model compress`) load without it.
  bool pack_weights = true;
  // CUDA: passes of at most this many tokens (the batch and length rounded up to powers of two)
  // replay CUDA graphs (forward_graphs.h), one captured per such shape on its first pass; 0: none.
  // Ignored on the CPU.
  int64_t cuda_graph_max_tokens = 4096;
  // How collaborative layers hand their attention to ATen's (CUDA, half types; collab_attention.h):
  // the same results, different SDPA kernels. Ignored where the CPU's own kernels run.
  CollabAttention collab_attention = CollabAttention::kBias;
};

// The device (and that this build and machine have it), the dtype on it and cuda_graph_max_tokens:
// what Engine::Load checks before it reads a checkpoint. A server checks it once at start-up, so
// that a bad flag stops it rather than failing every model's load.
absl::Status ValidateEngineOptions(const EngineOptions& options);

// Parameter counts by part of the model (the numbers `inspect` and the metrics report).
struct ParamCounts {
  int64_t total = 0;
  int64_t embeddings = 0;
  int64_t attention_qk = 0;  // query/key projections, or the collaborative W~Q, W~K, M, v
  int64_t attention_vo = 0;  // value and attention-output projections
  int64_t ffn = 0;           // intermediate + output dense
  int64_t layer_norm = 0;    // every LayerNorm outside embeddings
  int64_t head = 0;          // pooler + classifier
};

struct ModelInfo {
  std::vector<std::string> labels;  // id2label in id order
  std::string problem_type;         // "single_label_classification" | "multi_label_classification" | "regression"
  int max_length = 512;             // min(max_position_embeddings, tokenizer model_max_length)
  int num_layers = 0;
  int num_heads = 0;
  int head_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;
  // Token types the embeddings have (config.json's type_vocab_size): 1 means no text pairs.
  int type_vocab_size = 2;
  // Shared key/query rank per layer for a collaborative model; empty for a standard one.
  std::vector<int> collaborative_ranks;
  // Also from the collaborative section: each layer's relative reconstruction error (-1 where not
  // recorded) and the fidelity probes' top-1 agreement when the compression recorded it.
  std::vector<double> collaborative_errors;
  std::optional<double> fidelity_top1_agreement;
  ParamCounts params;
  std::string device;
  std::string dtype;
};

// One tokenized input (with [CLS]/[SEP]); attention mask is implied by the length.
struct TokenizedInput {
  std::vector<int32_t> input_ids;
  std::vector<int32_t> token_type_ids;
};

struct Prediction {
  std::vector<float> logits;
  std::vector<float> probabilities;  // softmax; sigmoid for multi-label or one label; logits for regression
  int label = 0;                     // argmax
};

// Thread-safety: after Load, all const methods are safe to call concurrently from many threads.
// Each Run call runs one forward pass under InferenceMode; concurrent Runs execute in parallel,
// except on CUDA those that replay a graph (cuda_graph_max_tokens): one replay at a time.
class Engine {
 public:
  virtual ~Engine() = default;

  // Loads the checkpoint directory `dir`: config.json, vocab.txt, optional tokenizer_config.json and
  // model.safetensors or pytorch_model.bin (standard or collaborative). Errors name the file and the
  // problem (NOT_FOUND, INVALID_ARGUMENT, UNIMPLEMENTED for unsupported architectures/options).
  static absl::StatusOr<std::unique_ptr<Engine>> Load(const std::string& dir,
                                                      const EngineOptions& options = {});

  virtual const ModelInfo& info() const = 0;
  virtual const text::BertTokenizer& tokenizer() const = 0;
  // The loaded classifier, for code that goes on to transform the model it validated (an upload
  // job compresses it instead of reading the checkpoint a second time). Read it only; valid while
  // the engine lives.
  virtual const BertClassifier& classifier() const = 0;

  // Runs one batch: pads to the longest input, masks the padding, returns one Prediction per
  // input in order. A sequence's result does not depend on what it is batched with. INVALID_ARGUMENT
  // for an empty input, an input longer than max_length, or an id outside the vocabulary;
  // RESOURCE_EXHAUSTED when the device's memory ran out; UNAVAILABLE, marked as a device failure
  // (device.h's IsDeviceFailure), when the GPU can run no more work; INTERNAL otherwise.
  virtual absl::StatusOr<std::vector<Prediction>> Run(
      absl::Span<const TokenizedInput* const> batch) const = 0;

  // OK when Run takes `in` (alone or in any batch); else the INVALID_ARGUMENT Run gives for it (Run
  // adds "input I: "): an empty input, one longer than max_length, an id outside the vocabulary,
  // token_type_ids (when given) not one per id or outside the model's token types.
  virtual absl::Status CheckInput(const TokenizedInput& in) const = 0;

  // Convenience: Run over owned inputs.
  absl::StatusOr<std::vector<Prediction>> Run(const std::vector<TokenizedInput>& batch) const;

  // Runs a pass of every shape whose first pass costs more than the next ones, for batches of up
  // to max_batch_size inputs: on CUDA, one in each CUDA graph bucket (both with and without the
  // padding mask), which captures its graph (forward_graphs.h). Nothing on the CPU. Errors as Run.
  virtual absl::Status WarmUpGraphs(int64_t max_batch_size) const = 0;
  // CUDA graphs captured so far (0 on the CPU, or with cuda_graph_max_tokens = 0).
  virtual int64_t cuda_graphs() const = 0;
};

// Bytes of the process-wide pass arena (pass_arena.h: the buffers of team passes, kept between
// passes) resident now; 0 before the first team pass and after an idle release. Thread-safe.
int64_t PassArenaResidentBytes();

}  // namespace collabserve::model

#endif  // COLLABSERVE_SERVER_MODEL_ENGINE_H_
