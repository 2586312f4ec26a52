// Where the time of `collabserve-model compress` goes: runs CompressModelDirectory (the function
// the command calls) on a model directory and times each step it announces through
// CompressOptions::on_step ("load", "convert", "fidelity", "write"); "convert" is split into the
// CP decompositions (CompressReport::decompose_seconds) and the rest (building the new model).
// Each configuration runs `--repeats` times; medians, with the load average.
//
// Configurations (`--configs`, comma-separated):
//   serial    one layer at a time; ATen and OpenBLAS pools as the command leaves them (ATen: the
//             library default, OpenBLAS: its own default, one thread per core);
//   parallel  `parallel_layers` = number of threads, with ATen and OpenBLAS pinned to one thread
//             each during the whole call (the command, since commit 349dfe3, does this for the CP
//             step only and gives load, fidelity and write every CPU; its report JSON has the
//             per-step seconds itself).
//
// Usage: compress_phases_bench --model DIR --scratch DIR [--rank=384] [--repeats=3]
//                              [--configs=serial,parallel] [--threads=2]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "server/compress/collaborative.h"
#include "server/util/process_env.h"

namespace collabserve::compress {
namespace {

using bench::CpuSeconds;
using bench::LoadAverage;
using bench::Median;
using util::BlasThreads;
using util::SetBlasThreads;

using Clock = std::chrono::steady_clock;

struct Flags {
  std::string model, scratch, configs = "serial,parallel";
  int rank = 384, repeats = 3, threads = 2;
};

bool ParseFlags(int argc, char** argv, Flags* flags) {
  if (!bench::FlagSet("compress_phases_bench")
           .String("model", &flags->model)
           .String("scratch", &flags->scratch)
           .String("configs", &flags->configs)
           .Int("rank", &flags->rank, 1)
           .Int("repeats", &flags->repeats, 1)
           .Int("threads", &flags->threads, 1)
           .Parse(argc, argv)) {
    return false;
  }
  if (flags->model.empty() || flags->scratch.empty()) {
    std::fprintf(stderr, "compress_phases_bench: --model=DIR and --scratch=DIR are required\n");
    return false;
  }
  return true;
}

int Run(const Flags& flags) {
  std::printf("compress_phases_bench: %s, R=%d, %d repeats (median); ATen threads %d, OpenBLAS "
              "threads %d; load average at start: %s\n",
              flags.model.c_str(), flags.rank, flags.repeats, at::get_num_threads(), BlasThreads(),
              LoadAverage().c_str());
  std::printf("  %-9s %7s %8s %8s %10s %9s %8s %8s %7s %s\n", "config", "load s", "CP s",
              "build s", "fidelity s", "write s", "total s", "sweeps", "max err", "per-run totals");
  const int aten_default = at::get_num_threads();
  const int blas_default = BlasThreads();
  for (absl::string_view config : absl::StrSplit(flags.configs, ',')) {
    const bool parallel = config == "parallel";
    if (!parallel && config != "serial") {
      std::fprintf(stderr, "compress_phases_bench: unknown config '%s'\n",
                   std::string(config).c_str());
      return 2;
    }
    std::map<std::string, std::vector<double>> phases, phases_cpu;
    std::vector<double> cp, build, total, total_cpu;
    int max_sweeps = 0;
    double max_error = 0;
    std::string totals;
    for (int rep = 0; rep < flags.repeats; ++rep) {
      at::set_num_threads(parallel ? 1 : aten_default);
      SetBlasThreads(parallel ? 1 : blas_default);
      CompressOptions o;
      o.spec.kind = RankSpec::Kind::kRank;
      o.spec.rank = flags.rank;
      o.parallel_layers = parallel ? flags.threads : 1;
      std::string current;
      Clock::time_point current_start;
      double current_cpu = 0;
      auto close_step = [&](Clock::time_point now) {
        if (current.empty()) return;
        phases[current].push_back(std::chrono::duration<double>(now - current_start).count());
        phases_cpu[current].push_back(CpuSeconds() - current_cpu);
      };
      o.on_step = [&](const std::string& step) {
        const auto now = Clock::now();
        close_step(now);
        current = step;
        current_start = now;
        current_cpu = CpuSeconds();
      };
      const double cpu_start = CpuSeconds();
      const std::string out = absl::StrCat(flags.scratch, "/phases-", ::getpid(), "-", rep);
      std::error_code ec;
      std::filesystem::remove_all(out, ec);
      const auto start = Clock::now();
      absl::StatusOr<CompressReport> report = CompressModelDirectory(flags.model, out, o);
      const auto end = Clock::now();
      if (!report.ok()) {
        std::fprintf(stderr, "compress_phases_bench: %s\n", report.status().ToString().c_str());
        return 1;
      }
      close_step(end);
      total.push_back(std::chrono::duration<double>(end - start).count());
      total_cpu.push_back(CpuSeconds() - cpu_start);
      cp.push_back(report->decompose_seconds);
      build.push_back(phases["convert"].back() - report->decompose_seconds);
      for (const LayerReport& l : report->layers) {
        max_sweeps = std::max(max_sweeps, l.iterations);
        max_error = std::max(max_error, l.relative_error);
      }
      char buffer[32];
      std::snprintf(buffer, sizeof(buffer), "%s%.2f", rep ? " " : "", total.back());
      totals += buffer;
      std::filesystem::remove_all(out, ec);
    }
    std::printf("  %-9s %7.2f %8.2f %8.2f %10.2f %9.2f %8.2f %8d %7.4f %s\n",
                std::string(config).c_str(), Median(phases["load"]), Median(cp), Median(build),
                Median(phases["fidelity"]), Median(phases["write"]), Median(total), max_sweeps,
                max_error, totals.c_str());
    // CPU seconds (all threads): the CP and build columns together hold the whole convert step.
    std::printf("  %-9s %7.2f %8.2f %8s %10.2f %9.2f %8.2f   (CPU s; CP column = whole convert)\n",
                "  cpu", Median(phases_cpu["load"]), Median(phases_cpu["convert"]), "-",
                Median(phases_cpu["fidelity"]), Median(phases_cpu["write"]), Median(total_cpu));
  }
  at::set_num_threads(aten_default);
  SetBlasThreads(blas_default);
  std::printf("load average at end: %s\n", LoadAverage().c_str());
  return 0;
}

}  // namespace
}  // namespace collabserve::compress

int main(int argc, char** argv) {
  // No OMP_WAIT_POLICY re-exec here (unlike cp_bench): the environment is the command's.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  collabserve::compress::Flags flags;
  if (!collabserve::compress::ParseFlags(argc, argv, &flags)) return 2;
  return collabserve::compress::Run(flags);
}
