#include "server/model/engine.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <glog/logging.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/model/bert.h"
#include "server/model/config.h"
#include "server/model/dense_ops.h"
#include "server/model/device.h"
#include "server/model/forward_graphs.h"
#include "server/model/io/checkpoint.h"
#include "server/model/param_counts.h"
#include "server/model/pass_arena.h"
#include "server/model/state_dict.h"
#include "server/model/torch_status.h"
#include "server/text/bert_tokenizer.h"
#include "server/util/files.h"
#include "server/util/status_macros.h"

namespace collabserve::model {

namespace {

absl::StatusOr<c10::ScalarType> ParseDType(const std::string& s, const c10::Device& device) {
  if (s == "float32" || s == "fp32") return c10::kFloat;
  if (s == "float16" || s == "fp16" || s == "bfloat16" || s == "bf16") {
    if (!device.is_cuda()) {
      return absl::InvalidArgumentError(absl::StrCat("dtype '", s, "' is only available on CUDA; use float32 on CPU"));
    }
    return (s == "float16" || s == "fp16") ? c10::kHalf : c10::kBFloat16;
  }
  return absl::InvalidArgumentError(absl::StrCat("dtype '", s, "' is not float32, float16 or bfloat16"));
}

class TorchEngine final : public Engine {
 public:
  TorchEngine(std::unique_ptr<BertClassifier> model, std::unique_ptr<text::BertTokenizer> tokenizer,
              ModelInfo info, int64_t cuda_graph_max_tokens)
      : model_(std::move(model)), tokenizer_(std::move(tokenizer)), info_(std::move(info)) {
    if (model_->device().is_cuda() && cuda_graph_max_tokens > 0 && ForwardGraphs::Supported()) {
      graphs_ = std::make_unique<ForwardGraphs>(*model_, cuda_graph_max_tokens);
    }
  }

  const ModelInfo& info() const override { return info_; }
  const text::BertTokenizer& tokenizer() const override { return *tokenizer_; }
  const BertClassifier& classifier() const override { return *model_; }

  absl::StatusOr<std::vector<Prediction>> Run(
      absl::Span<const TokenizedInput* const> batch) const override {
    if (batch.empty()) return std::vector<Prediction>{};
    const int64_t B = static_cast<int64_t>(batch.size());
    int64_t S = 0;
    bool ragged = false;
    const BertConfig& c = model_->config();
    for (size_t i = 0; i < batch.size(); ++i) {
      const TokenizedInput& in = *batch[i];
      const int64_t n = static_cast<int64_t>(in.input_ids.size());
      if (absl::Status s = CheckInput(in); !s.ok()) return util::Prefixed(s, absl::StrCat("input ", i, ": "));
      if (i > 0 && n != S) ragged = true;
      S = std::max(S, n);
    }
    at::Tensor logits;
    try {
      c10::InferenceMode guard;
      const std::optional<GraphBucket> bucket =
          graphs_ != nullptr ? graphs_->BucketFor(B, S, ragged) : std::nullopt;
      if (bucket) {
        const BatchTensors in = MakeBatchTensors(batch, bucket->rows, bucket->length, bucket->masked,
                                                 c.pad_token_id);
        logits = graphs_->Logits(*bucket, in).narrow(0, 0, B).contiguous();
      } else {
        const BatchTensors in = MakeBatchTensors(batch, B, S, ragged, c.pad_token_id);
        const PassArena::Pass pass = PassArena::Shared().BeginPass();
        logits = model_->Forward(in.ids, in.types, in.mask).contiguous();
      }
    } catch (const std::exception& e) {
      return DeviceErrorStatus("forward pass failed", e, model_->device());
    }
    at::Tensor probs;
    switch (c.output_function()) {
      case OutputFunction::kSoftmax: probs = at::softmax(logits, -1); break;
      case OutputFunction::kSigmoid: probs = at::sigmoid(logits); break;
      case OutputFunction::kNone: probs = logits; break;
    }
    probs = probs.contiguous();
    const int64_t C = logits.size(1);
    std::vector<Prediction> out(B);
    const float* lp = logits.data_ptr<float>();
    const float* pp = probs.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      out[b].logits.assign(lp + b * C, lp + (b + 1) * C);
      out[b].probabilities.assign(pp + b * C, pp + (b + 1) * C);
      out[b].label = static_cast<int>(std::max_element(lp + b * C, lp + (b + 1) * C) - (lp + b * C));
    }
    return out;
  }

