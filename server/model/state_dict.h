// Moving weights between checkpoint files (torch-free io::RawTensor views) and a BertClassifier:
// key normalisation (with or without `bert.`, LayerNorm gamma/beta), tolerated extras, and
// missing / unexpected / mis-shaped tensors reported by name.
#ifndef COLLABSERVE_SERVER_MODEL_STATE_DICT_H_
#define COLLABSERVE_SERVER_MODEL_STATE_DICT_H_

#include <ATen/core/Tensor.h>

#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/model/bert.h"
#include "server/model/io/checkpoint.h"

namespace collabserve::model {

// A floating-point RawTensor as an owning, contiguous float32 CPU tensor. INVALID_ARGUMENT naming
// `name` for a non-float dtype.
absl::StatusOr<at::Tensor> RawToFloatTensor(const io::RawTensor& raw, absl::string_view name);

// The Hugging Face key for a checkpoint key: adds `bert.` to bare BertModel keys and renames the
// old `LayerNorm.gamma/beta` to `weight/bias`.
std::string NormalizeKey(absl::string_view key);

// Copies every parameter of `model` from `checkpoint`. Tolerated and ignored: `*.position_ids`,
// `cls.*` (pre-training heads). Errors (INVALID_ARGUMENT, naming `file` and the tensors): missing
// parameters, unexpected keys, shape mismatches, non-float dtypes, non-finite values.
// borrow_packed: the weights Prepare packs and drops (model.PackedOnPrepare) are not copied but
// become read-only views of the checkpoint's bytes (float32, contiguous and aligned ones; the rest
// are copied), which keep those bytes alive: for a model prepared with packing right after
// (Engine::Load), which then never writes, or even touches, a plain copy of them. Nothing may
// write to those parameters.
absl::Status LoadStateDict(BertClassifier& model, const io::Checkpoint& checkpoint,
                           absl::string_view file, bool borrow_packed = false);

enum class WeightFormat { kSafetensors, kTorchBin };
enum class WeightDType { kF32, kF16, kBF16 };

// Writes the model's parameters (their Hugging Face names) as `dir/model.safetensors` or
// `dir/pytorch_model.bin`, atomically. FAILED_PRECONDITION for a model whose Prepare released
// its plain weights (weights_released()).
absl::Status SaveWeights(const BertClassifier& model, const std::string& dir, WeightFormat format,
                         WeightDType dtype = WeightDType::kF32,
                         const std::map<std::string, std::string>& metadata = {});

// The parameters in checkpoint order: (name, tensor), as named_parameters() gives them.
std::vector<std::pair<std::string, at::Tensor>> NamedWeights(const BertClassifier& model);

}  // namespace collabserve::model

#endif  // COLLABSERVE_SERVER_MODEL_STATE_DICT_H_
