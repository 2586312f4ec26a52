#include "server/compress/collaborative.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <glog/logging.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"
#include "server/compress/collaborative_internal.h"
#include "server/compress/cp_als.h"
#include "server/model/bert.h"
#include "server/model/config.h"
#include "server/model/device.h"
#include "server/model/param_counts.h"
#include "server/model/pass_arena.h"
#include "server/model/probe_sentences.h"
#include "server/model/state_dict.h"
#include "server/model/threads.h"
#include "server/model/torch_status.h"
#include "server/text/bert_tokenizer.h"
#include "server/text/utf8.h"
#include "server/util/files.h"
#include "server/util/process_env.h"
#include "server/util/status_macros.h"

namespace collabserve::compress {
namespace {

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

bool IsCancelled(const CompressOptions& o) { return o.cancelled && o.cancelled->load(); }

absl::Status CheckDamping(double damping) {
  if (!(damping >= 0) || !std::isfinite(damping)) {
    return absl::InvalidArgumentError(absl::StrCat("whitening damping must be a finite number >= 0, got ", damping));
  }
  return absl::OkStatus();
}

// Pins OpenBLAS's process-wide pool to one thread for its lifetime when `active` and OpenBLAS
// runs more than one; restores the previous count.
class ScopedSingleThreadedBlas {
 public:
  explicit ScopedSingleThreadedBlas(bool active) {
    if (!active) return;
    previous_ = util::BlasThreads();
    if (previous_ > 1) util::SetBlasThreads(1);
  }
  ~ScopedSingleThreadedBlas() {
    if (previous_ > 1) util::SetBlasThreads(previous_);
  }
  ScopedSingleThreadedBlas(const ScopedSingleThreadedBlas&) = delete;
  ScopedSingleThreadedBlas& operator=(const ScopedSingleThreadedBlas&) = delete;

 private:
  int previous_ = -1;
};

// Per-head factors of one layer: T_i = P_i Q_iᵀ with P_i = W_Q^(i) (the paper's D × d_k layout;
// Hugging Face stores query.weight as [out, in], so head i's rows transposed).
struct HeadFactors {
  at::Tensor P, Q;  // [H, D, dk]
};
HeadFactors Factors(const model::EncoderLayer& l, int64_t H, int64_t dk, const c10::Device& device) {
  const int64_t D = l.query_w.size(1);
  return {l.query_w.view({H, dk, D}).transpose(1, 2).to(device, at::kDouble).contiguous(),
          l.key_w.view({H, dk, D}).transpose(1, 2).to(device, at::kDouble).contiguous()};
}

absl::StatusOr<CpResult> Decompose(const HeadFactors& f, int rank, int full, const CompressOptions& o,
                                   uint64_t seed) {
  if (rank >= full) return ExactBlockCp(f.P, f.Q);
  CpAlsOptions co;
  co.rank = rank;
  co.max_iters = o.max_iters;
  co.tol = o.tol;
  co.seed = seed;
  co.init = o.init;
  co.precision = o.float64 ? CpAlsOptions::Precision::kFloat64 : CpAlsOptions::Precision::kFloat32;
  co.line_search = o.line_search;
  co.cancelled = o.cancelled;
  return FactorizedCpAls(f.P, f.Q, co);
}

// The whitened factors L_qᵀ P_i, L_kᵀ Q_i (see LayerWhitening).
HeadFactors Whiten(const HeadFactors& f, const LayerWhitening& w) {
  const auto dev = f.P.device();
  return {at::matmul(w.query_factor.to(dev, at::kDouble).t(), f.P).contiguous(),
          at::matmul(w.key_factor.to(dev, at::kDouble).t(), f.Q).contiguous()};
}

// Maps a decomposition of the whitened factors back (B = L_q^{-ᵀ} B', C = L_k^{-ᵀ} C'): its error
// becomes the activation-weighted one, relative_error the weight-space error of the mapped factors.
absl::Status Unwhiten(const HeadFactors& f, const LayerWhitening& w, CpResult* r, double* activation_error) {
  const auto dev = r->query.device();
  *activation_error = r->relative_error;
  auto back = [&](const at::Tensor& L, const at::Tensor& X) {
    return at::linalg_solve_triangular(L.to(dev, at::kDouble).t(), X.to(at::kDouble), /*upper=*/true)
        .to(at::kFloat);
  };
  r->query = back(w.query_factor, r->query);
  r->key = back(w.key_factor, r->key);
  ASSIGN_OR_RETURN(r->relative_error, FactorizedRelativeError(f.P, f.Q, r->mixing, r->query, r->key));
  return absl::OkStatus();
}

// The smallest rank whose error is at most `max_error` (binary search; CP-ALS
// error falls with the rank). Full rank is exact.
absl::StatusOr<std::pair<int, CpResult>> SearchRank(const HeadFactors& f, int full, double max_error,
                                                    const CompressOptions& o, uint64_t seed,
                                                    int* tried) {
  const int step = 1;
  int lo = 1, hi = (full + step - 1) / step;  // grid indices; rank = min(index * step, full)
  std::optional<std::pair<int, CpResult>> best;
  while (lo <= hi) {
    if (IsCancelled(o)) return absl::CancelledError("compression cancelled");
    int mid = (lo + hi) / 2;
    int rank = std::min(mid * step, full);
    ASSIGN_OR_RETURN(CpResult r, Decompose(f, rank, full, o, seed));
    ++*tried;
    if (r.relative_error <= max_error) {
      best.emplace(rank, std::move(r));
      hi = mid - 1;
    } else {
      lo = mid + 1;
    }
  }
  if (!best) {
    ASSIGN_OR_RETURN(CpResult r, ExactBlockCp(f.P, f.Q));
    best.emplace(full, std::move(r));
  }
  return std::move(*best);
}

}  // namespace

absl::StatusOr<int> ResolveParallelLayers(int requested, int num_layers, bool on_cpu) {
  if (requested < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallel_layers must be 0 (automatic) or positive, got ", requested));
  }
  int n = requested;
  if (n == 0) n = on_cpu ? util::UsableCpus() / std::max(1, at::get_num_threads()) : 1;
  return std::max(1, std::min(n, num_layers));
}

namespace {
absl::Status NoClassesError(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(
      what, " needs a classifier: a regression model (problem_type \"regression\") has no classes "
      "to agree on and no output distribution; give rank, ratio, ranks or max_error"));
}
}  // namespace

