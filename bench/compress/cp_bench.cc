// CP-ALS benchmark on BERT-base-shaped layers (N_h = 12, D = 768, d_k = 64): the factorised ALS
// (SVD and random init, float64 and float32) against the textbook dense ALS (T materialised,
// Khatri–Rao MTTKRPs) measured in the same run, then a whole 12-layer model.
//
// The dense baseline costs ~1 s per sweep at R = 384, so it runs `--dense_iters` sweeps only. Two
// comparisons are printed, both honest about that:
//   * equal sweeps: every method run for exactly `--dense_iters` sweeps; times and errors are all
//     measured (the errors agree because both algorithms follow the same iterates);
//   * full run: the factorised methods run `--iters` sweeps (measured); the dense time for the same
//     sweeps is extrapolated as init + iters × per-sweep time (marked "*"); its error is not
//     measured ("-"): it follows the same iterates as factorised/svd, as the equal-sweeps table
//     and tests/compress/cp_als_test.cc check. The full run also has `fact+ls` (the line search,
//     from the SVD and from the random start; random + line search is the command's default) and
//     "to the same error": the first sweep k at which the line search is at or below the plain
//     (= dense) error after the full run, timed for exactly k sweeps and compared with the
//     extrapolated dense time for the full run.
//
// Usage: cp_bench [--iters=100] [--dense_iters=10] [--repeats=3] [--dense_repeats=3]
//                 [--ranks=384,256] [--precisions=f64,f32] [--kinds=random,planted]
//                 [--shared_dim=256] [--noise=0.1] [--layers=12] [--model_tol=1e-5]
//                 [--threads=2] [--skip_dense] [--model_only]
// Times are medians over the repeats; the equal-sweeps runs are interleaved (dense, factorised,
// ...) so a load change on this shared machine hits both; cpu_spdup is the same ratio in CPU
// seconds (user + system, all threads), the steadier figure under load.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "server/compress/cp_als.h"

namespace collabserve::compress {
namespace {

using bench::CpuSeconds;
using bench::LoadAverage;
using bench::Median;

constexpr int64_t kHeads = 12, kDim = 768, kHeadSize = 64;

struct Flags {
  int iters = 100;
  int dense_iters = 10;
  int repeats = 3;
  std::vector<int> ranks = {384, 256};
  int shared_dim = 256;
  double noise = 0.1;
  int layers = 12;
  int threads = 2;
  bool skip_dense = false;
  bool model_only = false;
  int dense_repeats = 3;
  double model_tol = 1e-5;
  std::vector<CpAlsOptions::Precision> precisions = {CpAlsOptions::Precision::kFloat64,
                                                     CpAlsOptions::Precision::kFloat32};
  std::vector<std::string> kinds = {"random", "planted"};
};

bool ParseFlags(int argc, char** argv, Flags* flags) {
  std::vector<std::string> precisions = {"f64", "f32"};
  bench::FlagSet f("cp_bench");
  f.Int("iters", &flags->iters, 1)
      .Int("dense_iters", &flags->dense_iters, 2)
      .Int("repeats", &flags->repeats, 1)
      .Int("shared_dim", &flags->shared_dim, 1)
      .Double("noise", &flags->noise, 0)
      .Int("layers", &flags->layers, 0)
      .Int("threads", &flags->threads, 1)
      .Ints("ranks", &flags->ranks, 0)
      .Int("dense_repeats", &flags->dense_repeats, 1)
      .Double("model_tol", &flags->model_tol, 0)
      .Strings("precisions", &precisions, {"f64", "f32"})
      .Strings("kinds", &flags->kinds, {"random", "planted"})
      .Bool("skip_dense", &flags->skip_dense)
      .Bool("model_only", &flags->model_only);
  if (!f.Parse(argc, argv)) return false;
  flags->precisions.clear();
  for (const std::string& p : precisions) {
    flags->precisions.push_back(p == "f64" ? CpAlsOptions::Precision::kFloat64 : CpAlsOptions::Precision::kFloat32);
  }
  return true;
}

at::Tensor Randn(at::IntArrayRef shape, uint64_t seed) {
  return at::randn(shape, at::make_generator<at::CPUGeneratorImpl>(seed), at::kFloat);
}

struct Layer {
  at::Tensor P, Q;  // [N_h, D, d_k] float32
};

// Independent Gaussian heads: no structure for CP to exploit.
Layer RandomLayer(uint64_t seed) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(kDim));
  return {Randn({kHeads, kDim, kHeadSize}, seed) * scale,
          Randn({kHeads, kDim, kHeadSize}, seed + 1) * scale};
}

