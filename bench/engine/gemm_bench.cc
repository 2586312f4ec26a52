// The dense layers of a BERT-base pass one at a time: PackedLinear (weights packed at load) vs
// oneDNN's dnnl_sgemm (what the engine used before) vs at::addmm (ATen/OpenBLAS), on the four
// weight shapes of a layer and a few token counts. Prints GFLOP per process CPU second (median of
// timed repetitions; with --threads=1 that is the single-core rate, whatever else the machine runs)
// and the ratio to the best of the other two, measured in the same run.
//
// Usage: gemm_bench [--threads=2] [--rows=16,128,1024,4096] [--reps=0 (auto)]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "server/model/kernels.h"
#include "server/util/process_env.h"

namespace collabserve::model {
namespace {

// Process CPU seconds: on a shared machine a descheduled thread does not count, so the figure is
// the work a product costs rather than how busy the machine was.
double Now() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

template <typename F>
double MedianSeconds(F&& f, double budget_s) {
  f();  // warm-up
  std::vector<double> t;
  double spent = 0;
  while (t.size() < 3 || (spent < budget_s && t.size() < 200)) {
    double t0 = Now();
    f();
    t.push_back(Now() - t0);
    spent += t.back();
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int Main(int argc, char** argv) {
  int threads = 2;
  std::vector<int64_t> rows_list = {16, 128, 1024, 4096};
  double budget_s = 0.5;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    bool ok = false;
    if (a.rfind("--threads=", 0) == 0) ok = absl::SimpleAtoi(a.substr(10), &threads) && threads > 0;
    else if (a.rfind("--budget_s=", 0) == 0) ok = absl::SimpleAtod(a.substr(11), &budget_s);
    else if (a.rfind("--rows=", 0) == 0) {
      rows_list.clear();
      ok = true;
      for (auto p : absl::StrSplit(a.substr(7), ',')) {
        int64_t v = 0;
        ok = ok && absl::SimpleAtoi(p, &v) && v > 0;
        rows_list.push_back(v);
      }
    }
    if (!ok) {
      std::fprintf(stderr, "gemm_bench: bad flag '%s' (--threads=N --rows=A,B --budget_s=S)\n", a.c_str());
      return 2;
    }
  }
  at::set_num_threads(threads);
  // OpenBLAS (at::addmm) keeps its own pool, sized by OPENBLAS_NUM_THREADS or the core count, whose
  // idle workers spin-yield for a while after each call: unpinned, they ran on during the next
  // shape's PackedLinear timing and were charged to it (process CPU time), which made PackedLinear
  // look 40-45% slower than it is on the shapes measured right after an addmm.
  collabserve::util::SetBlasThreads(threads);
  c10::InferenceMode guard;
  const collabserve::util::DnnlSgemmFn sgemm = collabserve::util::DnnlSgemm();
  if (!PackedLinearSupported()) {
    std::fprintf(stderr, "gemm_bench: this CPU has no AVX-512F; PackedLinear is not used here\n");
    return 1;
  }
  // ld: the output's leading dimension. A collaborative layer's projection rows (2·384 + 768
  // columns and 12 content scores) are padded to whole cache lines, as the engine lays them out.
  struct Shape { const char* name; int64_t n, k, ld; };
  const Shape shapes[] = {{"QKV 2304x768", 2304, 768, 2304}, {"out 768x768", 768, 768, 768},
                          {"FFN1 3072x768", 3072, 768, 3072}, {"FFN2 768x3072", 768, 3072, 768},
                          {"collab 1536x768", 1536, 768, 1552}};
  std::printf("threads %d; GFLOP per CPU second (process CPU time, all threads), median; out = x w^T + bias (+ residual for out/FFN2)\n", threads);
  // dnnl unpk: the sgemm on a weight kept only packed (a served model's): the whole weight
  // unpacked ([K, N]), then one product, as one member's share of a long pass does.
  std::printf("%-16s %6s | %9s %9s %9s %10s | %s\n", "weight", "rows", "packed", "dnnl", "addmm",
              "dnnl unpk", "packed / best other, / dnnl unpk");
  for (const Shape& s : shapes) {
    at::Tensor w = at::randn({s.n, s.k}) * 0.05, b = at::randn({s.n});
    PackedWeight pw(w);
    for (int64_t rows : rows_list) {
      at::Tensor x = at::randn({rows, s.k}), res = at::randn({rows, s.ld}), out = at::empty({rows, s.ld});
      const double flops = 2.0 * rows * s.n * s.k;
      double tp = MedianSeconds([&] {
        PackedLinear(x.data_ptr<float>(), s.k, rows, pw, b.data_ptr<float>(), res.data_ptr<float>(),
                     s.ld, out.data_ptr<float>(), s.ld);
      }, budget_s);
      double td = 0, tu = 0;
      if (sgemm != nullptr) {
        at::Tensor wt = at::empty({s.k, s.n});
        tu = MedianSeconds([&] {
          out.copy_(res);
          out.narrow(1, 0, s.n).add_(b);
          pw.UnpackColumns(0, s.n, wt.data_ptr<float>());
          sgemm('N', 'N', rows, s.n, s.k, 1.0f, x.data_ptr<float>(), s.k, wt.data_ptr<float>(), s.n,
                1.0f, out.data_ptr<float>(), s.ld);
        }, budget_s);
        td = MedianSeconds([&] {
          out.copy_(res);
          out.narrow(1, 0, s.n).add_(b);
          sgemm('N', 'T', rows, s.n, s.k, 1.0f, x.data_ptr<float>(), s.k, w.data_ptr<float>(), s.k,
                1.0f, out.data_ptr<float>(), s.ld);
        }, budget_s);
      }
      at::Tensor cols = out.narrow(1, 0, s.n);
      double ta = MedianSeconds([&] {
        out.copy_(res);
        cols.add_(b);
        at::addmm_out(cols, cols, x, w.t());
      }, budget_s);
      double best_other = std::max(td > 0 ? flops / td : 0.0, flops / ta);
      auto rate = [&](double t) { return t > 0 ? std::to_string(flops / t / 1e9).substr(0, 6) : std::string("-"); };
      std::printf("%-16s %6ld | %9.1f %9s %9.1f %10s | %.2fx, %s\n", s.name, static_cast<long>(rows),
                  flops / tp / 1e9, rate(td).c_str(), flops / ta / 1e9, rate(tu).c_str(),
                  (flops / tp) / best_other, tu > 0 ? (std::to_string(tu / tp).substr(0, 4) + "x").c_str() : "-");
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace collabserve::model

int main(int argc, char** argv) { return collabserve::model::Main(argc, argv); }