absl::StatusOr<std::vector<int>> ResolveRanks(const RankSpec& spec, const model::BertConfig& c) {
  const int L = c.num_hidden_layers, full = c.hidden_size;  // N_h · d_k
  // A rank above N_h·d_k: the conversion is exact at N_h·d_k, and more only adds parameters.
  auto above_full = [&](absl::string_view what, int rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " ", rank, " is above the model's N_h·d_k = ", full, " (", c.num_attention_heads, " heads x ",
        c.head_size(), "), where the conversion is already exact; give at most ", full,
        " (a smaller rank compresses)"));
  };
  switch (spec.kind) {
    case RankSpec::Kind::kRank:
      if (spec.rank < 1) return absl::InvalidArgumentError(absl::StrCat("rank must be at least 1, got ", spec.rank));
      if (spec.rank > full) return above_full("rank", spec.rank);
      return std::vector<int>(L, spec.rank);
    case RankSpec::Kind::kRatio: {
      if (!std::isfinite(spec.ratio) || spec.ratio < 1) {
        return absl::InvalidArgumentError(absl::StrCat("ratio must be a number >= 1 (", full,
                                                       " / ratio is the rank), got ", spec.ratio));
      }
      int r = std::max(1, static_cast<int>(std::lround(full / spec.ratio)));
      return std::vector<int>(L, r);
    }
    case RankSpec::Kind::kPerLayer: {
      if (static_cast<int>(spec.ranks.size()) != L) {
        return absl::InvalidArgumentError(absl::StrCat("ranks has ", spec.ranks.size(),
                                                       " entries but the model has ", L, " layers"));
      }
      std::vector<int> out;
      for (size_t i = 0; i < spec.ranks.size(); ++i) {
        if (spec.ranks[i] < 0) {
          return absl::InvalidArgumentError(absl::StrCat("rank of layer ", i, " is negative: ", spec.ranks[i]));
        }
        if (spec.ranks[i] > full) return above_full(absl::StrCat("layer ", i, "'s rank"), spec.ranks[i]);
        out.push_back(spec.ranks[i]);
      }
      if (std::all_of(out.begin(), out.end(), [](int r) { return r == 0; })) {
        return absl::InvalidArgumentError("ranks are all 0: no layer would be compressed");
      }
      return out;
    }
    case RankSpec::Kind::kMaxError:
      if (!(spec.max_error > 0 && spec.max_error < 1)) {
        return absl::InvalidArgumentError(absl::StrCat("max_error must be in (0, 1), got ", spec.max_error));
      }
      return std::vector<int>(L, -1);  // searched per layer
    case RankSpec::Kind::kTargetAgreement:
      if (c.output_function() == model::OutputFunction::kNone) return NoClassesError("target_agreement");
      if (!(spec.target_agreement > 0 && spec.target_agreement <= 1)) {
        return absl::InvalidArgumentError(
            absl::StrCat("target_agreement must be in (0, 1], got ", spec.target_agreement));
      }
      return std::vector<int>(L, -1);
    case RankSpec::Kind::kMaxKl:
      if (c.output_function() == model::OutputFunction::kNone) return NoClassesError("max_kl");
      if (!(spec.max_kl > 0) || !std::isfinite(spec.max_kl)) {
        return absl::InvalidArgumentError(absl::StrCat("max_kl must be a finite number > 0, got ", spec.max_kl));
      }
      return std::vector<int>(L, -1);
  }
  return absl::InvalidArgumentError("unknown rank spec");
}

