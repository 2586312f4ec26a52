// The pieces of the conversion that collaborative.cc and rank_search.cc share: one layer's
// decomposition, the parallel loop over layers, building a model from chosen decompositions, and
// running texts through a model. Not part of the compression API.
#ifndef COLLABSERVE_SERVER_COMPRESS_COLLABORATIVE_INTERNAL_H_
#define COLLABSERVE_SERVER_COMPRESS_COLLABORATIVE_INTERNAL_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/compress/collaborative.h"
#include "server/compress/cp_als.h"
#include "server/model/config.h"

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

// The model a compression's passes (calibration statistics, the rank search's measurements, the
// fidelity probes) run on: the given model itself where it already is on `device`, else a float32
// copy on `device` with plain weights, owned here. The passes run where CP-ALS runs
// (CompressOptions::device): on a GPU they take milliseconds where the CPU takes seconds.
// copy: copy even where `m` already is on `device` (so that a machine without a GPU tests the
// copy). FAILED_PRECONDITION (ReleasedWeightsError) for a model that dropped its plain weights.
class PassModel {
 public:
  static absl::StatusOr<PassModel> On(const model::BertClassifier& m, const c10::Device& device, bool copy = false);
  const model::BertClassifier& get() const {
    if (copy_ != nullptr) return *copy_;
    return *model_;
  }

 private:
  const model::BertClassifier* model_ = nullptr;
  std::unique_ptr<model::BertClassifier> copy_;
};

// Threads that take a model's `batches` batches in turn: on the CPU one per CPU the caller's ATen
// threads leave; on a GPU one (its stream runs the passes one after another anyway); at most one
// per batch, at least one.
int PassWorkers(const model::BertClassifier& m, size_t batches);

// Texts tokenized once (cut at the model's maximum length, as served) and batched in order of
// length, so each batch pads only to its own longest input.
struct TextBatch {
  at::Tensor ids, types, mask;  // int64 [n, S]
};
struct TextBatches {
  std::vector<TextBatch> batches;
  int64_t texts = 0;
  int64_t tokens = 0;  // non-padding tokens
  int64_t truncated = 0;
  // The job's cancel flag (nullptr: none): the passes over these batches stop between batches
  // when it reads true (ForEachBatch).
  const std::atomic<bool>* cancelled = nullptr;
};
absl::StatusOr<TextBatches> TokenizeInBatches(const model::BertClassifier& model, const std::string& vocab_dir,
                                              const std::vector<std::string>& texts, const char* what,
                                              const std::atomic<bool>* cancelled = nullptr);

// Runs fn(w, i) for i = 0, ..., n - 1 on W = min(workers, n) threads (the calling thread one of
// them), worker w taking i = w, w + W, ..., each under InferenceMode with the calling thread's ATen
// thread count, on the pass arena. INTERNAL on an exception, CANCELLED when `cancelled` reads true
// before a batch (the workers then stop; a batch running finishes).
absl::Status ForEachBatch(size_t n, int workers, const std::function<void(int, size_t)>& fn,
                          const std::atomic<bool>* cancelled = nullptr);

// Layer `layer`'s whitening (WhiteningFromStats) from its inputs' E[x xᵀ] `m2` and E[x] `mu`.
absl::StatusOr<LayerWhitening> WhitenLayer(const at::Tensor& m2, const at::Tensor& mu, double damping, size_t layer);

// The calibration statistics' sums (calibration pass, a layer's inputs in a partly converted model):
// per worker of ForEachBatch and layer, over the non-padding tokens, in float64 on `device`.
// Finish adds the workers' sums in worker order, so the statistics depend on the texts and the
// worker count only. Add(w, ...) from worker w alone; the tokens are counted at layer 0.
class LayerInputSums {
 public:
  LayerInputSums(int workers, size_t layers, int64_t hidden, const c10::Device& device);
  // The non-padding positions of a batch's mask ([n, S], on the CPU) as row indices of its [n·S, D]
  // hidden states, on `device`: made once per batch (on a GPU each copy there waits for the queue).
  static at::Tensor Rows(const at::Tensor& mask, const c10::Device& device);
  // Adds the rows of h ([n, S, D], the hidden states entering `layer`) that `rows` (Rows of its
  // batch's mask) names.
  void Add(int w, size_t layer, const at::Tensor& h, const at::Tensor& rows);
  // E[x xᵀ] and E[x] per layer (on the CPU) and the token count into `st`.
  void Finish(CalibrationStats* st) const;

 private:
  int64_t D_;
  std::vector<int64_t> tokens_;
  std::vector<std::vector<at::Tensor>> second_moment_, mean_;
};

// Every batch's hidden states entering layer 0 of `model` (its embeddings), on its device.
absl::StatusOr<std::vector<at::Tensor>> EmbedBatches(const model::BertClassifier& model, const TextBatches& batches,
                                                     int workers);
// Advances `hidden` (every batch's states entering `layer`) through that layer of `model`.
absl::Status AdvanceBatches(const model::BertClassifier& model, size_t layer, const TextBatches& batches,
                            int workers, std::vector<at::Tensor>* hidden);

// `model`'s float64 logits for every batch, in order, computed by `workers` threads taking batches
// in turn (ForEachBatch). INTERNAL on a LibTorch error; CANCELLED when the batches' flag is set.
absl::StatusOr<std::vector<at::Tensor>> BatchLogits(const model::BertClassifier& model, const TextBatches& batches,
                                                    int workers);

// Agreement, max |Δ logit| and mean KL(p_a || p_b) of two models' logits over the same batches,
// as the model serves them (`fn`; FidelityReport says what each means).
absl::StatusOr<FidelityReport> CompareLogits(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                                             int64_t texts, model::OutputFunction fn);

// The fidelity-target search (RankSpec kTargetAgreement / kMaxKl; rank_search.cc says how):
// one decomposition per layer, in layer order, for the cheapest ranks found that meet the target on
// `texts` (empty: the built-in probes), tokenized with `vocab_dir`'s tokenizer. `passes` is `source`
// where its measurements run (PassModel::On(source, device).get()). Fills `report`.
// FAILED_PRECONDITION when no compressed allocation meets the target; DEADLINE_EXCEEDED when
// o.search_seconds pass before one is verified; CANCELLED when o.cancelled is set.
absl::StatusOr<std::vector<LayerDecomposition>> SearchRanks(const model::BertClassifier& source,
                                                            const model::BertClassifier& passes,
                                                            const std::string& vocab_dir,
                                                            const std::vector<std::string>& texts,
                                                            const CompressOptions& o, RankSearchReport* report);

}  // namespace collabserve::compress::internal

#endif  // COLLABSERVE_SERVER_COMPRESS_COLLABORATIVE_INTERNAL_H_
