// Per-layer ranks chosen by a fidelity target (RankSpec kTargetAgreement / kMaxKl).
//
// Layers differ in how much of their Q/K the model's answers need, so a uniform rank spends
// parameters where they buy nothing. The search:
//  1. decomposes every layer at every rank of a geometric grid (steps of √2 from N_h·d_k/2 down to
//     N_h·d_k/64; a layer may also stay standard), whitened when calibration statistics are set;
//  2. measures each layer's KL curve: the mean KL of the model with that layer alone at the grid
//     ranks nearest N_h·d_k/8 and N_h·d_k/16, giving the proxy KL_l(r) ≈ K_l·(e_l(r)/e_l)^p_l
//     through both points, e the layer's (activation-weighted) error at a rank (each measured from
//     the original's hidden states entering the layer: the layers before it are the original's
//     in that model, so they run once for all the measurements). The exponent
//     differs by layer: on the trained demo KL/e² rose 3-6x from rank 32 to 12 in two layers and
//     fell 1.5x in the other two (bench/compress/RESULTS.md, section 11), so one point and p = 2
//     misjudged which layer a rank buys the most in;
//  3. orders the allocations by a greedy walk on each layer's lower convex hull of (Q/K parameters,
//     proxy KL): from every layer at its cheapest point, each step raises the layer whose next hull
//     point removes the most proxy KL per parameter, so the walk visits allocations of rising cost
//     and falling proxy, spending rank where it buys the most fidelity;
//  4. bisects that walk with real measurements (the assembled model on the held-out texts against
//     the original's logits), keeping the cheapest allocation verified to meet the target. Only
//     verified allocations are returned, so the target always holds on the text it was measured on.
// The decompositions of step 1 are reused for every trial and for the result (no CP-ALS after
// step 1).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/compress/collaborative.h"
#include "server/compress/collaborative_internal.h"
#include "server/model/bert.h"
#include "server/model/config.h"
#include "server/model/device.h"
#include "server/model/param_counts.h"
#include "server/model/probe_sentences.h"
#include "server/model/torch_status.h"
#include "server/util/status_macros.h"