namespace internal {

absl::StatusOr<LayerDecomposition> DecomposeLayer(const model::BertClassifier& source, int i, int rank,
                                                  const CompressOptions& o) {
  LayerDecomposition out;
  LayerReport& lr = out.report;
  lr.layer = i;
  if (rank == 0) return out;
  const model::BertConfig& sc = source.config();
  const int H = sc.num_attention_heads, dk = sc.head_size(), full = H * dk;
  ASSIGN_OR_RETURN(c10::Device device, model::ParseDevice(o.device));
  auto lt = Clock::now();
  const HeadFactors f = Factors(source.layers()[i], H, dk, device);
  const bool whiten = !o.whitening.empty();
  const HeadFactors fw = whiten ? Whiten(f, o.whitening[i]) : f;
  absl::StatusOr<CpResult> r;
  if (rank < 0) {
    // With whitening the search rests on the activation-weighted error.
    lr.ranks_tried = 0;  // counted by the search (the default 1 is one given rank's)
    auto found = SearchRank(fw, full, o.spec.max_error, o, o.seed + i, &lr.ranks_tried);
    if (!found.ok()) return found.status();
    rank = found->first;
    r = std::move(found->second);
  } else {
    r = Decompose(fw, rank, full, o, o.seed + i);
  }
  if (!r.ok()) return r.status();
  if (whiten) RETURN_IF_ERROR(Unwhiten(f, o.whitening[i], &*r, &lr.activation_error));
  lr.rank = rank;
  lr.relative_error = r->relative_error;
  lr.iterations = r->iterations;
  lr.exact = r->exact;
  lr.setup_seconds = r->setup_seconds;
  lr.sweep_seconds = r->sweep_seconds;
  lr.finish_seconds = r->finish_seconds;
  lr.extrapolations = r->extrapolations;
  lr.seconds = SecondsSince(lt);
  out.cp = std::move(*r);
  return out;
}

absl::Status ForEachLayer(const std::vector<int>& order, int workers, bool on_cpu, const CompressOptions& o,
                          const std::function<absl::Status(int)>& fn) {
  const int worker_threads = at::get_num_threads();  // the calling thread's
  std::atomic<size_t> next{0};
  std::mutex mu;
  absl::Status first_error;
  auto failed = [&](absl::Status s) {
    std::lock_guard<std::mutex> lock(mu);
    if (first_error.ok()) first_error = std::move(s);
  };
  auto worker = [&]() {
    try {
      c10::InferenceMode guard;
      model::SetThisThreadIntraOpThreads(worker_threads);
      for (size_t k = next++; k < order.size(); k = next++) {
        if (IsCancelled(o)) return failed(absl::CancelledError("compression cancelled"));
        {
          std::lock_guard<std::mutex> lock(mu);
          if (!first_error.ok()) return;
        }
        if (absl::Status s = fn(order[k]); !s.ok()) return failed(std::move(s));
      }
    } catch (const std::exception& e) {
      failed(model::TorchErrorStatus("compression failed", e));
    }
  };
  ScopedSingleThreadedBlas blas(workers > 1 && on_cpu);
  std::vector<std::thread> threads;
  for (int t = 1; t < workers; ++t) threads.emplace_back(worker);
  worker();
  for (auto& t : threads) t.join();
  return first_error;
}

// Every parameter of `out` that `source` has under the same name gets the source's CPU float32
// storage (a copy where the source's is on another device or of another type). Shared rather than
// copied: a compressed model would otherwise double the memory of everything the conversion leaves
// unchanged. set_ rebinds the parameter's TensorImpl, so the model's own handles to it
// (EncoderLayer) see the shared storage too. Call under InferenceMode; throws on a shape mismatch.
void ShareParameters(const model::BertClassifier& source, model::BertClassifier* out) {
  std::map<std::string, at::Tensor> src_params;
  for (const auto& item : source.named_parameters(true)) src_params[item.key()] = item.value();
  for (auto& item : out->named_parameters(true)) {
    auto it = src_params.find(item.key());
    if (it == src_params.end()) continue;
    at::Tensor src = it->second.to(at::kCPU, at::kFloat);  // no copy when it already is
    if (src.sizes() == item.value().sizes()) {
      item.value().set_(src);
    } else {
      item.value().copy_(src);  // throws, naming the shapes
    }
  }
}

absl::StatusOr<PassModel> PassModel::On(const model::BertClassifier& m, const c10::Device& device, bool copy) {
  PassModel p;
  p.model_ = &m;
  const bool there = device.is_cpu() ? m.device().is_cpu() : m.device() == device;  // cpu:0 is the CPU
  if (!copy && there && m.dtype() == c10::kFloat) return p;
  if (m.weights_released()) return ReleasedWeightsError();
  try {
    // Normal tensors, whatever mode the caller is in: Prepare writes into the copy's own.
    std::unique_ptr<model::BertClassifier> copy;
    {
      c10::InferenceMode normal_tensors(false);
      copy = std::make_unique<model::BertClassifier>(m.config());
    }
    {
      c10::InferenceMode guard;
      ShareParameters(m, copy.get());
    }
    // Moves the copy's own handles (set_data), never m's: the two share storage only until then.
    copy->Prepare(device, c10::kFloat, /*pack_weights=*/false);
    p.copy_ = std::move(copy);
  } catch (const std::exception& e) {
    return model::TorchErrorStatus(absl::StrCat("copying the model to ", device.str(), " for its passes failed"), e);
  }
  return p;
}

int PassWorkers(const model::BertClassifier& m, size_t batches) {
  const int per_cpu = m.device().is_cpu() ? util::UsableCpus() / std::max(1, at::get_num_threads()) : 1;
  return std::max(1, std::min<int>(per_cpu, static_cast<int>(batches)));
}

absl::StatusOr<std::unique_ptr<model::BertClassifier>> AssembleCollaborative(
    const model::BertClassifier& source, const std::vector<const LayerDecomposition*>& layers,
    const CompressOptions& o, CompressReport* report) {
  const model::BertConfig& sc = source.config();
  const int L = sc.num_hidden_layers, H = sc.num_attention_heads, dk = sc.head_size();
  if (static_cast<int>(layers.size()) != L) {
    return absl::InternalError(absl::StrCat("assembling ", layers.size(), " layers for a model of ", L));
  }
  // The new model: the same tensors, collaborative attention where a rank was chosen.
  model::BertConfig nc = sc;
  nc.collaborative.ranks.clear();
  nc.collaborative.errors.clear();
  bool any_iterative = false;
  for (const LayerDecomposition* d : layers) {
    nc.collaborative.ranks.push_back(d->report.rank);
    nc.collaborative.errors.push_back(d->report.relative_error);
    any_iterative |= d->report.rank > 0 && !d->report.exact;
  }
  nc.collaborative.algorithm = any_iterative ? "cp-als" : "exact-block";
  nc.collaborative.source = o.source;
  auto out = std::make_unique<model::BertClassifier>(nc);
  try {
    c10::InferenceMode guard;
    ShareParameters(source, out.get());
    const double scale = 1.0 / std::sqrt(static_cast<double>(dk));
    for (int i = 0; i < L; ++i) {
      if (!layers[i]->cp) continue;
      const CpResult& r = *layers[i]->cp;
      model::EncoderLayer& dst = out->layers()[i];
      const model::EncoderLayer& src = source.layers()[i];
      const int R = layers[i]->report.rank;
      // ExactBlockCp / FactorizedCpAls may pad with zero columns beyond R; keep the first R.
      dst.collab_query_w.copy_(r.query.narrow(1, 0, R).t().to(at::kCPU, at::kFloat));
      dst.collab_key_w.copy_(r.key.narrow(1, 0, R).t().to(at::kCPU, at::kFloat));
      dst.mixing.copy_((r.mixing.narrow(1, 0, R).to(at::kCPU, at::kDouble) * scale).to(at::kFloat));
      // v_i = W_K^(i) b_Q^(i): [H, D, dk] × [H, dk] → [H, D].
      at::Tensor Q = src.key_w.to(at::kCPU, at::kDouble).view({H, dk, -1}).transpose(1, 2);
      at::Tensor bq = src.query_b.to(at::kCPU, at::kDouble).view({H, dk, 1});
      dst.content_bias.copy_((at::bmm(Q, bq).squeeze(2) * scale).to(at::kFloat));
    }
  } catch (const std::exception& e) {
    return model::TorchErrorStatus("building the collaborative model failed", e);
  }

  model::ParamCounts before = model::CountParams(source), after = model::CountParams(*out);
  report->layers.clear();
  for (const LayerDecomposition* d : layers) report->layers.push_back(d->report);
  report->qk_params_before = before.attention_qk;
  report->qk_params_after = after.attention_qk;
  report->total_params_before = before.total;
  report->total_params_after = after.total;
  return out;
}

absl::Status ReleasedWeightsError() {
  return absl::FailedPreconditionError(
      "the model was prepared for serving and keeps its dense weights only in packed form; load "
      "it with pack_weights = false (as upload jobs and `collabserve-model compress` do) to "
      "compress it");
}

absl::Status CheckConvertible(const model::BertClassifier& source, const CompressOptions& o) {
  const model::BertConfig& sc = source.config();
  if (sc.collaborative.present()) {
    return absl::InvalidArgumentError("the model is already collaborative; compress the original instead");
  }
  if (source.weights_released()) return ReleasedWeightsError();
  RETURN_IF_ERROR(model::ParseDevice(o.device).status());
  if (o.max_iters < 1) return absl::InvalidArgumentError("max_iters must be at least 1");
  if (!(o.tol >= 0) || !std::isfinite(o.tol)) return absl::InvalidArgumentError("tol must be a finite number >= 0");
  if (!(o.search_seconds >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("search_seconds must be >= 0 (0: no limit), got ", o.search_seconds));
  }
  const int L = sc.num_hidden_layers;
  if (!o.whitening.empty()) {
    if (static_cast<int>(o.whitening.size()) != L) {
      return absl::InvalidArgumentError(
          absl::StrCat("whitening has ", o.whitening.size(), " layers, the model ", L));
    }
    for (int i = 0; i < L; ++i) {
      for (const at::Tensor* t : {&o.whitening[i].query_factor, &o.whitening[i].key_factor}) {
        if (!t->defined() || t->dim() != 2 || t->size(0) != sc.hidden_size || t->size(1) != sc.hidden_size) {
          return absl::InvalidArgumentError(
              absl::StrCat("whitening of layer ", i, ": factors must be [", sc.hidden_size, ", ", sc.hidden_size, "]"));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace internal

absl::StatusOr<std::unique_ptr<model::BertClassifier>> ConvertToCollaborative(
    const model::BertClassifier& source, const CompressOptions& o, CompressReport* report) {
  RETURN_IF_ERROR(internal::CheckConvertible(source, o));
  const model::BertConfig& sc = source.config();
  if (o.spec.kind == RankSpec::Kind::kTargetAgreement || o.spec.kind == RankSpec::Kind::kMaxKl) {
    return absl::InvalidArgumentError(
        "a fidelity target needs texts to measure on: use CompressLoadedModel or CompressModelDirectory");
  }
  ASSIGN_OR_RETURN(std::vector<int> ranks, ResolveRanks(o.spec, sc));
  ASSIGN_OR_RETURN(c10::Device device, model::ParseDevice(o.device));
  const int L = sc.num_hidden_layers, full = sc.hidden_size;
  ASSIGN_OR_RETURN(const int n_workers, ResolveParallelLayers(o.parallel_layers, L, device.is_cpu()));
  report->parallel_layers = n_workers;
  // The work queue: costliest layers first (a rank search, then by rank; ties in layer order), so
  // that the last layers handed out are the short ones and the workers finish together.
  auto cost = [&](int i) { return ranks[i] < 0 ? 2 * full : ranks[i]; };
  std::vector<int> order(L);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return cost(a) > cost(b); });

  std::vector<internal::LayerDecomposition> layers(L);
  auto t0 = Clock::now();
  RETURN_IF_ERROR(internal::ForEachLayer(order, n_workers, device.is_cpu(), o, [&](int i) -> absl::Status {
    absl::StatusOr<internal::LayerDecomposition> d = internal::DecomposeLayer(source, i, ranks[i], o);
    if (!d.ok()) return util::Prefixed(d.status(), absl::StrCat("layer ", i, ": "));
    layers[i] = *std::move(d);
    if (o.on_layer) o.on_layer(layers[i].report);
    return absl::OkStatus();
  }));
  report->decompose_seconds = SecondsSince(t0);
  std::vector<const internal::LayerDecomposition*> chosen;
  for (const auto& d : layers) chosen.push_back(&d);
  return internal::AssembleCollaborative(source, chosen, o, report);
}

absl::StatusOr<std::vector<std::string>> ParseCalibrationText(std::string_view bytes, const std::string& name) {
  if (size_t nul = bytes.find('\0'); nul != std::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": a NUL byte at offset ", nul, ": not a text file (one text per line)"));
  }
  std::vector<std::string> out;
  std::vector<char32_t> scratch;
  size_t line_no = 0, pos = 0;
  while (pos <= bytes.size()) {
    size_t end = bytes.find('\n', pos);
    if (end == std::string_view::npos) end = bytes.size();
    std::string_view line = bytes.substr(pos, end - pos);
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (!text::DecodeUtf8(line, &scratch).ok()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": line ", line_no, " is not valid UTF-8"));
    }
    if (line.find_first_not_of(" \t") != std::string_view::npos) out.emplace_back(line);
    pos = end + 1;
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(name, ": no text lines"));
  return out;
}

