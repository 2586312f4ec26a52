// Parameter counts of a BertClassifier by part (for `inspect`, GetModel and the metrics).
#ifndef COLLABSERVE_SERVER_MODEL_PARAM_COUNTS_H_
#define COLLABSERVE_SERVER_MODEL_PARAM_COUNTS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/model/bert.h"
#include "server/model/config.h"
#include "server/model/engine.h"

namespace collabserve::model {

ParamCounts CountParams(const BertClassifier& model);

// Q/K parameters a standard layer of this config has (for compression ratios).
int64_t StandardQkParamsPerLayer(const BertConfig& config);
// Q/K parameters of a collaborative layer at rank R: W~_Q and W~_K [R, D], the mixing [N_h, R] and
// the content bias [N_h, D]. rank 0: a standard layer's.
int64_t CollaborativeQkParamsPerLayer(const BertConfig& config, int rank);

// Loads config.json + weights of `dir` (no tokenizer, no device move): for tools and compression.
// borrow_packed: as LoadStateDict's (Engine::Load, when Prepare packs).
absl::StatusOr<std::unique_ptr<BertClassifier>> LoadClassifier(const std::string& dir,
                                                               const BertConfig& config,
                                                               bool borrow_packed = false);
// The single weights file of `dir`: model.safetensors, else pytorch_model.bin. NOT_FOUND when
// neither is there, UNIMPLEMENTED for a sharded checkpoint's index, INVALID_ARGUMENT naming a
// weights file that cannot be read (a dangling link, a directory).
absl::StatusOr<std::string> FindWeightsFile(const std::string& dir);

}  // namespace collabserve::model

#endif  // COLLABSERVE_SERVER_MODEL_PARAM_COUNTS_H_
