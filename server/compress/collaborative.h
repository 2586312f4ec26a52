// Converting a trained BERT classifier to collaborative attention (Cordonnier et al. 2020) with no
// retraining: per layer, the CP decomposition of the stacked W_Q^(i) W_K^(i)ᵀ gives the mixing M
// and the shared W~_Q, W~_K; the query bias survives as v_i = W_K^(i) b_Q^(i). Writes a Hugging
// Face-style directory the engine loads like any model, and reports what was lost.
#ifndef COLLABSERVE_SERVER_COMPRESS_COLLABORATIVE_H_
#define COLLABSERVE_SERVER_COMPRESS_COLLABORATIVE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/compress/cp_als.h"

namespace collabserve::model {
class BertClassifier;
struct BertConfig;
enum class OutputFunction;
}  // namespace collabserve::model

namespace collabserve::compress {

// How the shared key/query dimension D~ is chosen; exactly one applies.
struct RankSpec {
  enum class Kind { kRank, kRatio, kPerLayer, kMaxError, kTargetAgreement, kMaxKl };
  Kind kind = Kind::kRank;
  int rank = 0;             // kRank: every layer
  double ratio = 0;         // kRatio: D~ = round(N_h·d_k / ratio)
  std::vector<int> ranks;   // kPerLayer: one per layer; 0 leaves that layer standard
  double max_error = 0;     // kMaxError: per layer, the smallest rank with relative error <= this
  // kTargetAgreement / kMaxKl: the per-layer ranks (a layer may stay standard) with the fewest Q/K
  // parameters found whose model keeps top-1 agreement >= target_agreement (in (0, 1]), or mean
  // KL <= max_kl (> 0), on the held-out texts (rank_search.h: how they are searched).
  double target_agreement = 0;
  double max_kl = 0;
};

struct LayerReport {
  int layer = 0;
  int rank = 0;                 // 0: left standard
  double relative_error = 0;    // ||T − T̂||_F / ||T||_F
  // With whitening: ||L_qᵀ(T − T̂)L_k||_F / ||L_qᵀ T L_k||_F, the relative score error over the
  // calibration inputs (what the whitened CP minimises); -1 without.
  double activation_error = -1;
  int iterations = 0;
  double seconds = 0;
  // Where the CP-ALS time went (CpResult): initialisation, sweeps, the returned factors' error.
  double setup_seconds = 0, sweep_seconds = 0, finish_seconds = 0;
  int extrapolations = 0;       // line-search moves kept
  bool exact = false;
  int ranks_tried = 1;          // kMaxError searches several
};

// The compressed model's outputs against the original's, as the model serves them
// (BertConfig::output_function()):
// - softmax (single-label): a probe agrees when its argmax label is unchanged; KL of the softmaxes;
// - sigmoid (multi-label, or one label): a probe agrees when every label's decision (p > 0.5) is
//   unchanged; KL is the sum over labels of the Bernoulli KLs;
// - none (regression): top1_agreement and mean_kl are NaN (no classes, no distribution); only
//   max_abs_logit_diff is measured.
struct FidelityReport {
  int probes = 0;
  double top1_agreement = 0;     // fraction of probes that agree (above)
  double max_abs_logit_diff = 0;
  double mean_kl = 0;            // mean KL(p_original || p_compressed) of the output distributions
  // What the agreement says of texts like the probes: the one-sided 95 % (Wilson score) lower
  // bound on the rate, 0 without probes, NaN for regression. 1.0 on 3 probes bounds it only at 0.53;
  // on 300, at 0.991.
  double agreement_lower95 = 0;
  // Probes longer than the model's maximum length, cut there as the engine cuts them when it
  // serves the model (MeasureFidelity; 0 from CompareLogitRows, which gets logits).
  int64_t truncated = 0;
};

// The one-sided 95 % Wilson score lower bound on a rate seen `hits` times in `n` trials (0 if n is 0).
double WilsonLower95(int64_t hits, int64_t n);

// A fidelity-target search (RankSpec kTargetAgreement / kMaxKl): what it measured and tried.
struct RankSearchReport {
  bool ran = false;
  std::string target;              // "top1_agreement >= 0.99" or "mean_kl <= 0.001"
  int texts = 0;                   // the held-out texts every trial is measured on
  std::vector<int> grid;           // the candidate ranks of every layer (besides standard)
  int decompositions = 0;          // CP-ALS runs (layers x grid)
  // Per layer: the mean KL of the model with only that layer compressed, at each of
  // `sensitivity_ranks` (the grid ranks nearest N_h·d_k/8 and N_h·d_k/16), and the exponent p_l of
  // the proxy KL_l(r) = layer_kl[l][0]·(e_l(r)/e_l(first rank))^p_l fitted through them (e: the
  // layer's activation-weighted error, or its weight error without calibration) that orders the
  // candidates.
  std::vector<int> sensitivity_ranks;
  std::vector<std::vector<double>> layer_kl;
  std::vector<double> kl_exponent;
  struct Trial {
    std::vector<int> ranks;        // 0: standard
    int64_t qk_params = 0;
    FidelityReport fidelity;
    bool meets = false;
    double seconds = 0;            // since the search began
  };
  std::vector<Trial> trials;       // in the order measured
  int chosen = -1;                 // the returned allocation's trial
  int candidates = 0;              // allocations on the path the trials bisect
  bool time_limited = false;       // stopped at search_seconds with the best verified so far
  double decompose_seconds = 0, sensitivity_seconds = 0, seconds = 0;
};

// Activation-aware CP: the score error of head i on a query token x and a key token y is
// xᵀ(T_i − T̂_i)y, whose mean square over the layer's real inputs is ‖L_qᵀ(T_i − T̂_i)L_k‖_F² with
// L_q L_qᵀ = E[xxᵀ] and L_k L_kᵀ = Cov(y) (the key side may be centred: xᵀT μ_y is the same for
// every key of a query, and the softmax cancels it). So the CP runs on L_qᵀ W_Q^(i), L_kᵀ W_K^(i)
// and maps back: W̃_Q = L_q^{-ᵀ} B', W̃_K = L_k^{-ᵀ} C', the mixing unchanged.
struct LayerWhitening {
  at::Tensor query_factor;  // L_q: [D, D] float64, lower-triangular, invertible
  at::Tensor key_factor;    // L_k: likewise
};

// Fewer calibration texts than this are refused (the second moments would rest on a few hundred
// tokens).
inline constexpr int kMinCalibrationTexts = 16;

// The texts of a calibration file (one per line; blank lines skipped). INVALID_ARGUMENT naming
// `name` for a file with a NUL byte (binary), a line that is not valid UTF-8, or no text at all.
absl::StatusOr<std::vector<std::string>> ParseCalibrationText(std::string_view bytes, const std::string& name);

// What a calibration pass measured: per layer, over the non-padding tokens entering it.
struct CalibrationStats {
  std::vector<at::Tensor> second_moment;  // [D, D] float64, E[x xᵀ]
  std::vector<at::Tensor> mean;           // [D] float64, E[x]
  int64_t texts = 0, tokens = 0;
  int64_t truncated = 0;                  // texts cut at the model's maximum length
  double seconds = 0;
};

// Runs `texts` (tokenized with `vocab_dir`'s tokenizer and cut where the engine cuts them:
// BertConfig::max_input_length) through `model` once, on its device, and accumulates, per layer,
// the second moment and mean of the hidden states entering it, in float64 (returned on the CPU).
// INVALID_ARGUMENT for no texts, or a text that is not valid UTF-8 (naming it); CANCELLED when
// `cancelled` reads true between two batches.
absl::StatusOr<CalibrationStats> CollectCalibrationStats(const model::BertClassifier& model,
                                                         const std::string& vocab_dir,
                                                         const std::vector<std::string>& texts,
                                                         const std::atomic<bool>* cancelled = nullptr);

// Damped Cholesky factors per layer: L_q of E[xxᵀ] + λ·tr/D·I, L_k of Cov(y) + λ·tr/D·I, with
// λ = `damping` (> 0 keeps them invertible when the inputs span fewer than D directions).
// INVALID_ARGUMENT for damping < 0 or not finite; FAILED_PRECONDITION when a matrix is not positive
// definite (damping 0 on rank-deficient inputs), naming the layer.
absl::StatusOr<std::vector<LayerWhitening>> WhiteningFromStats(const CalibrationStats& stats, double damping);

struct CompressOptions {
  RankSpec spec;
  int max_iters = 100;
  // Stop a layer when a sweep changes its relative error by less than this. 1e-5 stops BERT-base
  // layers after ~45 of 100 sweeps within 2e-4 of the 100-sweep error (README, compression).
  double tol = 1e-5;
  uint64_t seed = 0;
  // Where CP-ALS and the model passes (calibration statistics, the rank search's measurements,
  // the fidelity probes) run: cpu | cuda[:N]. The source is loaded and the result written on the
  // CPU either way; on a GPU the passes run on a float32 copy there.
  std::string device = "cpu";
  // Arithmetic of the ALS sweeps. float32 is about 2x faster on CPU; its final errors are within
  // ~3e-4 of float64's (bench/compress/RESULTS.md). The reported error is always float64.
  bool float64 = false;
  // CpAlsOptions::line_search: extrapolate after each sweep, keep the move when it lowers the
  // error. Fewer sweeps to a given error, and a lower one at the same --tol.
  bool line_search = true;
  // CpAlsOptions::init. kSvd by default. With the line search a random start reaches the error of
  // 100 plain sweeps on one BERT-base layer in as many or fewer sweeps and skips the SVD start's two
  // [D, D] eigendecompositions, but on the whole random-weight model at the default tol it stopped
  // at a slightly higher error with a worse fidelity report (bench/compress/RESULTS.md, section 6).
  CpAlsOptions::Init init = CpAlsOptions::Init::kSvd;
  // Layers decomposed at once, from a work queue that hands out the costliest layers first.
  // 0 (the default): automatic, util::UsableCpus() / at::get_num_threads() of the calling thread,
  // at least 1 (on CUDA: 1). So a caller that runs ATen with one thread gets one layer per CPU,
  // and one with a thread per CPU gets one layer at a time. Every worker runs ATen with the calling
  // thread's count (set per thread; the default of threads started later is not changed). While
  // more than one layer runs at once on the CPU, OpenBLAS is pinned to one thread and restored
  // afterwards (util::SetBlasThreads; its pool is process-wide and a multi-threaded call holds a
  // global lock, so two layers' GEMMs would otherwise take turns). The factors do not depend on
  // this value: layer i is always decomposed from seed + i, and with the same per-layer thread
  // counts the result is bitwise the same for any parallel_layers. Negative: INVALID_ARGUMENT.
  int parallel_layers = 0;
  std::vector<std::string> probes;     // empty: the built-in probe sentences (or, with
                                       // calibration text, its held-out part)
  // Activation-aware CP from calibration text (one text per element). CompressModelDirectory and
  // CompressLoadedModel fit the whitening on the first `calibration_fit_fraction` of the texts and,
  // when `probes` is empty, measure fidelity on the rest. Empty: plain (weight-space) CP.
  std::vector<std::string> calibration;
  double calibration_fit_fraction = 0.8;
  double whiten_damping = 0.01;        // WhiteningFromStats' λ
  // Whiten layer l by the inputs it gets in the compressed model (layers < l already converted,
  // one calibration pass per layer) instead of the original's, so each layer's fit accounts for
  // the drift of those before it. Needs calibration text and a fixed rank spec (not a target).
  bool whiten_compressed_inputs = false;
  // One per layer: ConvertToCollaborative decomposes each layer whitened by these (empty: plain).
  // Filled from `calibration` by the two functions above; set directly by callers that have
  // their own statistics.
  std::vector<LayerWhitening> whitening;
  // A fidelity-target search stops after this many seconds: with the cheapest allocation verified
  // so far (RankSearchReport::time_limited), or DEADLINE_EXCEEDED when none is. 0: no limit
  // (a negative or NaN one is refused).
  double search_seconds = 600;
  // Progress of a target search (e.g. for an admin job's events): called, from the calling thread,
  // after each trial.
  std::function<void(const RankSearchReport::Trial&)> on_trial;
  std::string source;                  // recorded in config.json's collaborative.source
  // Progress (e.g. for an admin job): called after each layer, from the worker that did it.
  std::function<void(const LayerReport&)> on_layer;
  // Set to true to abandon the work; the call then returns CANCELLED and writes nothing.
  const std::atomic<bool>* cancelled = nullptr;
  // Called, from the calling thread, as each step of CompressModelDirectory starts: "load",
  // "convert", "fidelity", "write" (e.g. to measure each step's memory). The weights file is
  // written from a second thread during "fidelity"; "write" is what follows the probes
  // (config.json, which records the fidelity, and the rename that publishes the directory).
  std::function<void(const std::string& step)> on_step;
};

struct CompressReport {
  std::vector<LayerReport> layers;
  int64_t qk_params_before = 0, qk_params_after = 0;
  int64_t total_params_before = 0, total_params_after = 0;
  FidelityReport fidelity;
  double seconds = 0;           // whole call
  double decompose_seconds = 0; // CP only
  // Wall seconds of each step of CompressModelDirectory / CompressLoadedModel: reading and
  // preparing the checkpoint (0 for CompressLoadedModel), the conversion (the CP decompositions
  // and building the new model), the fidelity probes, writing the output directory. The weights
  // are written by a second thread while the probes run, so write_seconds (that thread's time
  // plus config.json and the rename) overlaps fidelity_seconds.
  double load_seconds = 0, convert_seconds = 0, fidelity_seconds = 0, write_seconds = 0;
  int parallel_layers = 0;      // layers that were decomposed at once (the resolved option)
  // Activation-aware CP: whether it ran, and on what (calibration texts fitted on / held out for
  // the fidelity, tokens, truncated texts, seconds of the calibration pass and the factors).
  bool whitened = false;
  std::string whitening_note;   // why not, or where the fidelity was measured
  // The texts the fidelity (and a target search) ran on: "held-out calibration texts", "given
  // probes" or "built-in probes" (CompressOptions::probes, else the calibration's held-out part).
  std::string fidelity_texts;
  int64_t calibration_fit_texts = 0, calibration_heldout_texts = 0, calibration_tokens = 0;
  int64_t calibration_truncated = 0;
  double calibration_seconds = 0;
  RankSearchReport search;      // ran only for a fidelity target
  std::string ToJson() const;   // the report `collabserve-model compress` prints
};

// Resolves the rank spec for a model: one rank per layer (0 = keep standard; N_h·d_k = exact).
// INVALID_ARGUMENT naming the problem: rank < 1, a rank above N_h·d_k, ratio <= 0 or < 1 implying a
// rank above full, a ranks list whose length is not the layer count, max_error outside (0, 1).
absl::StatusOr<std::vector<int>> ResolveRanks(const RankSpec& spec, const model::BertConfig& config);

// The number of layers ConvertToCollaborative decomposes at once for `requested`
// (CompressOptions::parallel_layers), a model of `num_layers` layers and the device CP-ALS runs on:
// `requested` when positive, else UsableCpus() / at::get_num_threads() of the calling thread on the
// CPU and 1 elsewhere; never more than num_layers, at least 1. INVALID_ARGUMENT for requested < 0.
absl::StatusOr<int> ResolveParallelLayers(int requested, int num_layers, bool on_cpu);

// Converts `source` (standard layers; already-collaborative layers are refused; a fidelity target,
// which needs texts to measure on, is INVALID_ARGUMENT: CompressLoadedModel runs it) into a new
// collaborative classifier. Fills `report->layers` and the parameter counts. Every parameter the
// two models have in common (embeddings, value/output projections, feed-forward, LayerNorms, head)
// shares the source's CPU float32 storage instead of being copied: the result costs only its new
// attention tensors, and neither model may be modified in place afterwards (Prepare() is fine).
absl::StatusOr<std::unique_ptr<model::BertClassifier>> ConvertToCollaborative(
    const model::BertClassifier& source, const CompressOptions& options, CompressReport* report);

// Measures how closely `compressed` follows `original` on `probes` (tokenized with the vocabulary
// in `vocab_dir` and cut where the engine cuts them, as CollectCalibrationStats), each model's
// passes on its own device. CANCELLED when `cancelled` reads true between two batches.
absl::StatusOr<FidelityReport> MeasureFidelity(const model::BertClassifier& original,
                                               const model::BertClassifier& compressed,
                                               const std::string& vocab_dir,
                                               const std::vector<std::string>& probes,
                                               const std::atomic<bool>* cancelled = nullptr);

// How closely `candidate`'s logits follow `reference`'s: one row per input, the same inputs in the
// same order, compared as a model whose output function is `fn` serves them (FidelityReport says
// what each figure means; `probes` is the number of rows). INVALID_ARGUMENT when the two differ in
// rows or a row in width, or a row is empty.
absl::StatusOr<FidelityReport> CompareLogitRows(const std::vector<std::vector<float>>& reference,
                                                const std::vector<std::vector<float>>& candidate,
                                                model::OutputFunction fn);

// The whole pipeline: loads `in_dir`, converts, measures fidelity, and writes `out_dir` (which
// must not exist) atomically: everything is written into a temporary sibling directory that is
// renamed into place at the end, so `out_dir` is either complete or absent.
absl::StatusOr<CompressReport> CompressModelDirectory(const std::string& in_dir, const std::string& out_dir,
                                                      const CompressOptions& options);

// The same pipeline on a model already loaded from `in_dir` (e.g. the one an Engine loaded to
// validate an upload), so the checkpoint is read once: `source` must be in_dir's standard model,
// prepared on the CPU in float32; it is read, never modified, and must outlive the call. in_dir
// provides the vocabulary and tokenizer files. Steps reported to on_step: "convert", "fidelity",
// "write".
absl::StatusOr<CompressReport> CompressLoadedModel(const model::BertClassifier& source,
                                                   const std::string& in_dir, const std::string& out_dir,
                                                   const CompressOptions& options);

}  // namespace collabserve::compress

#endif  // COLLABSERVE_SERVER_COMPRESS_COLLABORATIVE_H_