namespace internal {
// (Padding the probes to the longest of all wasted a third of the fidelity step.)
absl::StatusOr<TextBatches> TokenizeInBatches(const model::BertClassifier& model, const std::string& vocab_dir,
                                              const std::vector<std::string>& texts, const char* what,
                                              const std::atomic<bool>* cancelled) {
  ASSIGN_OR_RETURN(auto tok, text::BertTokenizer::FromDirectory(vocab_dir));
  // Cut where the engine cuts them when it serves the model (Classify's default is to truncate), so
  // that the fidelity figures and the whitening describe the texts the model answers.
  const int max_len = model.config().max_input_length(tok->options().model_max_length);
  TextBatches out;
  out.cancelled = cancelled;
  out.texts = static_cast<int64_t>(texts.size());
  std::vector<text::Encoding> enc;
  enc.reserve(texts.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    auto e = tok->Encode(texts[i], std::nullopt, max_len, true);
    if (!e.ok()) return absl::InvalidArgumentError(absl::StrCat(what, " ", i + 1, ": ", e.status().message()));
    out.truncated += e->truncated;
    out.tokens += static_cast<int64_t>(e->input_ids.size());
    enc.push_back(*std::move(e));
  }
  std::vector<size_t> order(enc.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return enc[a].input_ids.size() < enc[b].input_ids.size();
  });
  constexpr size_t kBatch = 16;
  try {
    for (size_t start = 0; start < order.size(); start += kBatch) {
      const size_t n = std::min(kBatch, order.size() - start);
      const size_t S = enc[order[start + n - 1]].input_ids.size();  // the longest of the batch
      TextBatch b;
      b.ids = at::zeros({int64_t(n), int64_t(S)}, at::kLong);
      b.mask = at::zeros_like(b.ids);
      int64_t* ids = b.ids.data_ptr<int64_t>();
      int64_t* mask = b.mask.data_ptr<int64_t>();
      for (size_t i = 0; i < n; ++i) {
        const std::vector<int32_t>& in = enc[order[start + i]].input_ids;
        for (size_t j = 0; j < in.size(); ++j) {
          ids[i * S + j] = in[j];
          mask[i * S + j] = 1;
        }
      }
      b.types = at::zeros_like(b.ids);
      out.batches.push_back(std::move(b));
    }
  } catch (const std::exception& e) {
    return model::TorchErrorStatus(absl::StrCat("batching the ", what, "s failed"), e);
  }
  return out;
}

absl::Status ForEachBatch(size_t n, int workers, const std::function<void(int, size_t)>& fn,
                          const std::atomic<bool>* cancelled) {
  const int W = std::max(1, std::min<int>(workers, static_cast<int>(n)));
  const int intra_op = at::get_num_threads();
  std::atomic<bool> failed{false}, saw_cancel{false};
  std::mutex mu;
  absl::Status status;
  auto work = [&](int w) {
    try {
      c10::InferenceMode guard;
      model::SetThisThreadIntraOpThreads(intra_op);
      // Passes as Engine::Run's: on the arena that keeps their pages (this thread for its life).
      const model::PassArena::Pass pass = model::PassArena::Shared().BeginPass();
      for (size_t i = w; i < n && !failed; i += W) {
        if (cancelled != nullptr && cancelled->load()) {
          saw_cancel = failed = true;
          break;
        }
        fn(w, i);
      }
    } catch (const std::exception& e) {
      failed = true;  // the other workers stop at their next batch
      std::lock_guard<std::mutex> lock(mu);
      if (status.ok()) status = model::TorchErrorStatus("running the texts failed", e);
    }
  };
  std::vector<std::thread> threads;
  for (int w = 1; w < W; ++w) threads.emplace_back(work, w);
  work(0);
  for (auto& t : threads) t.join();
  if (status.ok() && saw_cancel) return absl::CancelledError("compression cancelled");
  return status;
}

LayerInputSums::LayerInputSums(int workers, size_t layers, int64_t hidden, const c10::Device& device)
    : D_(hidden), tokens_(static_cast<size_t>(std::max(1, workers)), 0) {
  const at::TensorOptions sums = at::TensorOptions().dtype(at::kDouble).device(device);
  for (size_t w = 0; w < tokens_.size(); ++w) {
    second_moment_.emplace_back();
    mean_.emplace_back();
    for (size_t l = 0; l < layers; ++l) {
      second_moment_[w].push_back(at::zeros({D_, D_}, sums));
      mean_[w].push_back(at::zeros({D_}, sums));
    }
  }
}

at::Tensor LayerInputSums::Rows(const at::Tensor& mask, const c10::Device& device) {
  return mask.view({-1}).nonzero().squeeze(1).to(device);
}

void LayerInputSums::Add(int w, size_t layer, const at::Tensor& h, const at::Tensor& keep) {
  // The batch's xᵀx in float32 on the CPU, added to the float64 sums: the sgemm runs at twice
  // the dgemm's rate and needs no float64 copy of the rows (BERT-base's calibration pass: 0.95×
  // the time). A batch has ~1,400 rows (16 texts), so its float32 sums are good to ~1e-6 of
  // |x|², far below the damping (0.01 of the mean diagonal). On a GPU it stays float64: a
  // data-centre GPU runs it at float32's rate, and a float32 product there would round to TF32
  // wherever a caller allowed it.
  const at::ScalarType product = h.is_cpu() ? at::kFloat : at::kDouble;
  const at::Tensor x = h.reshape({-1, D_}).index_select(0, keep).to(product);
  second_moment_[w][layer].add_(at::mm(x.t(), x));
  mean_[w][layer].add_(x.sum(0, /*keepdim=*/false, at::kDouble));
  if (layer == 0) tokens_[w] += keep.size(0);
}

void LayerInputSums::Finish(CalibrationStats* st) const {
  st->tokens = 0;
  for (int64_t t : tokens_) st->tokens += t;
  st->second_moment.clear();
  st->mean.clear();
  for (size_t l = 0; l < second_moment_[0].size(); ++l) {
    at::Tensor m2 = second_moment_[0][l].clone(), mu = mean_[0][l].clone();
    for (size_t w = 1; w < tokens_.size(); ++w) {
      m2.add_(second_moment_[w][l]);
      mu.add_(mean_[w][l]);
    }
    st->second_moment.push_back(m2.div_(static_cast<double>(st->tokens)).to(at::kCPU));
    st->mean.push_back(mu.div_(static_cast<double>(st->tokens)).to(at::kCPU));
  }
}

absl::StatusOr<std::vector<at::Tensor>> EmbedBatches(const model::BertClassifier& model, const TextBatches& tb,
                                                     int workers) {
  std::vector<at::Tensor> hidden(tb.batches.size());
  RETURN_IF_ERROR(ForEachBatch(tb.batches.size(), workers, [&](int, size_t b) {
    hidden[b] = model.Embeddings(tb.batches[b].ids, tb.batches[b].types);
  }, tb.cancelled));
  return hidden;
}

absl::Status AdvanceBatches(const model::BertClassifier& model, size_t layer, const TextBatches& tb, int workers,
                            std::vector<at::Tensor>* hidden) {
  return ForEachBatch(tb.batches.size(), workers, [&](int, size_t b) {
    (*hidden)[b] = model.RunLayers(layer, layer + 1, (*hidden)[b], tb.batches[b].mask);
  }, tb.cancelled);
}

absl::StatusOr<std::vector<at::Tensor>> BatchLogits(const model::BertClassifier& m, const TextBatches& tb,
                                                    int workers) {
  std::vector<at::Tensor> out(tb.batches.size());
  RETURN_IF_ERROR(ForEachBatch(tb.batches.size(), workers, [&](int, size_t i) {
    const TextBatch& b = tb.batches[i];
    out[i] = m.Forward(b.ids, b.types, b.mask).to(at::kDouble);
  }, tb.cancelled));
  return out;
}