// Heads drawn from a shared subspace (the redundancy the paper observes): P_i = S_q X_i + noise,
// Q_i = S_k Y_i + noise, with S_q, S_k: [D, shared_dim] and a per-entry noise `noise` times the
// signal's entry scale.
Layer PlantedLayer(uint64_t seed, int shared_dim, double noise) {
  auto draw = [&](uint64_t s) {
    at::Tensor basis = Randn({kDim, shared_dim}, s) / std::sqrt(static_cast<double>(kDim));
    at::Tensor coeffs = Randn({kHeads, shared_dim, kHeadSize}, s + 1);
    at::Tensor signal = at::matmul(basis, coeffs);  // [N_h, D, d_k]
    const double entry_scale = std::sqrt(static_cast<double>(shared_dim) / kDim);
    return signal + Randn({kHeads, kDim, kHeadSize}, s + 2) * (noise * entry_scale);
  };
  return {draw(seed), draw(seed + 10)};
}

const char* InitName(CpAlsOptions::Init init) {
  return init == CpAlsOptions::Init::kSvd ? "svd" : "random";
}
const char* PrecisionName(CpAlsOptions::Precision p) {
  return p == CpAlsOptions::Precision::kFloat64 ? "f64" : "f32";
}

struct Row {
  std::string method;
  CpAlsOptions::Init init;
  CpAlsOptions::Precision precision;
  int rank;
  int iters;
  double seconds;          // median over repeats
  double cpu_seconds;      // median over repeats
  double rel_error;
  double error_at_dense;   // error after flags.dense_iters sweeps (from the history)
  bool extrapolated = false;
};