  absl::Status CheckInput(const TokenizedInput& in) const override {
    const BertConfig& c = model_->config();
    const int64_t n = static_cast<int64_t>(in.input_ids.size());
    if (n == 0) return absl::InvalidArgumentError("it is empty");
    if (n > info_.max_length) {
      return absl::InvalidArgumentError(
          absl::StrCat("it has ", n, " tokens; the model takes at most ", info_.max_length));
    }
    if (!in.token_type_ids.empty() && in.token_type_ids.size() != in.input_ids.size()) {
      return absl::InvalidArgumentError(absl::StrCat("token_type_ids has ", in.token_type_ids.size(),
                                                     " entries, input_ids ", n));
    }
    for (int32_t id : in.input_ids) {
      if (id < 0 || id >= c.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("token id ", id, " is outside the vocabulary [0, ", c.vocab_size, ")"));
      }
    }
    for (int32_t t : in.token_type_ids) {
      if (t < 0 || t >= c.type_vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("token type ", t, " is outside [0, ", c.type_vocab_size, ")"));
      }
    }
    return absl::OkStatus();
  }

  absl::Status WarmUpGraphs(int64_t max_batch_size) const override {
    if (graphs_ == nullptr) return absl::OkStatus();
    const BertConfig& c = model_->config();
    for (const WarmUpPass& p : GraphWarmUpPasses(max_batch_size, info_.max_length,
                                                 c.max_position_embeddings, graphs_->max_tokens())) {
      TokenizedInput in;
      in.input_ids.assign(p.tokens, c.pad_token_id);
      RETURN_IF_ERROR(Engine::Run(std::vector<TokenizedInput>(p.inputs, in)).status());
    }
    return absl::OkStatus();
  }

  int64_t cuda_graphs() const override { return graphs_ != nullptr ? graphs_->captured() : 0; }

 private:
  std::unique_ptr<BertClassifier> model_;
  std::unique_ptr<text::BertTokenizer> tokenizer_;
  ModelInfo info_;
  std::unique_ptr<ForwardGraphs> graphs_;  // CUDA only; declared last: destroyed before the model
};

}  // namespace

absl::StatusOr<std::vector<Prediction>> Engine::Run(const std::vector<TokenizedInput>& batch) const {
  std::vector<const TokenizedInput*> ptrs;
  ptrs.reserve(batch.size());
  for (const auto& b : batch) ptrs.push_back(&b);
  return Run(absl::MakeConstSpan(ptrs));
}

absl::StatusOr<std::string> FindWeightsFile(const std::string& dir) {
  for (const char* name : {"model.safetensors", "pytorch_model.bin"}) {
    std::string p = util::JoinPath(dir, name);
    // A dangling link or a directory is named, not passed over for the other format.
    ASSIGN_OR_RETURN(bool present, util::PresentFile(p));
    if (present) return p;
  }
  for (const char* index : {"model.safetensors.index.json", "pytorch_model.bin.index.json"}) {
    ASSIGN_OR_RETURN(bool present, util::PresentFile(util::JoinPath(dir, index)));
    if (present) {
      return absl::UnimplementedError(absl::StrCat(
          dir, ": ", index, " names a checkpoint sharded into several files, which is not supported; "
          "save it as one file (save_pretrained(..., max_shard_size=\"100GB\"))"));
    }
  }
  return absl::NotFoundError(
      absl::StrCat(dir, ": no model.safetensors or pytorch_model.bin in the model directory"));
}

