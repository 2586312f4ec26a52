// One layer's self-attention on one core, standard heads (score width d_k) against collaborative
// heads (score width R: the shared query/key projections, each head's mixing applied), through the
// engine's per-sequence code (AttendHeads: the AVX-512 attention kernel, or the sgemm and ATen's
// softmax under COLLABSERVE_ATTENTION=sgemm), next to the dense rate of the same row count (PackedLinear, [S, D] x [D, D]) measured
// in the same run. Prints GFLOP per CPU second (scores 2·S·S·width plus context 2·S·S·d_k per
// head) and the ratio to the dense rate: below 1, a collaborative model's extra score FLOPs cost
// more than the dense FLOPs it saves.
//
// Usage: attention_bench [--seqs=16,64,128,256,512] [--widths=64,192,384] [--heads=12]
//                        [--budget_s=1]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <cstdio>
#include <vector>

#include "bench/bench_util.h"
#include "server/model/attention_ops.h"
#include "server/model/dense_ops.h"
#include "server/model/kernels.h"

namespace collabserve::model {
namespace {

struct Flags {
  std::vector<int> seqs = {16, 64, 128, 256, 512};
  std::vector<int> widths = {64, 192, 384};
  int heads = 12;
  double budget_s = 1.0;
};

// Median CPU seconds of f over repetitions (after a warm-up) until budget_s is spent (3 to 200).
template <typename F>
double MedianCpuSeconds(F&& f, double budget_s) {
  f();
  std::vector<double> t;
  double spent = 0;
  while (t.size() < 3 || (spent < budget_s && t.size() < 200)) {
    const double t0 = bench::CpuSeconds();
    f();
    t.push_back(bench::CpuSeconds() - t0);
    spent += t.back();
  }
  return bench::Median(t);
}

int Main(int argc, char** argv) {
  Flags f;
  bench::FlagSet flags("attention_bench");
  flags.Ints("seqs", &f.seqs).Ints("widths", &f.widths).Int("heads", &f.heads, 1).Double("budget_s", &f.budget_s, 0);
  if (!flags.Parse(argc, argv)) return 2;
  internal::SgemmFn sgemm = internal::FindSgemm();
  if (sgemm == nullptr || !PackedLinearSupported()) {
    std::fprintf(stderr, "attention_bench: needs oneDNN's sgemm and AVX-512F\n");
    return 1;
  }
  at::set_num_threads(1);
  c10::InferenceMode guard;
  const int64_t H = f.heads, dk = 64, D = H * dk;
  at::manual_seed(0);
  const PackedWeight dense(at::randn({D, D}));
  std::printf("One core: attention of %lld heads (d_k %lld) per sequence vs PackedLinear [S, %lld] x [%lld, %lld]\n",
              static_cast<long long>(H), static_cast<long long>(dk), static_cast<long long>(D),
              static_cast<long long>(D), static_cast<long long>(D));
  std::printf("%6s %6s | %12s %12s | %8s\n", "seq", "width", "attn GFLOP/s", "dense GFLOP/s", "ratio");
  for (int S : f.seqs) {
    at::Tensor x = at::randn({S, D});
    at::Tensor y = at::empty({S, D});
    const double dense_s = MedianCpuSeconds([&] {
      PackedLinear(x.data_ptr<float>(), D, S, dense, nullptr, nullptr, 0, y.data_ptr<float>(), D);
    }, f.budget_s);
    const double dense_rate = 2.0 * S * D * D / dense_s / 1e9;
    for (int width : f.widths) {
      // The layout the engine gives such a layer (standard heads at width dk, else collaborative
      // at rank `width`: [q~ | k~ | v | content]).
      EncoderLayer layer;
      if (width != dk) {
        layer.collaborative = true;
        layer.rank = width;
        layer.mixing = at::randn({H, width}).mul_(0.125);
      }
      const internal::AttentionLayout L = internal::LayoutOf(layer, H, dk);
      at::Tensor proj = at::randn({S, L.ld});
      at::Tensor ctx = at::empty({S, D});
      at::Tensor scratch = internal::AttentionScratch(S, width, dk, proj.options());
      const double s = MedianCpuSeconds([&] {
        internal::AttendHeads(sgemm, proj.data_ptr<float>(), L, nullptr, 0, 0, H, S, S, D, scratch,
                              ctx.data_ptr<float>());
      }, f.budget_s);
      const double flops = 2.0 * H * S * S * (width + dk);
      std::printf("%6d %6d | %12.1f %12.1f | %7.2fx\n", S, width, flops / s / 1e9, dense_rate,
                  flops / s / 1e9 / dense_rate);
    }
  }
  return 0;
}

}  // namespace
}  // namespace collabserve::model

int main(int argc, char** argv) { return collabserve::model::Main(argc, argv); }