CpResult MustRun(absl::StatusOr<CpResult> result) {
  if (!result.ok()) {
    std::fprintf(stderr, "cp_bench: %s\n", result.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(result);
}

CpAlsOptions MakeOptions(int rank, int iters, CpAlsOptions::Init init,
                         CpAlsOptions::Precision precision) {
  CpAlsOptions options;
  options.rank = rank;
  options.max_iters = iters;
  options.tol = 1e-6;
  options.init = init;
  options.precision = precision;
  options.seed = 1;
  return options;
}

// Factorised ALS, median time over `repeats` (the result is deterministic, so one error).
Row RunFactorized(const Layer& layer, const CpAlsOptions& options, int repeats, int dense_iters) {
  std::vector<double> times, cpu;
  CpResult result;
  for (int i = 0; i < repeats; ++i) {
    const double cpu_start = CpuSeconds();
    result = MustRun(FactorizedCpAls(layer.P, layer.Q, options));
    cpu.push_back(CpuSeconds() - cpu_start);
    times.push_back(result.seconds);
  }
  const auto& h = result.error_history;
  const double at_dense = h[std::min<size_t>(h.size(), dense_iters) - 1];
  return {"factorized", options.init, options.precision, options.rank, result.iterations,
          Median(times), Median(cpu), result.relative_error, at_dense};
}

void PrintTableHeader() {
  std::printf("  %-11s %-6s %-4s %5s %6s %11s %8s %10s %10s %10s %9s\n", "method", "init", "prec",
              "rank", "iters", "seconds", "cpu_s", "rel_error", "err@k", "speedup", "cpu_spdup");
}

// dense_cpu <= 0: no CPU-time ratio (the extrapolated rows).
void PrintRow(const Row& row, double dense_seconds, double dense_cpu = -1) {
  char error[32];
  if (row.rel_error >= 0) {
    std::snprintf(error, sizeof(error), "%10.6f", row.rel_error);
  } else {
    std::snprintf(error, sizeof(error), "%10s", "-");
  }
  char cpu_ratio[32];
  if (dense_cpu > 0 && row.cpu_seconds > 0) {
    std::snprintf(cpu_ratio, sizeof(cpu_ratio), "%8.1fx", dense_cpu / row.cpu_seconds);
  } else {
    std::snprintf(cpu_ratio, sizeof(cpu_ratio), "%9s", "-");
  }
  std::printf("  %-11s %-6s %-4s %5d %6d %10.3f%s %8.2f %s %10.6f %9.1fx %s\n", row.method.c_str(),
              InitName(row.init), PrecisionName(row.precision), row.rank, row.iters, row.seconds,
              row.extrapolated ? "*" : " ", row.cpu_seconds, error, row.error_at_dense,
              dense_seconds / row.seconds, cpu_ratio);
}

void BenchLayer(const char* kind, const Layer& layer, const Flags& flags) {
  for (int rank : flags.ranks) {
    for (auto precision : flags.precisions) {
      // Equal sweeps: all methods exactly dense_iters sweeps (tol 0). The runs are interleaved
      // (dense, factorised svd, factorised random, repeated) so that a change in the machine's
      // load hits all three alike; each figure is a median over its repeats.
      const CpAlsOptions::Init inits[] = {CpAlsOptions::Init::kSvd, CpAlsOptions::Init::kRandom};
      std::vector<std::vector<double>> times(2), cpus(2);
      std::vector<CpResult> last(2);
      std::vector<double> dense_times, dense_cpus, dense_ones;
      CpResult dense;
      const at::Tensor T =
          flags.skip_dense ? at::Tensor() : at::matmul(layer.P, layer.Q.transpose(1, 2));
      for (int rep = 0; rep < std::max(flags.repeats, flags.dense_repeats); ++rep) {
        if (!flags.skip_dense && rep < flags.dense_repeats) {
          CpAlsOptions options =
              MakeOptions(rank, flags.dense_iters, CpAlsOptions::Init::kSvd, precision);
          options.tol = 0;
          const double cpu_start = CpuSeconds();
          dense = MustRun(DenseCpAls(T, options));
          dense_cpus.push_back(CpuSeconds() - cpu_start);
          dense_times.push_back(dense.seconds);
          // A 1-sweep run separates the initialisation (SVD of two 768 × 9216 unfoldings) from
          // the per-sweep cost for the extrapolation.
          options.max_iters = 1;
          dense_ones.push_back(MustRun(DenseCpAls(T, options)).seconds);
        }
        if (rep >= flags.repeats) continue;
        for (int k = 0; k < 2; ++k) {
          CpAlsOptions options = MakeOptions(rank, flags.dense_iters, inits[k], precision);
          options.tol = 0;
          const double cpu_start = CpuSeconds();
          last[k] = MustRun(FactorizedCpAls(layer.P, layer.Q, options));
          cpus[k].push_back(CpuSeconds() - cpu_start);
          times[k].push_back(last[k].seconds);
        }
      }
      std::vector<Row> equal;
      for (int k = 0; k < 2; ++k) {
        equal.push_back({"factorized", inits[k], precision, rank, last[k].iterations,
                         Median(times[k]), Median(cpus[k]), last[k].relative_error,
                         last[k].error_history.back()});
      }
      double dense_seconds = 0, dense_per_sweep = 0, dense_init = 0, dense_cpu = 0;
      Row dense_row;
      if (!flags.skip_dense) {
        dense_seconds = Median(dense_times);
        dense_cpu = Median(dense_cpus);
        dense_per_sweep = (dense_seconds - Median(dense_ones)) / (flags.dense_iters - 1);
        dense_init = std::max(0.0, Median(dense_ones) - dense_per_sweep);
        dense_row = {"dense",    CpAlsOptions::Init::kSvd, precision,
                     rank,       dense.iterations,         dense_seconds,
                     dense_cpu,  dense.relative_error,     dense.relative_error};
      }
      std::printf("\n[%s layer, R=%d, %s] equal sweeps (%d each, all measured; speedup vs dense)\n",
                  kind, rank, PrecisionName(precision), flags.dense_iters);
      PrintTableHeader();
      if (!flags.skip_dense) PrintRow(dense_row, dense_seconds, dense_cpu);
      for (const Row& row : equal) {
        PrintRow(row, flags.skip_dense ? row.seconds : dense_seconds,
                 flags.skip_dense ? row.cpu_seconds : dense_cpu);
      }

      // Full run: factorised up to flags.iters sweeps with tol 1e-6.
      std::vector<Row> full;
      for (auto init : {CpAlsOptions::Init::kSvd, CpAlsOptions::Init::kRandom}) {
        full.push_back(RunFactorized(layer, MakeOptions(rank, flags.iters, init, precision),
                                     flags.repeats, flags.dense_iters));
      }
      // With the line search, from both starts (random + line search is the default of
      // `collabserve-model compress`).
      for (auto init : {CpAlsOptions::Init::kSvd, CpAlsOptions::Init::kRandom}) {
        CpAlsOptions searched = MakeOptions(rank, flags.iters, init, precision);
        searched.line_search = true;
        full.push_back(RunFactorized(layer, searched, flags.repeats, flags.dense_iters));
        full.back().method = "fact+ls";
      }
      std::printf("[%s layer, R=%d, %s] full run (max %d sweeps, tol 1e-6; dense extrapolated*)\n",
                  kind, rank, PrecisionName(precision), flags.iters);
      PrintTableHeader();
      for (const Row& row : full) {
        // Compare with the dense ALS run for the same number of sweeps as this row.
        const double dense_same = dense_init + row.iters * dense_per_sweep;
        if (!flags.skip_dense) {
          Row d = dense_row;
          d.iters = row.iters;
          d.seconds = dense_same;
          d.cpu_seconds = -1;
          d.rel_error = -1;  // not run: same iterates as factorised/svd (checked at k sweeps)
          d.extrapolated = true;
          if (row.init == CpAlsOptions::Init::kSvd) PrintRow(d, dense_same);
        }
        PrintRow(row, flags.skip_dense ? row.seconds : dense_same);
      }
      const Row& svd = full[0];
      const Row& rnd = full[1];
      std::printf("  which init wins: %s (svd %.6f vs random %.6f after %d / %d sweeps; %.3f s vs "
                  "%.3f s)\n",
                  svd.rel_error <= rnd.rel_error ? "svd" : "random", svd.rel_error, rnd.rel_error,
                  svd.iters, rnd.iters, svd.seconds, rnd.seconds);
      if (!flags.skip_dense) {
        std::printf("  dense: init %.3f s, %.3f s per sweep (measured over %d sweeps)\n",
                    dense_init, dense_per_sweep, flags.dense_iters);
        // The dense ALS follows the plain SVD-start iterates: its error after svd.iters sweeps is
        // svd.rel_error (to rounding). Each line-search run against it, and "to the same error":
        // the first sweep at which the line search is at or below that error, then a timed run of
        // exactly that many sweeps.
        const double dense_time = dense_init + svd.iters * dense_per_sweep;
        for (size_t j = 2; j < full.size(); ++j) {
          const Row& ls = full[j];
          std::printf("  line search, %s start: %d sweeps to %.6f in %.3f s; dense: %d sweeps to %.6f "
                      "in %.3f s* -> %.1fx faster at %s error\n",
                      InitName(ls.init), ls.iters, ls.rel_error, ls.seconds, svd.iters,
                      svd.rel_error, dense_time, dense_time / ls.seconds,
                      ls.rel_error <= svd.rel_error ? "a lower" : "a HIGHER");
          CpAlsOptions probe = MakeOptions(rank, flags.iters, ls.init, precision);
          probe.line_search = true;
          probe.tol = 0;
          const CpResult history = MustRun(FactorizedCpAls(layer.P, layer.Q, probe));
          int k = probe.max_iters;
          for (size_t i = 0; i < history.error_history.size(); ++i) {
            if (history.error_history[i] <= svd.rel_error) {
              k = static_cast<int>(i) + 1;
              break;
            }
          }
          probe.max_iters = k;
          const Row same = RunFactorized(layer, probe, flags.repeats, flags.dense_iters);
          std::printf("  to the same error, %s start: line search %d sweeps to %.6f in %.3f s; dense "
                      "%d sweeps to %.6f in %.3f s* -> %.1fx faster at %s error\n",
                      InitName(ls.init), same.iters, same.rel_error, same.seconds, svd.iters,
                      svd.rel_error, dense_time, dense_time / same.seconds,
                      same.rel_error <= svd.rel_error ? "an equal or lower" : "a HIGHER");
        }
      }
    }
  }
}

void BenchModel(const Flags& flags, int rank) {
  std::printf("\nWhole model: %d random BERT-base layers, R=%d, max %d sweeps, tol %g, %d threads\n",
              flags.layers, rank, flags.iters, flags.model_tol, flags.threads);
  std::printf("  %-4s %-6s %9s %9s %11s %14s %14s\n", "prec", "init", "seconds", "cpu_s",
              "s/layer", "mean rel_err", "mean sweeps");
  std::vector<Layer> layers;
  for (int l = 0; l < flags.layers; ++l) layers.push_back(RandomLayer(1000 + 10 * l));
  for (auto precision : flags.precisions) {
    for (auto init : {CpAlsOptions::Init::kSvd}) {
      double total = 0, err = 0, sweeps = 0;
      const double cpu_start = CpuSeconds();
      for (const Layer& layer : layers) {
        CpAlsOptions options = MakeOptions(rank, flags.iters, init, precision);
        options.tol = flags.model_tol;
        CpResult r = MustRun(FactorizedCpAls(layer.P, layer.Q, options));
        total += r.seconds;
        err += r.relative_error;
        sweeps += r.iterations;
      }
      std::printf("  %-4s %-6s %9.2f %9.2f %11.3f %14.6f %14.1f\n", PrecisionName(precision),
                  InitName(init), total, CpuSeconds() - cpu_start, total / flags.layers,
                  err / flags.layers, sweeps / flags.layers);
    }
  }
}

}  // namespace
}  // namespace collabserve::compress

