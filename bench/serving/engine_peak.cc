// The engine's best raw throughput: Engine::Run on equal-length inputs at several batch sizes,
// median time per Run, no gRPC, no queue. run_serving_bench.sh uses it as the ceiling that the
// served throughput is compared with, measured in the same run on the same model.
//
// With --streams=N, N threads run batches concurrently (each with --threads intra-op threads): the
// raw counterpart of a server with N batch threads, so that the ceiling covers that configuration
// too (a server cannot beat it by splitting the cores differently from the raw measurement).
//
// Usage: serving_engine_peak --model=DIR [--tokens=32] [--batches=1,2,4,8,16,32] [--seconds=2]
//                            [--threads=0 (torch default)] [--streams=1]
// Prints a table, then a last line "best batch=B inputs_per_s=X batch_ms=Y streams=N".
#include <ATen/Parallel.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "server/model/engine.h"

namespace {

bool Flag(const char* arg, const char* name, std::string* value) {
  const std::string prefix = std::string("--") + name + "=";
  if (std::string(arg).rfind(prefix, 0) != 0) return false;
  *value = std::string(arg).substr(prefix.size());
  return true;
}

// User + system CPU seconds of this process so far (all threads).
double ProcessCpuSeconds() {
  rusage ru{};
  if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec * 1e-6; };
  return s(ru.ru_utime) + s(ru.ru_stime);
}

}  // namespace

int main(int argc, char** argv) {
  std::string model, v;
  int tokens = 32, threads = 0, streams = 1;
  double seconds = 2;
  std::vector<int> batches = {1, 2, 4, 8, 16, 32};
  for (int i = 1; i < argc; ++i) {
    if (Flag(argv[i], "model", &model)) continue;
    if (Flag(argv[i], "tokens", &v) && absl::SimpleAtoi(v, &tokens) && tokens >= 3) continue;
    if (Flag(argv[i], "threads", &v) && absl::SimpleAtoi(v, &threads)) continue;
    if (Flag(argv[i], "streams", &v) && absl::SimpleAtoi(v, &streams) && streams >= 1 &&
        streams <= 64) {
      continue;
    }
    if (Flag(argv[i], "seconds", &v) && absl::SimpleAtod(v, &seconds) && seconds > 0) continue;
    if (Flag(argv[i], "batches", &v)) {
      batches.clear();
      for (auto p : absl::StrSplit(v, ',')) {
        int b = 0;
        if (!absl::SimpleAtoi(p, &b) || b < 1) {
          std::fprintf(stderr, "bad --batches entry '%s'\n", std::string(p).c_str());
          return 2;
        }
        batches.push_back(b);
      }
      continue;
    }
    std::fprintf(stderr, "unknown or bad flag %s\nusage: %s --model=DIR [--tokens=N] "
                 "[--batches=1,2,4] [--seconds=S] [--threads=T] [--streams=N]\n", argv[i], argv[0]);
    return 2;
  }
  if (model.empty()) {
    std::fprintf(stderr, "--model=DIR is required\n");
    return 2;
  }
  if (threads > 0) at::set_num_threads(threads);
  auto engine = collabserve::model::Engine::Load(model);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
    return 1;
  }
  collabserve::model::TokenizedInput in;
  in.input_ids.assign(tokens, 1996);
  in.input_ids.front() = 101;
  in.input_ids.back() = 102;
  in.token_type_ids.assign(tokens, 0);

  std::printf("%8s %8s %12s %12s %14s\n", "streams", "batch", "batch_ms", "inputs/s",
              "cpu_us/input");
  int best_b = 0;
  double best_rate = 0, best_ms = 0, best_cpu_us = 0;
  for (int b : batches) {
    std::vector<collabserve::model::TokenizedInput> batch(b, in);
    if (!(*engine)->Run(batch).ok()) return 1;  // warm-up
    // Each stream runs the same batch over and over until the time is up (at least 3 times).
    std::mutex mu;
    std::vector<double> ms;
    std::string error;
    const double cpu_start = ProcessCpuSeconds();
    const auto t_start = std::chrono::steady_clock::now();
    const auto end = t_start + std::chrono::duration<double>(seconds / batches.size());
    auto stream = [&] {
      if (threads > 0) at::set_num_threads(threads);  // OpenMP's count is per calling thread
      std::vector<double> local;
      while (local.size() < 3 || (std::chrono::steady_clock::now() < end && local.size() < 1000)) {
        const auto t0 = std::chrono::steady_clock::now();
        auto r = (*engine)->Run(batch);
        if (!r.ok()) {
          std::lock_guard<std::mutex> lock(mu);
          error = r.status().ToString();
          return;
        }
        local.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
      std::lock_guard<std::mutex> lock(mu);
      ms.insert(ms.end(), local.begin(), local.end());
    };
    std::vector<std::thread> workers;
    for (int s = 1; s < streams; ++s) workers.emplace_back(stream);
    stream();
    for (auto& t : workers) t.join();
    const double wall_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_start).count();
    // CPU per input does not depend on what else the machine runs (unlike the wall-clock rate).
    const double cpu_us =
        (ProcessCpuSeconds() - cpu_start) * 1e6 / (static_cast<double>(b) * ms.size());
    if (!error.empty()) {
      std::fprintf(stderr, "%s\n", error.c_str());
      return 1;
    }
    std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
    const double median = ms[ms.size() / 2];
    // One stream: the median Run (robust to a stray slow one). Several: completed inputs over the
    // wall time, since their Runs overlap.
    const double rate =
        streams == 1 ? b * 1000.0 / median : static_cast<double>(b) * ms.size() * 1000.0 / wall_ms;
    std::printf("%8d %8d %12.3f %12.1f %14.1f\n", streams, b, median, rate, cpu_us);
    if (rate > best_rate) {
      best_rate = rate;
      best_b = b;
      best_ms = median;
      best_cpu_us = cpu_us;
    }
  }
  std::printf("best batch=%d inputs_per_s=%.1f batch_ms=%.3f streams=%d cpu_us_per_input=%.1f\n",
              best_b, best_rate, best_ms, streams, best_cpu_us);
  return 0;
}
