// The engine's best raw throughput: Engine::Run on equal-length inputs at several batch sizes,
// median time per Run, no gRPC, no queue. run_serving_bench.sh uses it as the ceiling that the
// served throughput is compared with, measured in the same run on the same model.
//
// Usage: serving_engine_peak --model=DIR [--tokens=32] [--batches=1,2,4,8,16,32] [--seconds=2]
//                            [--threads=0 (torch default)]
// Prints a table, then a last line "best batch=B inputs_per_s=X batch_ms=Y".
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
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

}  // namespace

int main(int argc, char** argv) {
  std::string model, v;
  int tokens = 32, threads = 0;
  double seconds = 2;
  std::vector<int> batches = {1, 2, 4, 8, 16, 32};
  for (int i = 1; i < argc; ++i) {
    if (Flag(argv[i], "model", &model)) continue;
    if (Flag(argv[i], "tokens", &v) && absl::SimpleAtoi(v, &tokens) && tokens >= 3) continue;
    if (Flag(argv[i], "threads", &v) && absl::SimpleAtoi(v, &threads)) continue;
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
                 "[--batches=1,2,4] [--seconds=S] [--threads=T]\n", argv[i], argv[0]);
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

  std::printf("%8s %12s %12s\n", "batch", "batch_ms", "inputs/s");
  int best_b = 0;
  double best_rate = 0, best_ms = 0;
  for (int b : batches) {
    std::vector<collabserve::model::TokenizedInput> batch(b, in);
    if (!(*engine)->Run(batch).ok()) return 1;  // warm-up
    std::vector<double> ms;
    const auto end = std::chrono::steady_clock::now() +
                     std::chrono::duration<double>(seconds / batches.size());
    while (ms.size() < 3 || (std::chrono::steady_clock::now() < end && ms.size() < 1000)) {
      const auto t0 = std::chrono::steady_clock::now();
      auto r = (*engine)->Run(batch);
      if (!r.ok()) {
        std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
        return 1;
      }
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
    const double median = ms[ms.size() / 2];
    const double rate = b * 1000.0 / median;
    std::printf("%8d %12.3f %12.1f\n", b, median, rate);
    if (rate > best_rate) {
      best_rate = rate;
      best_b = b;
      best_ms = median;
    }
  }
  std::printf("best batch=%d inputs_per_s=%.1f batch_ms=%.3f\n", best_b, best_rate, best_ms);
  return 0;
}