int main(int argc, char** argv) {
  using namespace collabserve::compress;
  // libgomp's default wait policy spins; on an oversubscribed machine (this one is shared) the
  // two OpenMP threads then spend most of each sweep waiting at barriers for a descheduled peer
  // (measured: 4-10x slower). The policy is read when libgomp loads, so set it and re-execute.
  if (std::getenv("OMP_WAIT_POLICY") == nullptr) {
    setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    execv("/proc/self/exe", argv);
    std::perror("cp_bench: re-exec with OMP_WAIT_POLICY=PASSIVE failed; continuing");
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress shows when piped to a file
  Flags flags;
  if (!ParseFlags(argc, argv, &flags)) return 2;
  at::set_num_threads(flags.threads);
  std::printf("cp_bench: N_h=%lld D=%lld d_k=%lld, torch threads %d, iters %d, dense_iters %d, "
              "repeats %d (median), planted: shared_dim %d noise %.3f\n",
              static_cast<long long>(kHeads), static_cast<long long>(kDim),
              static_cast<long long>(kHeadSize), at::get_num_threads(), flags.iters,
              flags.dense_iters, flags.repeats, flags.shared_dim, flags.noise);
  const char* blas_threads = std::getenv("OPENBLAS_NUM_THREADS");
  std::printf("OMP_WAIT_POLICY=%s OPENBLAS_NUM_THREADS=%s; load average at start: %s\n",
              std::getenv("OMP_WAIT_POLICY"), blas_threads ? blas_threads : "(unset)",
              LoadAverage().c_str());
  std::printf("err@k = relative error after k=%d sweeps; seconds include initialisation; "
              "* = dense time extrapolated as init + sweeps x measured per-sweep time\n",
              flags.dense_iters);
  if (!flags.model_only) {
    for (const std::string& kind : flags.kinds) {
      if (kind == "random") {
        BenchLayer("random", RandomLayer(1), flags);
      } else {
        BenchLayer("planted", PlantedLayer(2, flags.shared_dim, flags.noise), flags);
      }
    }
  }
  if (flags.layers > 0) BenchModel(flags, flags.ranks.front());
  std::printf("\nload average at end: %s\n", LoadAverage().c_str());
  return 0;
}