absl::StatusOr<FidelityReport> CompareLogits(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                                             int64_t texts, model::OutputFunction fn) {
  FidelityReport f;
  double kl_sum = 0;
  int64_t agree = 0;
  try {
    c10::InferenceMode guard;
    for (size_t i = 0; i < a.size(); ++i) {
      f.max_abs_logit_diff = std::max(f.max_abs_logit_diff, (a[i] - b[i]).abs().max().item<double>());
      switch (fn) {
        case model::OutputFunction::kSoftmax: {
          agree += a[i].argmax(1).eq(b[i].argmax(1)).sum().item<int64_t>();
          at::Tensor lp = at::log_softmax(a[i], 1), lq = at::log_softmax(b[i], 1);
          kl_sum += (lp.exp() * (lp - lq)).sum().item<double>();
          break;
        }
        case model::OutputFunction::kSigmoid: {
          // Each label is its own yes/no (p = sigmoid(logit), decided at p > 0.5, i.e. logit > 0):
          // a text agrees when every label's decision does; its KL is the sum of the labels'
          // Bernoulli KLs, from log-sigmoids (no 0 · log 0).
          agree += a[i].gt(0).eq(b[i].gt(0)).all(1).sum().item<int64_t>();
          at::Tensor lp = at::log_sigmoid(a[i]), lq = at::log_sigmoid(b[i]);
          at::Tensor lnp = at::log_sigmoid(-a[i]), lnq = at::log_sigmoid(-b[i]);
          kl_sum += (lp.exp() * (lp - lq) + lnp.exp() * (lnp - lnq)).sum().item<double>();
          break;
        }
        case model::OutputFunction::kNone:
          break;  // regression: only max_abs_logit_diff means anything
      }
    }
  } catch (const std::exception& e) {
    return model::TorchErrorStatus("fidelity measurement failed", e);
  }
  f.probes = static_cast<int>(texts);
  if (fn == model::OutputFunction::kNone) {
    f.top1_agreement = std::numeric_limits<double>::quiet_NaN();
    f.mean_kl = std::numeric_limits<double>::quiet_NaN();
    f.agreement_lower95 = std::numeric_limits<double>::quiet_NaN();
    return f;
  }
  f.top1_agreement = texts == 0 ? 1.0 : static_cast<double>(agree) / texts;
  f.agreement_lower95 = WilsonLower95(agree, texts);
  f.mean_kl = texts == 0 ? 0.0 : kl_sum / texts;
  return f;
}

}  // namespace internal

absl::StatusOr<CalibrationStats> CollectCalibrationStats(const model::BertClassifier& model,
                                                         const std::string& vocab_dir,
                                                         const std::vector<std::string>& texts,
                                                         const std::atomic<bool>* cancelled) {
  if (texts.empty()) return absl::InvalidArgumentError("calibration: no texts");
  const auto start = Clock::now();
  ASSIGN_OR_RETURN(internal::TextBatches tb,
                   internal::TokenizeInBatches(model, vocab_dir, texts, "calibration text", cancelled));
  CalibrationStats st;
  st.truncated = tb.truncated;
  const size_t L = model.layers().size();
  // The batches run on every CPU the caller's ATen threads leave (on a GPU, one thread), each
  // batch through every layer, its tokens added to its worker's sums.
  const int workers = internal::PassWorkers(model, tb.batches.size());
  try {
    internal::LayerInputSums sums(workers, L, model.config().hidden_size, model.device());
    absl::Status pass = internal::ForEachBatch(tb.batches.size(), workers, [&](int w, size_t i) {
      const internal::TextBatch& b = tb.batches[i];
      std::vector<at::Tensor> inputs = model.LayerInputs(b.ids, b.types, b.mask);
      const at::Tensor rows = internal::LayerInputSums::Rows(b.mask, model.device());
      for (size_t l = 0; l < L; ++l) sums.Add(w, l, inputs[l], rows);
    }, tb.cancelled);
    if (absl::IsCancelled(pass)) return pass;
    if (!pass.ok()) return absl::InternalError(absl::StrCat("calibration pass failed: ", pass.message()));
    c10::InferenceMode guard;
    sums.Finish(&st);
  } catch (const std::exception& e) {
    return model::TorchErrorStatus("calibration pass failed", e);
  }
  st.texts = static_cast<int64_t>(texts.size());
  st.seconds = SecondsSince(start);
  return st;
}

namespace internal {
absl::StatusOr<LayerWhitening> WhitenLayer(const at::Tensor& m2, const at::Tensor& mu, double damping, size_t layer) {
  try {
    const int64_t D = m2.size(0);
    auto factor = [&](const at::Tensor& sigma, const char* what) -> absl::StatusOr<at::Tensor> {
      const double lambda = damping * sigma.trace().item<double>() / static_cast<double>(D);
      at::Tensor a = sigma + lambda * at::eye(D, at::kDouble);
      auto [L, info] = at::linalg_cholesky_ex(a);
      if (info.item<int64_t>() != 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "layer ", layer, ": the ", what, " of its calibration inputs is not positive definite (damping ",
            damping, "); use more calibration text or a larger damping"));
      }
      return L;
    };
    LayerWhitening w;
    ASSIGN_OR_RETURN(w.query_factor, factor(m2, "second moment"));
    ASSIGN_OR_RETURN(w.key_factor, factor(m2 - at::outer(mu, mu), "covariance"));
    return w;
  } catch (const std::exception& e) {
    return model::TorchErrorStatus("whitening failed", e);
  }
}
}  // namespace internal

absl::StatusOr<std::vector<LayerWhitening>> WhiteningFromStats(const CalibrationStats& stats, double damping) {
  RETURN_IF_ERROR(CheckDamping(damping));
  std::vector<LayerWhitening> out;
  for (size_t l = 0; l < stats.second_moment.size(); ++l) {
    ASSIGN_OR_RETURN(LayerWhitening w, internal::WhitenLayer(stats.second_moment[l], stats.mean[l], damping, l));
    out.push_back(std::move(w));
  }
  return out;
}

absl::StatusOr<FidelityReport> MeasureFidelity(const model::BertClassifier& original,
                                               const model::BertClassifier& compressed,
                                               const std::string& vocab_dir,
                                               const std::vector<std::string>& probes_in,
                                               const std::atomic<bool>* cancelled) {
  const std::vector<std::string>& probes = probes_in.empty() ? model::BuiltinProbeSentences() : probes_in;
  ASSIGN_OR_RETURN(internal::TextBatches tb,
                   internal::TokenizeInBatches(original, vocab_dir, probes, "probe", cancelled));
  // Both models' logits for every batch. When the caller's passes leave CPUs idle (an admin job
  // runs ATen and OpenBLAS single-threaded), the compressed model runs on a second thread at the
  // same time as the original, so the step costs one model's passes instead of two. The thread
  // runs ATen with the caller's intra-op thread count and inherits its scheduling priority.
  const bool concurrent = original.device().is_cpu() && compressed.device().is_cpu() &&
                          2 * at::get_num_threads() <= util::UsableCpus() && util::BlasThreads() <= 1;
  absl::StatusOr<std::vector<at::Tensor>> a, b;
  std::thread other;
  if (concurrent) other = std::thread([&] { b = internal::BatchLogits(compressed, tb, 1); });
  a = internal::BatchLogits(original, tb, 1);
  if (other.joinable()) other.join();
  if (!concurrent && a.ok()) b = internal::BatchLogits(compressed, tb, 1);
  RETURN_IF_ERROR(a.status());
  RETURN_IF_ERROR(b.status());
  ASSIGN_OR_RETURN(FidelityReport report,
                   internal::CompareLogits(*a, *b, tb.texts, original.config().output_function()));
  report.truncated = tb.truncated;
  return report;
}

double WilsonLower95(int64_t hits, int64_t n) {
  if (n <= 0) return 0.0;
  constexpr double z = 1.6448536269514722;  // the standard normal's 95th percentile
  const double nn = static_cast<double>(n), p = static_cast<double>(hits) / nn;
  const double center = p + z * z / (2 * nn);
  const double margin = z * std::sqrt(p * (1 - p) / nn + z * z / (4 * nn * nn));
  return std::max(0.0, (center - margin) / (1 + z * z / nn));
}