namespace collabserve::compress::internal {
namespace {

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Candidate ranks, descending: round(full·2^(-k/2)) for k = 2, 3, ... down to max(1, full/64).
// Above full/2 a collaborative layer saves too little to be worth its CP-ALS time (the sweeps cost
// ~R; a layer that needs more stays standard). Steps of 2^(1/4) were tried on the trained demo:
// twice the decompositions and no better allocation, because the held-out agreement that verifies
// a candidate moves by 1/texts per answer (bench/compress/RESULTS.md, section 10).
std::vector<int> Grid(int full) {
  std::vector<int> g;
  const double floor_rank = std::max(1.0, full / 64.0);
  for (int k = 2;; ++k) {
    const int r = static_cast<int>(std::lround(full * std::pow(2.0, -k / 2.0)));
    if (r < floor_rank - 1e-9 || r < 1) break;
    if (g.empty() || r < g.back()) g.push_back(r);
  }
  return g;
}

// The error that drives a layer's score perturbation: activation-weighted when whitened.
double DrivingError(const LayerReport& r) { return r.activation_error >= 0 ? r.activation_error : r.relative_error; }

// The exponent p of KL ∝ e^p through a layer's measurements (errors[k], kl[k]), the first at the
// higher rank: 2 (a small score perturbation's KL is quadratic in it) when there is one point or
// the two cannot fix it (no KL, errors not falling with the rank); else clamped to [1, 8].
double KlExponent(const std::vector<double>& errors, const std::vector<double>& kl) {
  constexpr double kQuadratic = 2.0;
  if (errors.size() < 2 || kl[0] <= 0 || kl[1] <= 0 || errors[0] <= 0 || errors[1] <= errors[0] * (1 + 1e-9)) {
    return kQuadratic;
  }
  return std::clamp(std::log(kl[1] / kl[0]) / std::log(errors[1] / errors[0]), 1.0, 8.0);
}

// One point of a layer's options: grid index (-1: standard), parameters, proxy KL.
struct Option {
  int grid = -1;
  int64_t params = 0;
  double proxy = 0;
};

// The lower convex hull of options sorted by rising params: each step lowers the proxy, at a
// falling rate per parameter.
std::vector<Option> LowerHull(std::vector<Option> pts) {
  std::vector<Option> hull;
  for (const Option& p : pts) {
    if (!hull.empty() && p.proxy >= hull.back().proxy) continue;  // dearer and no better
    while (hull.size() >= 2) {
      const Option& a = hull[hull.size() - 2];
      const Option& b = hull.back();
      // b is above the segment a-p: drop it.
      const double lhs = (a.proxy - b.proxy) * static_cast<double>(p.params - a.params);
      const double rhs = (a.proxy - p.proxy) * static_cast<double>(b.params - a.params);
      if (lhs <= rhs) {
        hull.pop_back();
      } else {
        break;
      }
    }
    hull.push_back(p);
  }
  return hull;
}

}  // namespace

absl::StatusOr<std::vector<LayerDecomposition>> SearchRanks(const model::BertClassifier& source,
                                                            const model::BertClassifier& passes,
                                                            const std::string& vocab_dir,
                                                            const std::vector<std::string>& texts_in,
                                                            const CompressOptions& o, RankSearchReport* report) {
  const auto t0 = Clock::now();
  RETURN_IF_ERROR(CheckConvertible(source, o));
  const model::BertConfig& cfg = source.config();
  RETURN_IF_ERROR(ResolveRanks(o.spec, cfg).status());
  const bool by_agreement = o.spec.kind == RankSpec::Kind::kTargetAgreement;
  if (!by_agreement && o.spec.kind != RankSpec::Kind::kMaxKl) {
    return absl::InvalidArgumentError("the rank search needs a target_agreement or a max_kl");
  }
  ASSIGN_OR_RETURN(c10::Device device, model::ParseDevice(o.device));
  const int L = cfg.num_hidden_layers, full = cfg.hidden_size;
  RankSearchReport& rep = *report;
  rep = RankSearchReport{};
  rep.ran = true;
  rep.target = by_agreement ? absl::StrFormat("top1_agreement >= %g", o.spec.target_agreement)
                            : absl::StrFormat("mean_kl <= %g", o.spec.max_kl);
  rep.grid = Grid(full);
  const std::vector<int>& grid = rep.grid;
  const int G = static_cast<int>(grid.size());
  auto out_of_time = [&] { return o.search_seconds > 0 && SecondsSince(t0) > o.search_seconds; };
  auto deadline = [&](const char* while_doing) {
    return absl::DeadlineExceededError(absl::StrFormat(
        "the rank search ran past search_seconds (%g s) %s before any allocation was verified; "
        "allow it more time or give a rank",
        o.search_seconds, while_doing));
  };
  auto cancelled = [&] { return o.cancelled && o.cancelled->load(); };

  // The held-out texts and the original's answers on them.
  const std::vector<std::string>& texts = texts_in.empty() ? model::BuiltinProbeSentences() : texts_in;
  ASSIGN_OR_RETURN(TextBatches tb, TokenizeInBatches(source, vocab_dir, texts, "held-out text", o.cancelled));
  rep.texts = static_cast<int>(tb.texts);
  const int eval_workers = PassWorkers(passes, tb.batches.size());
  ASSIGN_OR_RETURN(std::vector<at::Tensor> reference, BatchLogits(passes, tb, eval_workers));

  // 1. Every layer at every grid rank.
  std::vector<std::vector<LayerDecomposition>> table(L, std::vector<LayerDecomposition>(G));
  ASSIGN_OR_RETURN(const int workers, ResolveParallelLayers(o.parallel_layers, L, device.is_cpu()));
  std::vector<int> order(L);
  std::iota(order.begin(), order.end(), 0);
  RETURN_IF_ERROR(ForEachLayer(order, workers, device.is_cpu(), o, [&](int i) -> absl::Status {
    for (int g = 0; g < G; ++g) {
      if (out_of_time()) return deadline("while decomposing");
      ASSIGN_OR_RETURN(table[i][g], DecomposeLayer(source, i, grid[g], o));
    }
    return absl::OkStatus();
  }));
  rep.decompositions = L * G;
  rep.decompose_seconds = SecondsSince(t0);

  std::vector<LayerDecomposition> standard(L);
  for (int i = 0; i < L; ++i) standard[i].report.layer = i;
  // The model with layer i at grid[alloc[i]] (-1: standard), where the passes run.
  auto candidate = [&](const std::vector<int>& alloc) -> absl::StatusOr<std::unique_ptr<model::BertClassifier>> {
    std::vector<const LayerDecomposition*> layers;
    for (int i = 0; i < L; ++i) layers.push_back(alloc[i] < 0 ? &standard[i] : &table[i][alloc[i]]);
    CompressReport scratch;
    ASSIGN_OR_RETURN(auto m, AssembleCollaborative(source, layers, o, &scratch));
    try {
      m->Prepare(passes.device(), c10::kFloat, /*pack_weights=*/false);
    } catch (const std::exception& e) {
      return model::TorchErrorStatus("preparing a candidate model failed", e);
    }
    return m;
  };
  auto measure = [&](const std::vector<int>& alloc) -> absl::StatusOr<FidelityReport> {
    ASSIGN_OR_RETURN(auto m, candidate(alloc));
    ASSIGN_OR_RETURN(std::vector<at::Tensor> logits, BatchLogits(*m, tb, eval_workers));
    ASSIGN_OR_RETURN(FidelityReport f, CompareLogits(reference, logits, tb.texts, cfg.output_function()));
    f.truncated = tb.truncated;  // the texts cut at the model's maximum length, as MeasureFidelity
    return f;
  };

  // 2. Each layer's KL curve from two measurements (one when the grid has a single rank near both).
  auto nearest = [&](double r) {
    int best = 0;
    for (int g = 0; g < G; ++g) {
      if (std::abs(grid[g] - r) < std::abs(grid[best] - r)) best = g;
    }
    return best;
  };
  std::vector<int> g_points = {nearest(full / 8.0)};
  if (nearest(full / 16.0) != g_points[0]) g_points.push_back(nearest(full / 16.0));
  for (int g : g_points) rep.sensitivity_ranks.push_back(grid[g]);
  const auto ts = Clock::now();
  // A model with layer i alone compressed computes what the original does up to layer i: each
  // measurement runs from the original's hidden states entering layer i, layer by layer, the
  // states advanced one layer at a time. On 12 layers that is 12·13 layer passes for the 24
  // measurements instead of 24·12. (The per-operation path, against the reference's Forward: the
  // two differ by float rounding, ~1e-6 of a logit: a KL near 1e-12, far below what a layer at
  // N_h·d_k/8 or /16 costs.)
  const size_t n_batches = tb.batches.size();
  ASSIGN_OR_RETURN(std::vector<at::Tensor> hidden, EmbedBatches(passes, tb, eval_workers));
  std::vector<double> coefficient(L), reference_error(L);
  for (int i = 0; i < L; ++i) {
    std::vector<double> kl;
    for (int g : g_points) {
      if (cancelled()) return absl::CancelledError("compression cancelled");
      if (out_of_time()) return deadline("while measuring the layers' sensitivities");
      std::vector<int> alloc(L, -1);
      alloc[i] = g;
      ASSIGN_OR_RETURN(auto m, candidate(alloc));
      std::vector<at::Tensor> logits(n_batches);
      RETURN_IF_ERROR(ForEachBatch(n_batches, eval_workers, [&](int, size_t b) {
        logits[b] = m->LogitsFrom(i, hidden[b], tb.batches[b].mask).to(at::kDouble);
      }, tb.cancelled));
      ASSIGN_OR_RETURN(FidelityReport f, CompareLogits(reference, logits, tb.texts, cfg.output_function()));
      kl.push_back(f.mean_kl);
    }
    if (i + 1 < L) RETURN_IF_ERROR(AdvanceBatches(passes, i, tb, eval_workers, &hidden));
    std::vector<double> errors;
    for (int g : g_points) errors.push_back(DrivingError(table[i][g].report));
    rep.kl_exponent.push_back(KlExponent(errors, kl));
    rep.layer_kl.push_back(kl);
    coefficient[i] = kl[0];
    reference_error[i] = errors[0];
  }
  hidden.clear();
  rep.sensitivity_seconds = SecondsSince(ts);
  auto proxy = [&](int i, double e) {
    if (reference_error[i] <= 0) return e > 0 ? coefficient[i] : 0.0;
    return coefficient[i] * std::pow(e / reference_error[i], rep.kl_exponent[i]);
  };

  // 3. The walk: per layer, its hull from the cheapest grid rank up to standard.
  std::vector<std::vector<Option>> hulls(L);
  for (int i = 0; i < L; ++i) {
    std::vector<Option> pts;
    for (int g = G - 1; g >= 0; --g) {
      pts.push_back({g, model::CollaborativeQkParamsPerLayer(cfg, grid[g]), proxy(i, DrivingError(table[i][g].report))});
    }
    pts.push_back({-1, model::StandardQkParamsPerLayer(cfg), 0.0});
    hulls[i] = LowerHull(std::move(pts));
  }
  std::vector<size_t> pos(L, 0);
  std::vector<std::vector<int>> path;
  auto current = [&] {
    std::vector<int> a(L);
    for (int i = 0; i < L; ++i) a[i] = hulls[i][pos[i]].grid;
    return a;
  };
  path.push_back(current());
  for (;;) {
    int best = -1;
    double best_rate = -1;
    for (int i = 0; i < L; ++i) {
      if (pos[i] + 1 >= hulls[i].size()) continue;
      const Option& a = hulls[i][pos[i]];
      const Option& b = hulls[i][pos[i] + 1];
      const double rate = (a.proxy - b.proxy) / static_cast<double>(b.params - a.params);
      if (rate > best_rate) {
        best_rate = rate;
        best = i;
      }
    }
    if (best < 0) break;
    ++pos[best];
    std::vector<int> a = current();
    if (std::all_of(a.begin(), a.end(), [](int g) { return g < 0; })) break;  // nothing compressed
    path.push_back(std::move(a));
  }
  rep.candidates = static_cast<int>(path.size());

  // 4. Bisection with measurements; the cheapest verified allocation wins.
  auto params_of = [&](const std::vector<int>& a) {
    int64_t p = 0;
    for (int i = 0; i < L; ++i) p += model::CollaborativeQkParamsPerLayer(cfg, a[i] < 0 ? 0 : grid[a[i]]);
    return p;
  };
  auto trial = [&](size_t k) -> absl::StatusOr<bool> {
    ASSIGN_OR_RETURN(FidelityReport f, measure(path[k]));
    RankSearchReport::Trial t;
    for (int g : path[k]) t.ranks.push_back(g < 0 ? 0 : grid[g]);
    t.qk_params = params_of(path[k]);
    t.fidelity = f;
    t.meets = by_agreement ? f.top1_agreement >= o.spec.target_agreement : f.mean_kl <= o.spec.max_kl;
    t.seconds = SecondsSince(t0);
    rep.trials.push_back(t);
    if (o.on_trial) o.on_trial(t);
    return t.meets;
  };
  int lo = 0, hi = static_cast<int>(path.size()) - 1, found = -1, found_trial = -1;
  while (lo <= hi) {
    if (cancelled()) return absl::CancelledError("compression cancelled");
    if (out_of_time()) {
      if (found < 0) return deadline("while measuring candidates");
      rep.time_limited = true;
      break;
    }
    const int mid = lo + (hi - lo) / 2;
    ASSIGN_OR_RETURN(bool meets, trial(mid));
    if (meets) {
      found = mid;
      found_trial = static_cast<int>(rep.trials.size()) - 1;
      hi = mid - 1;
    } else {
      lo = mid + 1;
    }
  }
  rep.seconds = SecondsSince(t0);
  if (found < 0) {
    const RankSearchReport::Trial& last = rep.trials.back();
    return absl::FailedPreconditionError(absl::StrFormat(
        "no compressed allocation meets %s on the %d held-out texts: the dearest candidate (%d Q/K "
        "parameters) reached top-1 agreement %.4f, mean KL %.4g; relax the target or compress with a rank",
        rep.target, rep.texts, last.qk_params, last.fidelity.top1_agreement, last.fidelity.mean_kl));
  }
  rep.chosen = found_trial;
  std::vector<LayerDecomposition> chosen(L);
  for (int i = 0; i < L; ++i) {
    const int g = path[found][i];
    chosen[i] = g < 0 ? standard[i] : std::move(table[i][g]);
  }
  return chosen;
}

}  // namespace collabserve::compress::internal
