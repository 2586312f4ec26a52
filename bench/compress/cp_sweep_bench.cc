// Where a CP-ALS sweep's time goes, measured against this machine's GEMM peak (BERT-base layer:
// N_h = 12, D = 768, d_k = 64). Prints:
//   1. GEMM peak: at::mm on 2048³ and on the sweep's own shape [768, 768] × [768, R], float32 and
//      float64, `--threads` threads (median of 5);
//   2. per-sweep time of the factorised and the dense (textbook) CP-ALS, from runs of 1 and 1 + k
//      sweeps (tol 0), the FLOPs of one sweep (counted below), GFLOP/s and % of the sgemm/dgemm
//      peak of the same shape; the setup / sweeps / finish split of the factorised call;
//   3. threading: `--layers` layers one after the other with `--threads` threads each, against two
//      layers at a time with one thread each (OpenBLAS and ATen pools both set to 1).
// Every figure is a median of `--repeats` runs; ratios are measured in the same run.
//
// Usage: cp_sweep_bench [--ranks=384,256] [--sweeps=10] [--dense_sweeps=2] [--repeats=3]
//                       [--layers=12] [--model_iters=40] [--threads=2] [--skip_dense]
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "server/compress/cp_als.h"
#include "server/util/process_env.h"

namespace collabserve::compress {
namespace {

using bench::LoadAverage;
using bench::Median;
using util::SetBlasThreads;

constexpr int64_t kHeads = 12, kDim = 768, kHeadSize = 64;
using Clock = std::chrono::steady_clock;

struct Flags {
  std::vector<int> ranks = {384, 256};
  int sweeps = 10;
  int dense_sweeps = 2;
  int repeats = 3;
  int layers = 12;
  int model_iters = 40;
  int threads = 2;
  bool skip_dense = false;
};

bool ParseFlags(int argc, char** argv, Flags* flags) {
  return bench::FlagSet("cp_sweep_bench")
      .Int("sweeps", &flags->sweeps, 1)
      .Int("dense_sweeps", &flags->dense_sweeps, 1)
      .Int("repeats", &flags->repeats, 1)
      .Int("layers", &flags->layers, 0)
      .Int("model_iters", &flags->model_iters, 1)
      .Int("threads", &flags->threads, 1)
      .Ints("ranks", &flags->ranks)
      .Bool("skip_dense", &flags->skip_dense)
      .Parse(argc, argv);
}

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

CpResult MustRun(absl::StatusOr<CpResult> result) {
  if (!result.ok()) {
    std::fprintf(stderr, "cp_sweep_bench: %s\n", result.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(result);
}

at::Tensor Randn(at::IntArrayRef shape, uint64_t seed) {
  return at::randn(shape, at::make_generator<at::CPUGeneratorImpl>(seed), at::kFloat) /
         std::sqrt(static_cast<double>(kDim));
}

struct Layer {
  at::Tensor P, Q;
};
Layer RandomLayer(uint64_t seed) {
  return {Randn({kHeads, kDim, kHeadSize}, seed), Randn({kHeads, kDim, kHeadSize}, seed + 1)};
}

// GFLOP/s of at::mm [m, k] × [k, n], median of 5 after a warm-up.
double GemmGflops(int64_t m, int64_t k, int64_t n, at::ScalarType dtype) {
  const at::Tensor a = at::randn({m, k}, at::TensorOptions().dtype(dtype));
  const at::Tensor b = at::randn({k, n}, at::TensorOptions().dtype(dtype));
  at::Tensor c = at::mm(a, b);
  std::vector<double> rates;
  for (int i = 0; i < 5; ++i) {
    const auto start = Clock::now();
    int reps = 0;
    do {
      at::mm_out(c, a, b);
      ++reps;
    } while (Seconds(start) < 0.2);
    rates.push_back(2.0 * m * k * n * reps / Seconds(start) / 1e9);
  }
  return Median(rates);
}

// FLOPs (2 per multiply-add) of one factorised sweep with n = N_h·d_k == D (the coefficient
// form): the two [n, n] × [n, R] GEMMs U = K_p Z_b, V = K_q Z_c; two Grams Z_bᵀU, Z_cᵀV and two
// solves M·G⁻¹ ([n, R] × [R, R]); three R×R Cholesky factorisations (R³/3) and two inverses from
// them (2R³/3); the A update ([N_h, R] right-hand sides, N_h·R² for the two triangular solves and
// N_h·R² for AᵀA). Element-wise work (O(n·R)) is left out.
double FactorizedSweepFlops(double rank) {
  const double n = kHeads * kHeadSize, r = rank;
  return 2 * (2 * n * n * r + 4 * n * r * r + 3 * r * r * r / 3 + 2 * 2 * r * r * r / 3 +
              2 * kHeads * r * r);
}

// The textbook sweep: three MTTKRPs, each a [·, N_h·D·D / ·] unfolding times a Khatri–Rao product,
// 2·N_h·D²·R each, plus the same R×R work as above and the Grams of the explicit factors.
double DenseSweepFlops(double rank) {
  const double r = rank;
  return 2 * (3 * kHeads * kDim * kDim * r + 2 * kDim * r * r + 3 * r * r * r / 3 +
              2 * 2 * r * r * r / 3 + 2 * kDim * r * r);
}

struct SweepFigures {
  // overhead: a 1-sweep call minus one sweep (setup + finish, measured without the split).
  double per_sweep = 0, overhead = 0, setup = 0, finish = 0, error = 0;
};

template <typename Run>
SweepFigures MeasureSweeps(Run run, int sweeps, int repeats, bool split) {
  std::vector<double> per_sweep, overhead, setup, finish;
  SweepFigures out;
  for (int i = 0; i < repeats; ++i) {
    const CpResult one = run(1);
    const CpResult many = run(1 + sweeps);
    per_sweep.push_back((many.seconds - one.seconds) / sweeps);
    overhead.push_back(one.seconds - per_sweep.back());
    if (split) {
      setup.push_back(many.setup_seconds);
      finish.push_back(many.finish_seconds);
    }
    out.error = many.relative_error;
  }
  out.per_sweep = Median(per_sweep);
  out.overhead = Median(overhead);
  if (split) {
    out.setup = Median(setup);
    out.finish = Median(finish);
  }
  return out;
}

void BenchSweeps(const Flags& flags) {
  std::printf("\n1. GEMM peak, %d threads (GFLOP/s, median of 5)\n", flags.threads);
  const double peak_big = GemmGflops(2048, 2048, 2048, at::kFloat);
  std::printf("  sgemm 2048^3: %.1f   dgemm 2048^3: %.1f\n", peak_big,
              GemmGflops(2048, 2048, 2048, at::kDouble));
  const Layer layer = RandomLayer(1);
  const at::Tensor T = at::matmul(layer.P, layer.Q.transpose(1, 2));
  for (int rank : flags.ranks) {
    const double speak = GemmGflops(kDim, kDim, rank, at::kFloat);
    const double dpeak = GemmGflops(kDim, kDim, rank, at::kDouble);
    std::printf("  [768,768]x[768,%d]: sgemm %.1f  dgemm %.1f\n", rank, speak, dpeak);
    std::printf("\n2. One sweep, random layer, R=%d (per-sweep time from 1 vs %d sweeps, median "
                "of %d)\n",
                rank, 1 + flags.sweeps, flags.repeats);
    std::printf("  %-10s %-4s %9s %9s %8s %9s %9s %10s %9s %9s\n", "method", "prec", "ms/sweep",
                "GFLOP", "GFLOP/s", "% peak", "peak ms", "overhead s", "setup s", "finish s");
    for (auto precision : {CpAlsOptions::Precision::kFloat32, CpAlsOptions::Precision::kFloat64}) {
      const bool f32 = precision == CpAlsOptions::Precision::kFloat32;
      const double peak = f32 ? speak : dpeak;
      CpAlsOptions options;
      options.rank = rank;
      options.tol = 0;
      options.seed = 1;
      options.precision = precision;
      auto factorized = [&](int iters) {
        CpAlsOptions o = options;
        o.max_iters = iters;
        return MustRun(FactorizedCpAls(layer.P, layer.Q, o));
      };
      const SweepFigures f = MeasureSweeps(factorized, flags.sweeps, flags.repeats, true);
      const double flops = FactorizedSweepFlops(rank);
      std::printf("  %-10s %-4s %9.2f %9.3f %8.1f %8.0f%% %9.2f %10.3f %9.3f %9.3f\n",
                  "factorised", f32 ? "f32" : "f64", 1e3 * f.per_sweep, flops / 1e9,
                  flops / f.per_sweep / 1e9, 100 * flops / f.per_sweep / 1e9 / peak,
                  1e3 * flops / peak / 1e9, f.overhead, f.setup, f.finish);
      if (flags.skip_dense) continue;
      auto dense = [&](int iters) {
        CpAlsOptions o = options;
        o.max_iters = iters;
        return MustRun(DenseCpAls(T, o));
      };
      const SweepFigures d = MeasureSweeps(dense, flags.dense_sweeps, 1, false);
      const double dflops = DenseSweepFlops(rank);
      std::printf("  %-10s %-4s %9.2f %9.3f %8.1f %8.0f%% %9.2f %10.3f %9s %9s   (dense/"
                  "factorised per sweep: %.1fx; dense at its peak-bound time: %.1fx)\n",
                  "dense", f32 ? "f32" : "f64", 1e3 * d.per_sweep, dflops / 1e9,
                  dflops / d.per_sweep / 1e9, 100 * dflops / d.per_sweep / 1e9 / peak,
                  1e3 * dflops / peak / 1e9, d.overhead, "-", "-", d.per_sweep / f.per_sweep,
                  dflops / peak / 1e9 / f.per_sweep);
    }
  }
}

// `layers` layers at rank `rank`, float32, `iters` sweeps each (tol 0, so both schedules do the
// same work): one after the other with `threads` threads, then two at a time with one each.
void BenchThreading(const Flags& flags) {
  const int rank = flags.ranks.front();
  std::printf("\n3. Threading: %d random layers, R=%d, f32, %d sweeps each (tol 0), median of %d\n",
              flags.layers, rank, flags.model_iters, flags.repeats);
  std::vector<Layer> layers;
  for (int l = 0; l < flags.layers; ++l) layers.push_back(RandomLayer(1000 + 10 * l));
  CpAlsOptions options;
  options.rank = rank;
  options.tol = 0;
  options.max_iters = flags.model_iters;
  options.precision = CpAlsOptions::Precision::kFloat32;
  std::vector<double> sequential, parallel;
  for (int rep = 0; rep < flags.repeats; ++rep) {
    at::set_num_threads(flags.threads);
    SetBlasThreads(flags.threads);
    auto start = Clock::now();
    for (const Layer& layer : layers) MustRun(FactorizedCpAls(layer.P, layer.Q, options));
    sequential.push_back(Seconds(start));

    at::set_num_threads(1);
    SetBlasThreads(1);
    start = Clock::now();
    std::vector<std::thread> workers;
    for (int w = 0; w < flags.threads; ++w) {
      workers.emplace_back([&, w] {
        for (size_t l = w; l < layers.size(); l += flags.threads) {
          MustRun(FactorizedCpAls(layers[l].P, layers[l].Q, options));
        }
      });
    }
    for (auto& t : workers) t.join();
    parallel.push_back(Seconds(start));
  }
  at::set_num_threads(flags.threads);
  SetBlasThreads(flags.threads);
  std::printf("  %d layer at a time x %d threads: %.2f s;  %d layers at a time x 1 thread: %.2f s "
              "(%.2fx)\n",
              1, flags.threads, Median(sequential), flags.threads, Median(parallel),
              Median(sequential) / Median(parallel));
}

}  // namespace
}  // namespace collabserve::compress

int main(int argc, char** argv) {
  using namespace collabserve::compress;
  // Idle OpenMP workers must sleep on this shared machine (see cp_bench.cc); re-exec to set it.
  if (std::getenv("OMP_WAIT_POLICY") == nullptr) {
    setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    execv("/proc/self/exe", argv);
    std::perror("cp_sweep_bench: re-exec with OMP_WAIT_POLICY=PASSIVE failed; continuing");
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  Flags flags;
  if (!ParseFlags(argc, argv, &flags)) return 2;
  at::set_num_threads(flags.threads);
  SetBlasThreads(flags.threads);
  std::printf("cp_sweep_bench: N_h=%lld D=%lld d_k=%lld, %d threads; load average at start: %s\n",
              static_cast<long long>(kHeads), static_cast<long long>(kDim),
              static_cast<long long>(kHeadSize), flags.threads, LoadAverage().c_str());
  BenchSweeps(flags);
  if (flags.layers > 0) BenchThreading(flags);
  std::printf("\nload average at end: %s\n", LoadAverage().c_str());
  return 0;
}