absl::StatusOr<FidelityReport> CompareLogitRows(const std::vector<std::vector<float>>& reference,
                                                const std::vector<std::vector<float>>& candidate,
                                                model::OutputFunction fn) {
  if (reference.size() != candidate.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("logits to compare: ", reference.size(), " reference rows but ", candidate.size(), " others"));
  }
  const int64_t rows = static_cast<int64_t>(reference.size());
  const int64_t width = rows == 0 ? 0 : static_cast<int64_t>(reference[0].size());
  std::vector<double> a, b;
  a.reserve(rows * width);
  b.reserve(rows * width);
  for (int64_t r = 0; r < rows; ++r) {
    if (reference[r].empty() || static_cast<int64_t>(reference[r].size()) != width ||
        candidate[r].size() != reference[r].size()) {
      return absl::InvalidArgumentError(absl::StrCat("logits to compare: row ", r, " has ", reference[r].size(),
                                                     " reference and ", candidate[r].size(),
                                                     " other logits; every row needs the same number, at least one"));
    }
    a.insert(a.end(), reference[r].begin(), reference[r].end());
    b.insert(b.end(), candidate[r].begin(), candidate[r].end());
  }
  if (rows == 0) return internal::CompareLogits({}, {}, 0, fn);
  try {
    const std::vector<at::Tensor> ta = {at::tensor(a, at::kDouble).view({rows, width})};
    const std::vector<at::Tensor> tb = {at::tensor(b, at::kDouble).view({rows, width})};
    return internal::CompareLogits(ta, tb, rows, fn);
  } catch (const std::exception& e) {
    return model::TorchErrorStatus("fidelity measurement failed", e);
  }
}

std::string CompressReport::ToJson() const {
  nlohmann::json layers_j = nlohmann::json::array();
  for (const LayerReport& l : layers) {
    layers_j.push_back({{"layer", l.layer},
                        {"rank", l.rank},
                        {"relative_error", l.relative_error},
                        {"iterations", l.iterations},
                        {"seconds", l.seconds},
                        {"cp_seconds",
                         {{"setup", l.setup_seconds}, {"sweeps", l.sweep_seconds}, {"finish", l.finish_seconds}}},
                        {"extrapolations", l.extrapolations},
                        {"exact", l.exact},
                        {"ranks_tried", l.ranks_tried}});
    if (l.activation_error >= 0) layers_j.back()["activation_error"] = l.activation_error;
  }
  auto fidelity_json = [](const FidelityReport& f) {
    return nlohmann::json{{"probes", f.probes},
                          {"truncated_probes", f.truncated},
                          {"top1_agreement", f.top1_agreement},
                          {"top1_agreement_lower95", f.agreement_lower95},
                          {"max_abs_logit_diff", f.max_abs_logit_diff},
                          {"mean_kl", f.mean_kl}};
  };
  nlohmann::json j{
      {"layers", layers_j},
      {"parameters",
       {{"attention_qk_before", qk_params_before},
        {"attention_qk_after", qk_params_after},
        {"attention_qk_ratio", qk_params_after ? double(qk_params_before) / qk_params_after : 0.0},
        {"total_before", total_params_before},
        {"total_after", total_params_after},
        {"total_ratio", total_params_after ? double(total_params_before) / total_params_after : 0.0}}},
      {"fidelity", fidelity_json(fidelity)},
      {"decompose_seconds", decompose_seconds},
      {"steps",
       {{"load_seconds", load_seconds},
        {"convert_seconds", convert_seconds},
        {"fidelity_seconds", fidelity_seconds},
        {"write_seconds", write_seconds}}},
      {"parallel_layers", parallel_layers},
      {"whitening",
       {{"on", whitened},
        {"note", whitening_note},
        {"fit_texts", calibration_fit_texts},
        {"heldout_texts", calibration_heldout_texts},
        {"tokens", calibration_tokens},
        {"truncated_texts", calibration_truncated},
        {"seconds", calibration_seconds}}},
      {"seconds", seconds}};
  if (search.ran) {
    nlohmann::json trials = nlohmann::json::array();
    for (const RankSearchReport::Trial& t : search.trials) {
      trials.push_back({{"ranks", t.ranks},
                        {"attention_qk", t.qk_params},
                        {"fidelity", fidelity_json(t.fidelity)},
                        {"meets", t.meets},
                        {"seconds", t.seconds}});
    }
    j["search"] = {{"target", search.target},
                   {"texts", search.texts},
                   {"grid", search.grid},
                   {"decompositions", search.decompositions},
                   {"sensitivity_ranks", search.sensitivity_ranks},
                   {"layer_kl", search.layer_kl},
                   {"kl_exponent", search.kl_exponent},
                   {"candidates", search.candidates},
                   {"trials", trials},
                   {"chosen", search.chosen},
                   {"time_limited", search.time_limited},
                   {"decompose_seconds", search.decompose_seconds},
                   {"sensitivity_seconds", search.sensitivity_seconds},
                   {"seconds", search.seconds}};
  }
  return j.dump();
}

absl::StatusOr<CompressReport> CompressModelDirectory(const std::string& in_dir, const std::string& out_arg,
                                                      const CompressOptions& options) {
  auto t0 = Clock::now();
  const std::string out_dir = util::DirectoryName(out_arg);
  std::error_code ec;
  if (std::filesystem::exists(out_dir, ec)) {
    return absl::AlreadyExistsError(absl::StrCat(out_dir, ": already exists; choose a new output directory"));
  }
  ASSIGN_OR_RETURN(model::BertConfig config, model::BertConfig::FromFile(util::JoinPath(in_dir, "config.json")));
  if (config.collaborative.present()) {
    return absl::InvalidArgumentError(absl::StrCat(in_dir, ": the model is already collaborative"));
  }
  if (options.on_step) options.on_step("load");
  ASSIGN_OR_RETURN(auto source, model::LoadClassifier(in_dir, config));
  try {
    source->Prepare(c10::Device(c10::kCPU), c10::kFloat, /*pack_weights=*/false);
  } catch (const std::exception& e) {
    return model::TorchErrorStatus(absl::StrCat(in_dir, ": preparing the model failed"), e);
  }
  const double load_seconds = SecondsSince(t0);
  ASSIGN_OR_RETURN(CompressReport report, CompressLoadedModel(*source, in_dir, out_dir, options));
  report.load_seconds = load_seconds;
  report.seconds = SecondsSince(t0);
  return report;
}