absl::StatusOr<std::unique_ptr<BertClassifier>> LoadClassifier(const std::string& dir,
                                                               const BertConfig& config,
                                                               bool borrow_packed) {
  ASSIGN_OR_RETURN(std::string weights, FindWeightsFile(dir));
  ASSIGN_OR_RETURN(io::Checkpoint ckpt, io::ReadCheckpointFile(weights));
  try {
    auto model = std::make_unique<BertClassifier>(config);
    RETURN_IF_ERROR(LoadStateDict(*model, ckpt, weights, borrow_packed));
    return model;
  } catch (const std::exception& e) {
    return TorchErrorStatus(weights, e);
  }
}

namespace {

// The options' device and dtype, once they are checked (ValidateEngineOptions).
absl::StatusOr<std::pair<c10::Device, c10::ScalarType>> CheckedDeviceAndDType(const EngineOptions& options) {
  ASSIGN_OR_RETURN(c10::Device device, ParseDevice(options.device));
  ASSIGN_OR_RETURN(c10::ScalarType dtype, ParseDType(options.dtype, device));
  if (options.cuda_graph_max_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_graph_max_tokens is ", options.cuda_graph_max_tokens,
                                                   "; it must be 0 (no CUDA graphs) or more"));
  }
  return std::make_pair(device, dtype);
}

}  // namespace

absl::Status ValidateEngineOptions(const EngineOptions& options) {
  return CheckedDeviceAndDType(options).status();
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Load(const std::string& dir,
                                                     const EngineOptions& options) {
  if (!util::IsDirectory(dir)) {
    return absl::NotFoundError(absl::StrCat(dir, ": model directory does not exist"));
  }
  ASSIGN_OR_RETURN(auto device_and_dtype, CheckedDeviceAndDType(options));
  const c10::Device device = device_and_dtype.first;
  const c10::ScalarType dtype = device_and_dtype.second;
  ASSIGN_OR_RETURN(BertConfig config, BertConfig::FromFile(util::JoinPath(dir, "config.json")));
  ASSIGN_OR_RETURN(auto tokenizer, text::BertTokenizer::FromDirectory(dir));
  if (tokenizer->vocab_size() > config.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(dir, ": vocab.txt has ", tokenizer->vocab_size(),
                                                   " tokens but config.json's vocab_size is ",
                                                   config.vocab_size));
  }
  // Where Prepare packs, the weights it packs are read from the checkpoint's pages themselves
  // (BERT-base: 340 of its 438 MB never copied into memory of their own first).
  const bool packs = options.pack_weights && internal::UsePacking(device, dtype);
  ASSIGN_OR_RETURN(auto model, LoadClassifier(dir, config, /*borrow_packed=*/packs));
  const ParamCounts params = CountParams(*model);  // before Prepare drops the plain weights
  try {
    model->Prepare(device, dtype, options.pack_weights);
    model->set_collab_attention(options.collab_attention);
  } catch (const std::exception& e) {
    return DeviceErrorStatus(absl::StrCat(dir, ": moving the model to ", options.device), e, device);
  }
  ModelInfo info;
  info.labels = config.id2label;
  info.problem_type = config.problem_type_name.empty() ? "single_label_classification"
                                                       : config.problem_type_name;
  info.max_length = config.max_input_length(tokenizer->options().model_max_length);
  info.num_layers = config.num_hidden_layers;
  info.num_heads = config.num_attention_heads;
  info.head_size = config.head_size();
  info.hidden_size = config.hidden_size;
  info.intermediate_size = config.intermediate_size;
  info.type_vocab_size = config.type_vocab_size;
  info.collaborative_ranks = config.collaborative.ranks;
  info.collaborative_errors = config.collaborative.errors;
  if (config.collaborative.fidelity) info.fidelity_top1_agreement = config.collaborative.fidelity->top1_agreement;
  info.params = params;
  info.device = device.str();
  info.dtype = options.dtype;
  try {
    return std::unique_ptr<Engine>(std::make_unique<TorchEngine>(
        std::move(model), std::move(tokenizer), std::move(info), options.cuda_graph_max_tokens));
  } catch (const std::exception& e) {
    return DeviceErrorStatus(absl::StrCat(dir, ": setting up CUDA graphs"), e, device);
  }
}

int64_t PassArenaResidentBytes() { return PassArena::Shared().resident_bytes(); }

}  // namespace collabserve::model
