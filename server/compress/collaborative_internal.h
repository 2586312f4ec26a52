// The pieces of the conversion that collaborative.cc and rank_search.cc share: one layer's
// decomposition, the parallel loop over layers, building a model from chosen decompositions, and
// running texts through a model. Not part of the compression API.
#ifndef COLLABSERVE_SERVER_COMPRESS_COLLABORATIVE_INTERNAL_H_
#define COLLABSERVE_SERVER_COMPRESS_COLLABORATIVE_INTERNAL_H_

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/compress/collaborative.h"
#include "server/compress/cp_als.h"

namespace collabserve::compress::internal {

// One layer at one rank: its report and, unless the layer stays standard (rank 0), its CP factors
// (un-whitened: the model's own coordinates).
struct LayerDecomposition {
  LayerReport report;
  std::optional<CpResult> cp;
};

// FAILED_PRECONDITION for a source whose Prepare released its plain weights (a served model).
absl::Status ReleasedWeightsError();

// The checks ConvertToCollaborative makes before any work: a standard model with its plain
// weights, a known device, max_iters >= 1, a finite tol >= 0, whitening of the model's shape.
absl::Status CheckConvertible(const model::BertClassifier& source, const CompressOptions& o);

// Decomposes layer `layer` of `source` at `rank` (0: left standard; -1: the smallest rank whose
// error is at most o.spec.max_error), whitened by o.whitening[layer] when o.whitening is set, on
// o.device. Layer i always starts from seed o.seed + i. Does not call o.on_layer.
absl::StatusOr<LayerDecomposition> DecomposeLayer(const model::BertClassifier& source, int layer, int rank,
                                                  const CompressOptions& o);

// Runs fn(order[0]), fn(order[1]), ... on `workers` threads (the calling thread one of them), each
// under InferenceMode with the calling thread's ATen thread count; OpenBLAS pinned to one thread
// while more than one runs on the CPU. Stops handing out work at the first error or when o is
// cancelled, and returns that error (CANCELLED for the latter); exceptions become INTERNAL.
absl::Status ForEachLayer(const std::vector<int>& order, int workers, bool on_cpu, const CompressOptions& o,
                          const std::function<absl::Status(int)>& fn);

// The collaborative model made of `layers` (one per layer of `source`, in order): the source's
// tensors shared, new attention tensors where a layer has a CP. Fills report->layers and the
// parameter counts. Prepared for nothing yet (the caller calls Prepare).
absl::StatusOr<std::unique_ptr<model::BertClassifier>> AssembleCollaborative(
    const model::BertClassifier& source, const std::vector<const LayerDecomposition*>& layers,
    const CompressOptions& o, CompressReport* report);

// Texts tokenized once (truncated at min(128, max positions)) and batched in order of length, so
// each batch pads only to its own longest input.
struct TextBatch {
  at::Tensor ids, types, mask;  // int64 [n, S]
};
struct TextBatches {
  std::vector<TextBatch> batches;
  int64_t texts = 0;
  int64_t truncated = 0;
};
absl::StatusOr<TextBatches> TokenizeInBatches(const model::BertClassifier& model, const std::string& vocab_dir,
                                              const std::vector<std::string>& texts, const char* what);

// `model`'s float64 logits for every batch, in order, computed by `workers` threads taking batches
// in turn (each with the calling thread's ATen thread count). INTERNAL on a LibTorch error.
absl::StatusOr<std::vector<at::Tensor>> BatchLogits(const model::BertClassifier& model, const TextBatches& batches,
                                                    int workers);

// Agreement, max |Δ logit| and mean KL(p_a || p_b) of two models' logits over the same batches.
absl::StatusOr<FidelityReport> CompareLogits(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                                             int64_t texts);

// The fidelity-target search (RankSpec kTargetAgreement / kMaxKl; rank_search.cc says how):
// one decomposition per layer, in layer order, for the cheapest ranks found that meet the target on
// `texts` (empty: the built-in probes), tokenized with `vocab_dir`'s tokenizer. Fills `report`.
// FAILED_PRECONDITION when no compressed allocation meets the target; DEADLINE_EXCEEDED when
// o.search_seconds pass before one is verified; CANCELLED when o.cancelled is set.
absl::StatusOr<std::vector<LayerDecomposition>> SearchRanks(const model::BertClassifier& source,
                                                            const std::string& vocab_dir,
                                                            const std::vector<std::string>& texts,
                                                            const CompressOptions& o, RankSearchReport* report);

}  // namespace collabserve::compress::internal

#endif  // COLLABSERVE_SERVER_COMPRESS_COLLABORATIVE_INTERNAL_H_