namespace {
// Fits the whitening on the first part of o->calibration (run through `passes`, the source where
// the passes run) and, when no probes were given, makes the rest the fidelity probes; records both
// in the report. Without `statistics` it only splits the texts (and checks the damping): the caller
// measures the statistics itself (ConvertOnCompressedInputs).
absl::Status PrepareWhitening(const model::BertClassifier& passes, const std::string& vocab_dir,
                              CompressOptions* o, CompressReport* report, std::vector<std::string>* fit_out,
                              bool statistics) {
  const int64_t n = static_cast<int64_t>(o->calibration.size());
  if (n < kMinCalibrationTexts) {
    return absl::InvalidArgumentError(absl::StrCat("calibration: ", n, " texts; at least ",
                                                   kMinCalibrationTexts, " are needed"));
  }
  if (!(o->calibration_fit_fraction > 0 && o->calibration_fit_fraction <= 1)) {
    return absl::InvalidArgumentError("calibration_fit_fraction must be in (0, 1]");
  }
  const int64_t fit = std::max<int64_t>(1, std::min<int64_t>(
      n, static_cast<int64_t>(std::ceil(o->calibration_fit_fraction * static_cast<double>(n)))));
  std::vector<std::string>& fit_texts = *fit_out;
  fit_texts.assign(o->calibration.begin(), o->calibration.begin() + fit);
  RETURN_IF_ERROR(CheckDamping(o->whiten_damping));
  report->whitened = true;
  report->calibration_fit_texts = fit;
  report->calibration_heldout_texts = n - fit;
  if (statistics) {
    auto t = Clock::now();
    ASSIGN_OR_RETURN(CalibrationStats stats, CollectCalibrationStats(passes, vocab_dir, fit_texts, o->cancelled));
    ASSIGN_OR_RETURN(o->whitening, WhiteningFromStats(stats, o->whiten_damping));
    report->calibration_tokens = stats.tokens;
    report->calibration_truncated = stats.truncated;
    report->calibration_seconds = SecondsSince(t);
  }
  if (o->probes.empty() && fit < n) {
    o->probes.assign(o->calibration.begin() + fit, o->calibration.end());
    report->fidelity_texts = "held-out calibration texts";
    report->whitening_note = absl::StrCat("fitted on ", fit, " calibration texts; fidelity on the other ", n - fit);
  } else {
    report->whitening_note = absl::StrCat("fitted on ", fit, " calibration texts; fidelity on ",
                                          o->probes.empty() ? "the built-in probes" : "the given probes");
  }
  return absl::OkStatus();
}

// ConvertToCollaborative with CompressOptions::whiten_compressed_inputs: layer by layer, each
// whitened by the statistics of its inputs in the model whose earlier layers are already
// converted (layer 0's are the original's). The fit texts' hidden states entering layer l in that
// model are kept for all the texts (tokens × hidden × 4 bytes: ~0.2 GB for 820 texts on
// BERT-base) and advanced one layer at a time: one pass of the model in all, where a whole pass of
// the partly converted model for every layer made L. Records the tokens in the report.
absl::StatusOr<std::unique_ptr<model::BertClassifier>> ConvertOnCompressedInputs(
    const model::BertClassifier& source, const model::BertClassifier& passes, const std::string& vocab_dir,
    const std::vector<std::string>& fit_texts, CompressOptions o, CompressReport* report) {
  RETURN_IF_ERROR(internal::CheckConvertible(source, o));
  ASSIGN_OR_RETURN(std::vector<int> ranks, ResolveRanks(o.spec, source.config()));
  ASSIGN_OR_RETURN(const c10::Device device, model::ParseDevice(o.device));
  const int L = source.config().num_hidden_layers;
  std::vector<internal::LayerDecomposition> layers(L), standard(L);
  std::vector<const internal::LayerDecomposition*> chosen(L);
  for (int i = 0; i < L; ++i) {
    standard[i].report.layer = i;
    chosen[i] = &standard[i];
  }
  // The model converted so far, where the passes run.
  auto converted = [&]() -> absl::StatusOr<std::unique_ptr<model::BertClassifier>> {
    CompressReport scratch;
    ASSIGN_OR_RETURN(auto m, internal::AssembleCollaborative(source, chosen, o, &scratch));
    try {
      m->Prepare(device, c10::kFloat, /*pack_weights=*/false);
    } catch (const std::exception& e) {
      return model::TorchErrorStatus("preparing the partly converted model failed", e);
    }
    return m;
  };
  auto t = Clock::now();
  ASSIGN_OR_RETURN(internal::TextBatches tb,
                   internal::TokenizeInBatches(source, vocab_dir, fit_texts, "calibration text", o.cancelled));
  const size_t n = tb.batches.size();
  report->calibration_truncated = tb.truncated;
  report->calibration_tokens = tb.tokens;
  o.whitening.resize(L);
  // The source (where the passes run) until a layer is converted, then the model converted so far.
  std::unique_ptr<model::BertClassifier> owned;
  const model::BertClassifier* partial = &passes;
  const int workers = internal::PassWorkers(passes, n);
  ASSIGN_OR_RETURN(std::vector<at::Tensor> hidden, internal::EmbedBatches(passes, tb, workers));  // entering layer l
  std::vector<at::Tensor> rows(n);  // each batch's non-padding rows, on the passes' device
  try {
    for (size_t b = 0; b < n; ++b) rows[b] = internal::LayerInputSums::Rows(tb.batches[b].mask, passes.device());
  } catch (const std::exception& e) {
    return model::TorchErrorStatus("the calibration batches' rows", e);
  }
  report->calibration_seconds += SecondsSince(t);
  double decompose_seconds = 0;
  for (int l = 0; l < L; ++l) {
    if (IsCancelled(o)) return absl::CancelledError("compression cancelled");
    if (ranks[l] != 0) {
      t = Clock::now();
      CalibrationStats st;
      try {
        internal::LayerInputSums sums(workers, 1, source.config().hidden_size, passes.device());
        RETURN_IF_ERROR(internal::ForEachBatch(n, workers, [&](int w, size_t b) {
          sums.Add(w, 0, hidden[b], rows[b]);
        }, tb.cancelled));
        c10::InferenceMode guard;
        sums.Finish(&st);
      } catch (const std::exception& e) {
        return model::TorchErrorStatus(absl::StrCat("layer ", l, ": its calibration statistics failed"), e);
      }
      ASSIGN_OR_RETURN(o.whitening[l], internal::WhitenLayer(st.second_moment[0], st.mean[0], o.whiten_damping, l));
      report->calibration_seconds += SecondsSince(t);
    }
    t = Clock::now();
    absl::StatusOr<internal::LayerDecomposition> d = [&] {
      c10::InferenceMode guard;
      return internal::DecomposeLayer(source, l, ranks[l], o);
    }();
    if (!d.ok()) return util::Prefixed(d.status(), absl::StrCat("layer ", l, ": "));
    layers[l] = *std::move(d);
    decompose_seconds += SecondsSince(t);
    chosen[l] = &layers[l];
    if (o.on_layer) o.on_layer(layers[l].report);
    // On to layer l + 1's inputs, while a later layer is still to be whitened by them.
    if (std::any_of(ranks.begin() + l + 1, ranks.end(), [](int r) { return r != 0; })) {
      t = Clock::now();
      if (ranks[l] != 0) {
        ASSIGN_OR_RETURN(owned, converted());
        partial = owned.get();
      }
      RETURN_IF_ERROR(internal::AdvanceBatches(*partial, l, tb, workers, &hidden));
      report->calibration_seconds += SecondsSince(t);
    } else {
      hidden.clear();
    }
  }
  report->decompose_seconds = decompose_seconds;
  report->parallel_layers = 1;
  return internal::AssembleCollaborative(source, chosen, o, report);
}
}  // namespace

