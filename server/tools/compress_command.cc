// collabserve-model compress: converts a checkpoint directory to collaborative attention and
// prints the report (one JSON object).
//
// Threads on the CPU. By default the CP step decomposes one layer per CPU at once, each with one
// ATen and one OpenBLAS thread: OpenBLAS's LAPACK calls, the eigensolver and the element-wise
// passes of a sweep scale poorly over two threads, so two single-threaded layers beat one
// two-threaded layer (bench/compress/RESULTS.md). --parallel_layers P runs P layers at once with
// UsableCpus / P threads each (P = 1: one layer on every CPU). The fidelity probes run with the
// same threads (MeasureFidelity then runs both models at once); loading and writing with all CPUs.
#include <ATen/Parallel.h>

#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/compress/collaborative.h"
#include "server/tools/commands.h"
#include "server/tools/flags.h"
#include "server/util/files.h"
#include "server/util/process_env.h"
#include "server/util/status_macros.h"

namespace collabserve::tools {

absl::Status Compress(int argc, char** argv) {
  ASSIGN_OR_RETURN(Flags f, Flags::Parse(argc, argv, 2,
                                         {"model", "out", "rank", "ratio", "ranks", "max_error", "max_iters",
                                          "tol", "seed", "device", "probe", "parallel_layers", "precision",
                                          "line_search", "init", "calibration", "whiten_damping", "target_agreement",
                                          "max_kl", "search_seconds", "whiten_inputs"}));
  if (!f.Has("model") || !f.Has("out")) {
    return absl::InvalidArgumentError("--model IN and --out OUT are required");
  }
  int specs = f.Has("rank") + f.Has("ratio") + f.Has("ranks") + f.Has("max_error") + f.Has("target_agreement") +
              f.Has("max_kl");
  if (specs != 1) {
    return absl::InvalidArgumentError(
        "give exactly one of --rank, --ratio, --ranks, --max_error, --target_agreement, --max_kl");
  }
  compress::CompressOptions o;
  if (f.Has("rank")) {
    o.spec.kind = compress::RankSpec::Kind::kRank;
    ASSIGN_OR_RETURN(o.spec.rank, f.GetInt("rank", 0));
  } else if (f.Has("ratio")) {
    o.spec.kind = compress::RankSpec::Kind::kRatio;
    ASSIGN_OR_RETURN(o.spec.ratio, f.GetDouble("ratio", 0));
  } else if (f.Has("ranks")) {
    o.spec.kind = compress::RankSpec::Kind::kPerLayer;
    for (absl::string_view part : absl::StrSplit(f.Get("ranks"), ',')) {
      int r;
      if (!absl::SimpleAtoi(part, &r)) {
        return absl::InvalidArgumentError(absl::StrCat("--ranks: '", part, "' is not an integer"));
      }
      o.spec.ranks.push_back(r);
    }
  } else if (f.Has("max_error")) {
    o.spec.kind = compress::RankSpec::Kind::kMaxError;
    ASSIGN_OR_RETURN(o.spec.max_error, f.GetDouble("max_error", 0));
  } else if (f.Has("target_agreement")) {
    o.spec.kind = compress::RankSpec::Kind::kTargetAgreement;
    ASSIGN_OR_RETURN(o.spec.target_agreement, f.GetDouble("target_agreement", 0));
  } else {
    o.spec.kind = compress::RankSpec::Kind::kMaxKl;
    ASSIGN_OR_RETURN(o.spec.max_kl, f.GetDouble("max_kl", 0));
  }
  ASSIGN_OR_RETURN(o.search_seconds, f.GetDouble("search_seconds", o.search_seconds));
  ASSIGN_OR_RETURN(o.max_iters, f.GetInt("max_iters", 100));
  ASSIGN_OR_RETURN(o.tol, f.GetDouble("tol", 1e-5));
  ASSIGN_OR_RETURN(int64_t seed, f.GetInt64("seed", 0));
  ASSIGN_OR_RETURN(const int par, f.GetInt("parallel_layers", 0));
  if (par < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--parallel_layers must be 0 (one layer per CPU) or positive, got ", par));
  }
  o.seed = static_cast<uint64_t>(seed);
  o.parallel_layers = par;
  o.device = f.Get("device", "cpu");
  std::string precision = f.Get("precision", "f32");
  if (precision != "f32" && precision != "f64") {
    return absl::InvalidArgumentError(absl::StrCat("--precision '", precision, "' is not f32 or f64"));
  }
  o.float64 = precision == "f64";
  const std::string line_search = f.Get("line_search", "1");
  if (line_search != "0" && line_search != "1") {
    return absl::InvalidArgumentError(absl::StrCat("--line_search '", line_search, "' is not 0 or 1"));
  }
  o.line_search = line_search == "1";
  // The CP start (CompressOptions::init): svd (default) or random. bench/compress/RESULTS.md
  // section 6 compares them: random needs no eigensolver and wins per layer, svd gave the better
  // fidelity on the whole random-weight model.
  const std::string init = f.Get("init", "svd");
  if (init != "svd" && init != "random") {
    return absl::InvalidArgumentError(absl::StrCat("--init '", init, "' is not svd or random"));
  }
  o.init = init == "svd" ? compress::CpAlsOptions::Init::kSvd : compress::CpAlsOptions::Init::kRandom;
  if (f.Has("probe")) {
    ASSIGN_OR_RETURN(std::string text, util::ReadFile(f.Get("probe"), 64 << 20));
    for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipWhitespace())) {
      o.probes.emplace_back(line);
    }
    if (o.probes.empty()) return absl::InvalidArgumentError(absl::StrCat(f.Get("probe"), ": no probe lines"));
  }
  if (f.Has("calibration")) {
    ASSIGN_OR_RETURN(std::string text, util::ReadFile(f.Get("calibration"), 64 << 20));
    ASSIGN_OR_RETURN(o.calibration, compress::ParseCalibrationText(text, f.Get("calibration")));
  }
  ASSIGN_OR_RETURN(o.whiten_damping, f.GetDouble("whiten_damping", o.whiten_damping));
  // Whose layer inputs the whitening rests on: the original model's (default) or, layer by layer,
  // the compressed model's (CompressOptions::whiten_compressed_inputs).
  const std::string inputs = f.Get("whiten_inputs", "original");
  if (inputs != "original" && inputs != "compressed") {
    return absl::InvalidArgumentError(absl::StrCat("--whiten_inputs '", inputs, "' is not original or compressed"));
  }
  o.whiten_compressed_inputs = inputs == "compressed";
  if (absl::StartsWith(o.device, "cpu")) {
    const int cpus = util::UsableCpus();
    const int per_layer = par > 0 ? std::max<int>(1, cpus / par) : 1;
    auto use_threads = [](int n) {
      at::set_num_threads(n);
      util::SetBlasThreads(n);
    };
    use_threads(cpus);
    // CompressModelDirectory announces each step from this thread; parallel_layers 0 resolves to
    // cpus / at::get_num_threads() = one layer per CPU. The fidelity step gets the same threads:
    // with one per CPU left idle, MeasureFidelity runs the two models at once, one thread each.
    o.on_step = [use_threads, cpus, per_layer](const std::string& step) {
      use_threads(step == "convert" || step == "fidelity" ? per_layer : cpus);
    };
  }
  ASSIGN_OR_RETURN(compress::CompressReport report,
                   compress::CompressModelDirectory(f.Get("model"), f.Get("out"), o));
  std::cout << report.ToJson() << std::endl;
  return absl::OkStatus();
}

}  // namespace collabserve::tools