absl::StatusOr<CompressReport> CompressLoadedModel(const model::BertClassifier& source,
                                                   const std::string& in_dir, const std::string& out_arg,
                                                   const CompressOptions& options) {
  auto t0 = Clock::now();
  const std::string out_dir = util::DirectoryName(out_arg);
  auto step = [&](const char* name) {
    if (options.on_step) options.on_step(name);
  };
  std::error_code ec;
  if (std::filesystem::exists(out_dir, ec)) {
    return absl::AlreadyExistsError(absl::StrCat(out_dir, ": already exists; choose a new output directory"));
  }
  if (source.config().collaborative.present()) {
    return absl::InvalidArgumentError(absl::StrCat(in_dir, ": the model is already collaborative"));
  }
  if (!source.device().is_cpu() || source.dtype() != c10::kFloat) {
    return absl::InvalidArgumentError(
        absl::StrCat(in_dir, ": the loaded model must be prepared on the CPU in float32 to compress it"));
  }
  if (source.weights_released()) return internal::ReleasedWeightsError();
  // Before any model pass (the calibration pass takes a minute on BERT-base): a bad rank spec or
  // CP option is refused at once, not after it.
  RETURN_IF_ERROR(internal::CheckConvertible(source, options));
  RETURN_IF_ERROR(ResolveRanks(options.spec, source.config()).status());
  CompressOptions o = options;
  if (o.source.empty()) o.source = in_dir;
  ASSIGN_OR_RETURN(const c10::Device device, model::ParseDevice(o.device));
  CompressReport report;
  step("convert");
  const bool target = o.spec.kind == RankSpec::Kind::kTargetAgreement || o.spec.kind == RankSpec::Kind::kMaxKl;
  if (o.whiten_compressed_inputs && (o.calibration.empty() || target)) {
    return absl::InvalidArgumentError(
        "whitening by the compressed model's inputs needs calibration text and a fixed rank spec (not a target)");
  }
  // The source where the model passes run: itself on the CPU; a copy on a GPU.
  ASSIGN_OR_RETURN(const internal::PassModel source_passes, internal::PassModel::On(source, device));
  std::vector<std::string> fit_texts;
  if (!o.calibration.empty() && o.whitening.empty()) {
    RETURN_IF_ERROR(PrepareWhitening(source_passes.get(), in_dir, &o, &report, &fit_texts,
                                     /*statistics=*/!o.whiten_compressed_inputs));
    if (o.whiten_compressed_inputs) absl::StrAppend(&report.whitening_note, "; each layer by its inputs in the compressed model");
  } else if (o.whitening.empty()) {
    report.whitening_note = "off: no calibration text (plain weight-space CP)";
  } else {
    report.whitened = true;
    report.whitening_note = "caller's statistics";
  }
  auto step_start = Clock::now();
  std::unique_ptr<model::BertClassifier> compressed;
  if (report.fidelity_texts.empty()) report.fidelity_texts = o.probes.empty() ? "built-in probes" : "given probes";
  if (o.whiten_compressed_inputs && !fit_texts.empty()) {
    ASSIGN_OR_RETURN(compressed, ConvertOnCompressedInputs(source, source_passes.get(), in_dir, fit_texts, o, &report));
  } else if (target) {
    // The search measures on the same held-out texts as the fidelity step below.
    ASSIGN_OR_RETURN(std::vector<internal::LayerDecomposition> layers,
                     internal::SearchRanks(source, source_passes.get(), in_dir, o.probes, o, &report.search));
    ASSIGN_OR_RETURN(report.parallel_layers,
                     ResolveParallelLayers(o.parallel_layers, source.config().num_hidden_layers, device.is_cpu()));
    report.decompose_seconds = report.search.decompose_seconds;
    std::vector<const internal::LayerDecomposition*> chosen;
    for (internal::LayerDecomposition& d : layers) {
      d.report.ranks_tried = static_cast<int>(report.search.grid.size());
      if (o.on_layer) o.on_layer(d.report);
      chosen.push_back(&d);
    }
    ASSIGN_OR_RETURN(compressed, internal::AssembleCollaborative(source, chosen, o, &report));
  } else {
    ASSIGN_OR_RETURN(compressed, ConvertToCollaborative(source, o, &report));
  }
  try {
    compressed->Prepare(c10::Device(c10::kCPU), c10::kFloat, /*pack_weights=*/false);
  } catch (const std::exception& e) {
    return model::TorchErrorStatus("preparing the compressed model failed", e);
  }
  report.convert_seconds = SecondsSince(step_start);
  step("fidelity");
  step_start = Clock::now();
  // The compressed model stays on the CPU for the write; its probes run where the source's do.
  absl::StatusOr<internal::PassModel> compressed_passes;
  if (report.search.chosen < 0) compressed_passes = internal::PassModel::On(*compressed, device);
  // Everything is written into a temporary sibling, then one rename publishes it. The weights
  // and the tokenizer files do not depend on the fidelity report, so a second thread writes them
  // while the probes run (the write is mostly the kernel copying 100s of MB and waiting for fsync,
  // the probes are compute); only config.json, which records the fidelity, waits for both. The
  // weights stream from the model's tensors into the file (no in-memory copy of the file); both
  // threads only read the compressed model.
  std::string tmp = absl::StrCat(out_dir, ".tmp-", ::getpid(), "-", std::random_device()());
  std::filesystem::create_directories(tmp, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat(tmp, ": cannot create: ", ec.message()));
  auto fail = [&](absl::Status s) {
    std::filesystem::remove_all(tmp, ec);
    return s;
  };
  absl::Status write_status;
  double weights_seconds = 0;
  auto write_weights = [&] {
    const auto write_start = Clock::now();
    write_status = [&]() -> absl::Status {
      try {
        for (const char* name : {"vocab.txt", "tokenizer_config.json", "special_tokens_map.json"}) {
          std::string src = util::JoinPath(in_dir, name);
          // The vocabulary is what serves the model: a checkpoint written without it would load
          // nowhere (the two others are optional).
          ASSIGN_OR_RETURN(bool present, util::PresentFile(src));
          if (!present && std::string(name) == "vocab.txt") {
            return absl::NotFoundError(absl::StrCat(src, ": no such file; the source's vocabulary is needed"));
          }
          if (!present) continue;
          ASSIGN_OR_RETURN(std::string bytes, util::ReadFile(src, 64 << 20));
          RETURN_IF_ERROR(util::WriteFileAtomic(util::JoinPath(tmp, name), bytes));
        }
        c10::InferenceMode guard;
        return model::SaveWeights(*compressed, tmp, model::WeightFormat::kSafetensors,
                                  model::WeightDType::kF32,
                                  {{"format", "pt"}, {"collabserve", "collaborative-v1"}});
      } catch (const std::exception& e) {
        return model::TorchErrorStatus(absl::StrCat(tmp, ": writing the compressed model failed"), e);
      }
    }();
    weights_seconds = SecondsSince(write_start);
  };
  std::thread writer;
  try {
    writer = std::thread(write_weights);
  } catch (const std::system_error& e) {
    LOG(WARNING) << "no thread for the write (" << e.what() << "); writing after the fidelity step";
  }
  absl::StatusOr<FidelityReport> fidelity;
  if (report.search.chosen >= 0) {
    fidelity = report.search.trials[report.search.chosen].fidelity;  // measured on these texts
  } else if (!compressed_passes.ok()) {
    fidelity = compressed_passes.status();
  } else {
    fidelity = MeasureFidelity(source_passes.get(), compressed_passes->get(), in_dir, o.probes, o.cancelled);
  }
  report.fidelity_seconds = SecondsSince(step_start);
  if (writer.joinable()) {
    writer.join();
  } else {
    write_weights();
  }
  if (!fidelity.ok()) return fail(fidelity.status());
  report.fidelity = *fidelity;
  if (IsCancelled(o)) return fail(absl::CancelledError("compression cancelled"));
  if (!write_status.ok()) return fail(write_status);

  step("write");
  step_start = Clock::now();
  // The fidelity goes with the model, so that whoever loads it later (a restarted server's
  // metrics) knows how it agreed with its original.
  // (Figures that are not finite - a model whose logits overflow - are left out: config.json
  // admits only finite ones.)
  model::BertConfig config = compressed->config();
  const FidelityReport& f = report.fidelity;
  if (std::isfinite(f.top1_agreement) && std::isfinite(f.max_abs_logit_diff) && std::isfinite(f.mean_kl)) {
    config.collaborative.fidelity = model::CollaborativeConfig::Fidelity{
        f.probes, f.top1_agreement, f.max_abs_logit_diff, f.mean_kl};
  }
  absl::Status s = util::WriteFileAtomic(util::JoinPath(tmp, "config.json"), config.ToJson());
  if (!s.ok()) return fail(s);
  if (::rename(tmp.c_str(), out_dir.c_str()) != 0) {
    return fail(absl::FailedPreconditionError(absl::StrCat(out_dir, ": cannot publish: ", std::strerror(errno))));
  }
  // The weights' own time (it overlapped the fidelity step) plus config.json and the rename.
  report.write_seconds = weights_seconds + SecondsSince(step_start);
  report.seconds = SecondsSince(t0);
  return report;
}

}  // namespace collabserve::compress
