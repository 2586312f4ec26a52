// Throughput of Engine::Run (sequences/s) on a BERT-base-shaped checkpoint over a batch × sequence
// length grid, next to the same-run baselines (PyTorch eager and ONNX Runtime CPU, measured by
// pytorch_bench.py and ort_bench.mjs on the same weights and inputs and passed in as TSV files), a
// collaborative version of the model, and the achieved GFLOP/s against a large-SGEMM peak measured
// at the start of the run. scripts/run-bench.sh runs all of it.
//
// Timing: per grid point one warm-up Run (of at most --warmup_batch sequences; on CUDA the whole
// batch), then timed Runs until --budget_s is spent, at least --min_runs and at most --max_runs of
// them; the median is reported. All sequences of a batch have the same length (no padding); token ids are a fixed
// function of (b, s) shared with the baselines.
//
// Collaborative models (--collab_model, one or more directories) are measured at each grid point
// together with the standard one, their timed runs alternating with its runs one by one (the
// order rotated each round, --budget_s per model), so that the machine's drift falls on every
// model alike. A second table gives each collaborative model's seq/s as a ratio to the standard
// model's, with the middle half of the rounds' own ratios as its spread. --memory=1 (the
// default) first prints each model's resident memory as served: a fresh process per model (this
// binary with --rss_child=DIR, three times: the medians) loads it as the server does, runs one
// 8 × 128 call and reports VmRSS and RssAnon (VmRSS less the file pages, mostly the libraries'
// code), minus the same for a generated tiny model, next to the model's float32 parameter bytes;
// then Engine::Load's time in those processes against three more loading without packing.
// Linked with the server's allocator (jemalloc where the server has it), so that both the timings
// and the memory are those of the engine as served.
//
// Usage: engine_bench --model=DIR [--collab_model=DIR[,DIR...]] [--batches=1,8,32]
//                     [--seqs=16,128,512] [--threads=2] [--budget_s=4] [--min_runs=3]
//                     [--max_runs=50] [--warmup_batch=8] [--pytorch_tsv=FILE] [--ort_tsv=FILE]
//                     [--tsv_out=FILE] [--sgemm=2048] [--stream_mb=512] [--memory=1]
//                     [--device=cpu|cuda[:N]] [--dtype=float32|float16|bfloat16]
//                     [--op_profile=PASSES] [--gpu_kernels=PASSES] [--cuda_graph_max_tokens=N]
//                     [--collab_attention=bias[,qk-column,...]] [--ragged=0|1]
// On a GPU (--device=cuda) the timings include copying the logits back (Run returns them on the
// CPU, which waits for the GPU), and the memory table is skipped. Passes of up to
// --cuda_graph_max_tokens tokens replay CUDA graphs (EngineOptions; default 4096, 0: none), the
// first run of each point captures them in the warm-up.
// --op_profile=PASSES: instead of the tables, for each grid point and model, PASSES runs timed as
// usual, then PASSES more observed by an OpProfile (server/model/op_profile.h): the ATen operators
// the calling thread dispatches, by host time. On a GPU that is the whole pass, and the copy of the
// logits to the CPU (aten::to, its longest call) holds the wait for the device: a pass whose
// operators take nearly all its time, with a short wait in that copy, is bound by launching them.
// On the CPU the encoder team's threads run most layers unobserved.
// --collab_attention=WAY[,WAY...]: each collaborative model is loaded once per way of putting its
// attention to ATen's (server/model/collab_attention.h; EngineOptions::collab_attention; default
// bias), and every (model, way) is a column of the tables: the ways in whole passes, alternating.
// They differ where attention runs on ATen ops (CUDA; COLLABSERVE_GEMM=aten on the CPU).
// --ragged=1: padded batches, as served: the even-numbered sequences (the first included) are a
// quarter shorter, so every layer takes the padding mask (a batch of one is just shorter). Timing
// tables only; seq/s counts sequences as before.
// --gpu_kernels=PASSES (CUDA, LibTorch 2.x): instead of the tables, for each grid point and model
// the kernels (and copies) the device ran in PASSES passes, recorded by LibTorch's Kineto profiler:
// kernels a pass, device time a pass (summed, and the union of their intervals: the time the device
// was busy) against the pass's wall time, and the kernels by device time. pytorch_bench.py
// --gpu_kernels prints the same for PyTorch eager.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/version.h>
#if TORCH_VERSION_MAJOR >= 2
// The device's kernels as LibTorch's Kineto profiler records them: 2.x only (1.13's events time
// in µs, and Debian's 1.13 is built without Kineto).
#include <torch/csrc/autograd/profiler_kineto.h>
#define COLLABSERVE_HAVE_KINETO_EVENTS 1
#else
#define COLLABSERVE_HAVE_KINETO_EVENTS 0
#endif
#include <dlfcn.h>
#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "server/model/checkpoint_maker.h"
#include "server/model/engine.h"
#include "server/model/kernels.h"
#include "server/model/op_profile.h"
#include "server/model/pass_arena.h"
#include "server/util/process_env.h"
#include "server/util/process_memory.h"

namespace collabserve::model {
namespace {

using bench::CpuSeconds;
using bench::Median;

struct Flags {
  std::string model, pytorch_tsv, ort_tsv, tsv_out, rss_child;
  std::vector<std::string> collab_models;
  std::vector<CollabAttention> collab_attention = {CollabAttention::kBias};
  int ragged = 0;
  int memory = 1;
  int pack_weights = 1;  // --rss_child only: EngineOptions::pack_weights
  int op_profile = 0;    // passes observed per grid point and model; 0: the timing tables
  int gpu_kernels = 0;   // passes whose device kernels are recorded; 0: the timing tables
  int cuda_graph_max_tokens = static_cast<int>(EngineOptions{}.cuda_graph_max_tokens);
  std::string device = "cpu", dtype = "float32";
  std::vector<int> batches = {1, 8, 32};
  std::vector<int> seqs = {16, 128, 512};
  int threads = 2;
  double budget_s = 4.0;
  int min_runs = 3;
  int max_runs = 50;
  int sgemm = 2048;
  int stream_mb = 512;
  int warmup_batch = 8;
};

bool ParseFlags(int argc, char** argv, Flags* f) {
  std::string collab, ways = "bias";
  if (!bench::FlagSet("engine_bench")
           .String("model", &f->model)
           .String("collab_model", &collab)
           .String("collab_attention", &ways)
           .Int("ragged", &f->ragged, 0)
           .String("rss_child", &f->rss_child)
           .Int("memory", &f->memory)
           .Int("pack_weights", &f->pack_weights)
           .Int("op_profile", &f->op_profile, 0)
           .Int("gpu_kernels", &f->gpu_kernels, 0)
           .Int("cuda_graph_max_tokens", &f->cuda_graph_max_tokens, 0)
           .String("device", &f->device)
           .String("dtype", &f->dtype)
           .String("pytorch_tsv", &f->pytorch_tsv)
           .String("ort_tsv", &f->ort_tsv)
           .String("tsv_out", &f->tsv_out)
           .Ints("batches", &f->batches)
           .Ints("seqs", &f->seqs)
           .Int("threads", &f->threads, 1)
           .Double("budget_s", &f->budget_s, 0)
           .Int("min_runs", &f->min_runs, 1)
           .Int("max_runs", &f->max_runs, 1)
           .Int("warmup_batch", &f->warmup_batch, 1)
           .Int("sgemm", &f->sgemm, 0)
           .Int("stream_mb", &f->stream_mb, 0)
           .Parse(argc, argv)) {
    return false;
  }
  f->collab_models = absl::StrSplit(collab, ',', absl::SkipEmpty());
  f->collab_attention.clear();
  const std::vector<std::string> names = absl::StrSplit(ways, ',', absl::SkipEmpty());
  for (const std::string& name : names) {
    const auto way = ParseCollabAttention(name);
    if (!way) {
      std::string known;
      for (CollabAttention w : kAllCollabAttentions) {
        known += std::string(known.empty() ? "" : ", ") + CollabAttentionName(w);
      }
      std::fprintf(stderr, "engine_bench: --collab_attention: unknown way '%s' (%s)\n", name.c_str(),
                   known.c_str());
      return false;
    }
    f->collab_attention.push_back(*way);
  }
  if (f->collab_attention.empty()) {
    std::fprintf(stderr, "engine_bench: --collab_attention names no way\n");
    return false;
  }
  if (f->model.empty() && f->rss_child.empty()) {
    std::fprintf(stderr, "engine_bench: --model=DIR is required\n");
    return false;
  }
  return true;
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The inputs every implementation in the bench uses (pytorch_bench.py and ort_bench.mjs compute
// the same ids): [CLS] ... [SEP], segment 0, no padding. ragged (--ragged): the even-numbered
// sequences end a quarter early (at least [CLS] and [SEP] kept), so the batch is padded.
std::vector<TokenizedInput> MakeInputs(int batch, int seq, bool ragged = false) {
  std::vector<TokenizedInput> out(batch);
  for (int b = 0; b < batch; ++b) {
    auto& in = out[b];
    const int len = ragged && b % 2 == 0 ? std::max(2, seq - seq / 4) : seq;
    in.input_ids.resize(len);
    in.token_type_ids.assign(len, 0);
    for (int s = 0; s < len; ++s) {
      in.input_ids[s] = 1000 + static_cast<int32_t>((static_cast<int64_t>(b) * seq + s) * 7919 % 20000);
    }
    in.input_ids[0] = 101;
    in.input_ids[len - 1] = 102;
  }
  return out;
}

// One Engine::Run; a failed one ends the bench.
void RunOrDie(const Engine& engine, const std::vector<TokenizedInput>& inputs) {
  auto r = engine.Run(inputs);
  if (!r.ok()) {
    std::fprintf(stderr, "engine_bench: Run failed: %s\n", r.status().ToString().c_str());
    std::exit(1);
  }
}

// The profiles' baseline: one warm-up Run on the full shape (a GPU's allocator and kernel choices
// are per shape), then `passes` timed ones; their seconds.
std::vector<double> WarmAndTime(const Engine& engine, const std::vector<TokenizedInput>& inputs, int passes) {
  RunOrDie(engine, inputs);
  std::vector<double> times;
  for (int i = 0; i < passes; ++i) {
    const double t0 = Now();
    RunOrDie(engine, inputs);
    times.push_back(Now() - t0);
  }
  return times;
}

// Multiply-adds ×2 of the forward pass collabserve computes: every matmul weight once per token
// (the head once per sequence) plus attention's scores and context products; in the last layer
// (whose output the pooler reads at [CLS] only) the keys and values for every token and the rest
// (standard queries, the attention, the output projection, the FFN) for the [CLS] token alone.
// PyTorch and ONNX Runtime compute the whole last layer, so on BERT-base collabserve does about 7%
// less work than they do (10 of the last layer's 12·D² multiply-adds per token).
double ForwardFlops(const ModelInfo& m, int batch, int seq) {
  const double D = m.hidden_size, F = m.intermediate_size, H = m.num_heads, dk = m.head_size;
  const double tokens = static_cast<double>(batch) * seq, S = seq;
  double flops = 0;
  for (int i = 0; i < m.num_layers; ++i) {
    const bool last = i + 1 == m.num_layers;
    const double rows = last ? batch : tokens;  // rows after the attention
    const double R = m.collaborative_ranks.empty() ? 0 : m.collaborative_ranks[i];
    if (R > 0) {
      flops += 2 * (2 * R + D + H) * D * tokens;  // W~Q, W~K, value, content bias
      flops += 2.0 * batch * H * (last ? 1 : S) * S * (R + dk);  // (X W~Q diag m_i)(Y W~K)^T, probs V
    } else {
      flops += 2 * (2 * D * D * tokens + D * D * rows);  // keys, values | queries
      flops += 4.0 * batch * H * (last ? 1 : S) * S * dk;
    }
    flops += 2 * (D * D + 2 * D * F) * rows;  // output projection, FFN
  }
  flops += 2.0 * batch * (D * D + static_cast<double>(m.labels.size()) * D);
  return flops;
}

struct Point {
  double seq_per_s = 0;
  double cpu_ms_per_seq = 0;  // median process CPU time of a run / batch: the work, whatever the load
  double cpu_util = 0;        // process CPU seconds / wall seconds over the timed runs
  std::vector<double> times;  // each timed run's seconds, in round order (MeasureAlternating)
};

// Every model's Point at one grid point. Each model has one warm-up run, then the timed runs
// alternate between the models, one run each per round (round r starts at model r mod M), so a
// slow spell of the machine falls on every model alike, at the scale of one run rather than of a
// whole measurement; until every model has had min_runs and the budget (budget_s per model) is
// spent, or max_runs each.
std::vector<Point> MeasureAlternating(const std::vector<const Engine*>& models, int batch, int seq,
                                      const Flags& f) {
  const auto inputs = MakeInputs(batch, seq, f.ragged != 0);
  // Warm-up (allocator, OpenBLAS buffers, first-touch pages) on at most --warmup_batch sequences:
  // a full 32 × 512 batch would cost as much as a timed run. A GPU warms up on the full shape (its
  // caching allocator and kernel choices are per shape), as pytorch_bench.py does there.
  const bool gpu = f.device.rfind("cuda", 0) == 0;
  const std::vector<TokenizedInput> head(inputs.begin(),
                                         inputs.begin() + (gpu ? batch : std::min(batch, f.warmup_batch)));
  for (const Engine* e : models) RunOrDie(*e, head);
  const size_t M = models.size();
  std::vector<std::vector<double>> times(M), cpu_times(M);
  double spent = 0;
  for (int r = 0; r < f.max_runs && (r < f.min_runs || spent < f.budget_s * M); ++r) {
    for (size_t i = 0; i < M; ++i) {
      const size_t m = (i + r) % M;
      const double t0 = Now(), c0 = CpuSeconds();
      RunOrDie(*models[m], inputs);
      times[m].push_back(Now() - t0);
      cpu_times[m].push_back(CpuSeconds() - c0);
      spent += times[m].back();
    }
  }
  std::vector<Point> points(M);
  for (size_t m = 0; m < M; ++m) {
    Point& p = points[m];
    p.seq_per_s = batch / Median(times[m]);
    p.cpu_ms_per_seq = 1e3 * Median(cpu_times[m]) / batch;
    double wall = 0, cpu = 0;
    for (size_t i = 0; i < times[m].size(); ++i) wall += times[m][i], cpu += cpu_times[m][i];
    p.cpu_util = cpu / wall;
    p.times = times[m];
  }
  return points;
}

// A profile's table (as pytorch_bench.py's print_top): rows over `passes` passes, most time first;
// the first 15 with calls and µs a pass, µs a call and their further columns, then one line for
// the others.
struct ProfileRow {
  std::string name;
  double calls = 0, seconds = 0;
  std::vector<double> more;  // printed as they are, under `more_heads`
};
void PrintTop(const char* what, int width, const std::vector<const char*>& more_heads,
              std::vector<ProfileRow> rows, int passes, const char* other) {
  std::stable_sort(rows.begin(), rows.end(), [](const ProfileRow& a, const ProfileRow& b) { return a.seconds > b.seconds; });
  const double n = passes;
  std::printf("  %-*s %8s %10s %9s", width, what, "calls", "us a pass", "us a call");
  for (const char* h : more_heads) std::printf(" %11s", h);
  std::printf("\n");
  double rest_s = 0, rest_calls = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const ProfileRow& r = rows[i];
    if (i >= 15) {
      rest_s += r.seconds, rest_calls += r.calls;
      continue;
    }
    std::printf("  %-*.*s %8.1f %10.1f %9.2f", width, width, r.name.c_str(), r.calls / n, 1e6 * r.seconds / n,
                1e6 * r.seconds / r.calls);
    for (double v : r.more) std::printf(" %11.1f", v);
    std::printf("\n");
  }
  if (rest_calls > 0) std::printf("  %-*s %8.1f %10.1f\n", width, other, rest_calls / n, 1e6 * rest_s / n);
  std::fflush(stdout);
}

// --op_profile: `passes` runs timed, then `passes` more under an OpProfile; prints the pass's time
// both ways and the operators by host time a pass (the first 15, then the rest in one line).
void PrintOpProfile(const std::string& label, const Engine& engine, int batch, int seq, int passes) {
  const auto inputs = MakeInputs(batch, seq);
  const std::vector<double> plain = WarmAndTime(engine, inputs, passes);
  std::vector<double> observed;
  OpProfile profile;
  for (int i = 0; i < passes; ++i) {
    const double t0 = Now();
    RunOrDie(engine, inputs);
    observed.push_back(Now() - t0);
  }
  profile.Stop();
  const double n = passes;
  const auto ops = profile.Ops();
  int64_t nested = 0;
  OpProfile::Op longest;
  for (const auto& op : ops) {
    nested += op.nested;
    if (op.longest > longest.longest) longest = op;
  }
  std::printf("\nop profile: %s, %d x %d, %d passes: %.3f ms a pass (median; %.3f ms observed), of which "
              "%.3f ms in %.1f top-level operator calls (%.1f nested in them); the longest call: %s, "
              "%.3f ms\n",
              label.c_str(), batch, seq, passes, 1e3 * Median(plain), 1e3 * Median(observed),
              1e3 * profile.seconds() / n, profile.top_level_calls() / n, nested / n,
              longest.name.empty() ? "(none)" : longest.name.c_str(), 1e3 * longest.longest);
  std::vector<ProfileRow> rows;
  for (const auto& op : ops) {
    if (op.calls > 0) rows.push_back({op.name, double(op.calls), op.seconds, {1e6 * op.longest, op.nested / n}});
  }
  PrintTop("operator", 40, {"longest us", "nested"}, rows, passes, "(the other operators)");
}

// --gpu_kernels: `passes` runs timed, then `passes` more recorded by the Kineto profiler (device
// activities only); prints kernels and device time a pass, and the kernels by device time.
void PrintGpuKernels(const std::string& label, const Engine& engine, int batch, int seq, int passes) {
#if COLLABSERVE_HAVE_KINETO_EVENTS
  namespace tpi = torch::profiler::impl;
  namespace tap = torch::autograd::profiler;
  const auto inputs = MakeInputs(batch, seq);
  const std::vector<double> plain = WarmAndTime(engine, inputs, passes);
  const tpi::ProfilerConfig config(tpi::ProfilerState::KINETO);
  const std::set<tpi::ActivityType> activities = {tpi::ActivityType::CUDA};
  tap::prepareProfiler(config, activities);
  tap::enableProfiler(config, activities);
  for (int i = 0; i < passes; ++i) RunOrDie(engine, inputs);
  const std::unique_ptr<tap::ProfilerResult> result = tap::disableProfiler();
  struct Kernel {
    int64_t calls = 0;
    double ns = 0;
  };
  std::map<std::string, Kernel> kernels;
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (const auto& e : result->events()) {
    if (e.deviceType() != c10::DeviceType::CUDA) continue;
    Kernel& k = kernels[e.name()];
    ++k.calls;
    k.ns += static_cast<double>(e.durationNs());
    spans.emplace_back(e.startNs(), e.endNs());
  }
  std::sort(spans.begin(), spans.end());
  double busy_ns = 0, total_ns = 0;
  int64_t calls = 0;
  uint64_t open_start = 0, open_end = 0;
  for (const auto& [start, end] : spans) {
    if (start > open_end) {
      busy_ns += static_cast<double>(open_end - open_start);
      open_start = start;
    }
    open_end = std::max(open_end, end);
  }
  busy_ns += static_cast<double>(open_end - open_start);
  std::vector<ProfileRow> rows;
  for (const auto& [name, k] : kernels) {
    rows.push_back({name, double(k.calls), 1e-9 * k.ns, {}});
    total_ns += k.ns, calls += k.calls;
  }
  const double n = passes;
  std::printf("\ngpu kernels: %s, %d x %d, %d passes: %.3f ms a pass (median, unrecorded); %.1f kernels and "
              "copies a pass, %.3f ms of device time (busy %.3f ms)\n",
              label.c_str(), batch, seq, passes, 1e3 * Median(plain), calls / n, 1e-6 * total_ns / n,
              1e-6 * busy_ns / n);
  PrintTop("kernel", 64, {}, rows, passes, "(the other kernels)");
#else
  (void)label, (void)engine, (void)batch, (void)seq, (void)passes;
  std::fprintf(stderr, "engine_bench: --gpu_kernels needs LibTorch 2.x (this is %s)\n", TORCH_VERSION);
  std::exit(2);
#endif
}

double SgemmPeak(int n) {
  c10::InferenceMode guard;
  at::Tensor a = at::randn({n, n}), b = at::randn({n, n}), c = at::empty({n, n});
  // The faster of ATen's GEMM (the BLAS it links) and PackedLinear (where AVX-512F is): OpenBLAS
  // 0.3.21 runs its AVX2 kernel on AMD CPUs that have AVX-512, at half PackedLinear's rate there.
  std::unique_ptr<PackedWeight> packed;
  if (PackedLinearSupported()) packed = std::make_unique<PackedWeight>(b);
  double best = 0;
  for (int which = 0; which < (packed ? 2 : 1); ++which) {
    auto run = [&] {
      if (which == 0) {
        at::mm_out(c, a, b);
      } else {
        PackedLinear(a.data_ptr<float>(), n, n, *packed, nullptr, nullptr, 0, c.data_ptr<float>(), n);
      }
    };
    run();
    std::vector<double> times;
    for (int i = 0; i < 5; ++i) {
      double t0 = Now();
      run();
      times.push_back(Now() - t0);
    }
    best = std::max(best, 2.0 * n * n * n / Median(times) / 1e9);
  }
  return best;
}

// The rate at which `threads` threads read a buffer of `mb` MiB that no cache holds (each its own
// slice, summed as integers so the compiler vectorises the loop), GB/s, median of 3: the ceiling of
// a pass whose weights stream from memory (BERT-base: 340 MB of fp32 weights a pass, so at 16
// tokens the stream time is comparable to the arithmetic).
double StreamReadGBs(int mb, int threads) {
  const size_t words = static_cast<size_t>(mb) << 17;  // 8-byte words
  std::vector<uint64_t> buf(words, 1);
  std::vector<double> times;
  std::vector<uint64_t> sums(threads);
  for (int rep = 0; rep < 4; ++rep) {
    const double t0 = Now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] {
        const size_t b = words * t / threads, e = words * (t + 1) / threads;
        uint64_t sum = 0;
        for (size_t i = b; i < e; ++i) sum += buf[i];
        sums[t] = sum;
      });
    }
    for (auto& th : ts) th.join();
    if (rep > 0) times.push_back(Now() - t0);  // the first run also faults the pages in
  }
  uint64_t total = 0;
  for (uint64_t x : sums) total += x;
  if (total != words) std::fprintf(stderr, "engine_bench: stream check failed\n");
  return 8.0 * static_cast<double>(words) / Median(times) / 1e9;
}

struct Baseline {
  double seq_per_s = 0;
  double cpu_ms_per_seq = 0;
};
using Baselines = std::map<std::pair<int, int>, Baseline>;

// Reads "batch<TAB>seq<TAB>seq_per_s<TAB>runs<TAB>cpu_ms_per_seq" lines ('#' starts a comment).
Baselines ReadTsv(const std::string& path) {
  Baselines out;
  if (path.empty()) return out;
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "engine_bench: cannot read %s\n", path.c_str());
    std::exit(1);
  }
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    int b = 0, s = 0, runs = 0;
    Baseline v;
    if (!(ls >> b >> s >> v.seq_per_s >> runs >> v.cpu_ms_per_seq)) {
      std::fprintf(stderr, "engine_bench: %s: bad line '%s'\n", path.c_str(), line.c_str());
      std::exit(1);
    }
    out[{b, s}] = v;
  }
  return out;
}

std::string Fmt(const char* fmt, double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

std::unique_ptr<Engine> LoadOrDie(const std::string& dir, const Flags& f,
                                  CollabAttention way = CollabAttention::kBias) {
  EngineOptions o;
  o.collab_attention = way;
  o.device = f.device;
  o.dtype = f.dtype;
  o.pack_weights = f.pack_weights != 0;
  o.cuda_graph_max_tokens = f.cuda_graph_max_tokens;
  auto e = Engine::Load(dir, o);
  if (!e.ok()) {
    std::fprintf(stderr, "engine_bench: %s\n", e.status().ToString().c_str());
    std::exit(1);
  }
  return std::move(*e);
}

// --rss_child=DIR: load DIR as the server does (with --pack_weights=0: in the unpacked form
// that conversions use), run one call of 8 sequences of min(128, max_length) tokens, give freed
// memory back (the allocator's, and the pages of the pass arena, which an idle server gives back
// after 10 s), print "rss_bytes N params N anon_bytes N load_s X" (X: Engine::Load's wall time).
int RssChild(const Flags& f) {
  at::set_num_threads(f.threads);
  const double t0 = Now();
  std::unique_ptr<Engine> engine = LoadOrDie(f.rss_child, f);
  const double load_s = Now() - t0;
  auto r = engine->Run(MakeInputs(8, std::min(128, engine->info().max_length)));
  if (!r.ok()) {
    std::fprintf(stderr, "engine_bench: Run failed: %s\n", r.status().ToString().c_str());
    return 1;
  }
  PassArena::Shared().ReleaseIfIdle();
  util::ReleaseFreedMemory();
  auto m = util::ReadProcessMemory();
  if (!m.ok()) {
    std::fprintf(stderr, "engine_bench: %s\n", m.status().ToString().c_str());
    return 1;
  }
  std::printf("rss_bytes %lld params %lld anon_bytes %lld load_s %.6f\n", static_cast<long long>(m->rss_bytes),
              static_cast<long long>(engine->info().params.total),
              static_cast<long long>(m->rss_anon_bytes), load_s);
  return 0;
}

struct Resident {
  int64_t rss_bytes = -1, anon_bytes = -1, params = 0;
  double load_s = -1;
};

// One fresh process's figures for `dir` (pack: load it packed, as served).
Resident MeasureResidentOnce(const std::string& dir, int threads, bool pack) {
  // This binary's path (popen runs a shell, for which /proc/self/exe is the shell).
  char self[4096];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  Resident r;
  if (len <= 0) return r;
  self[len] = '\0';
  const std::string cmd = std::string("'") + self + "' --rss_child='" + dir + "' --threads=" +
                          std::to_string(threads) + " --pack_weights=" + (pack ? "1" : "0");
  std::FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  long long rss = 0, params = 0, anon = 0;
  double load_s = 0;
  if (std::fscanf(p, "rss_bytes %lld params %lld anon_bytes %lld load_s %lf", &rss, &params, &anon, &load_s) == 4) {
    r = {rss, anon, params, load_s};
  }
  pclose(p);
  return r;
}

// The median of kMemoryRuns processes, each figure on its own: VmRSS varies by a few hundred KiB
// from one process to the next (RssFile: which pages of the libraries' code were faulted in),
// RssAnon by a few tens.
constexpr int kMemoryRuns = 3;
Resident MeasureResident(const std::string& dir, int threads, bool pack = true) {
  std::vector<double> rss, anon, load;
  Resident r;
  for (int i = 0; i < kMemoryRuns; ++i) {
    const Resident once = MeasureResidentOnce(dir, threads, pack);
    if (once.rss_bytes < 0) return Resident();
    rss.push_back(static_cast<double>(once.rss_bytes));
    anon.push_back(static_cast<double>(once.anon_bytes));
    load.push_back(once.load_s);
    r.params = once.params;
  }
  r.rss_bytes = static_cast<int64_t>(Median(rss));
  r.anon_bytes = static_cast<int64_t>(Median(anon));
  r.load_s = Median(load);
  return r;
}

// The memory table (--memory=1): each model's resident memory as served, in processes of its own.
void PrintMemory(const Flags& f) {
  char tmpl[] = "/tmp/engine_bench_tiny_XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return;
  const std::string tiny = tmpl;
  MakeOptions o;
  o.preset = "tiny";
  if (!MakeCheckpoint(tiny, o).ok()) return;
  const Resident base = MeasureResident(tiny, f.threads);
  std::system(("rm -rf '" + tiny + "'").c_str());
  std::printf("\nServed memory (after load and one 8 x 128 call, median of %d processes each, minus a tiny "
              "model's: VmRSS %.0f MiB, RssAnon %.0f MiB):\n",
              kMemoryRuns, base.rss_bytes / 1048576.0, base.anon_bytes / 1048576.0);
  const char* row = "%-40s | %10s | %12s | %9s | %10s | %9s | %s\n";
  std::printf(row, "model", "params MiB", "resident MiB", "/ params", "anon MiB", "/ params",
              "vs standard, MiB: params saved / resident saved / anon saved");
  std::vector<std::string> dirs = {f.model};
  dirs.insert(dirs.end(), f.collab_models.begin(), f.collab_models.end());
  Resident standard;
  const double mib = 1048576.0;
  std::vector<double> load_s(dirs.size(), -1);
  for (size_t i = 0; i < dirs.size(); ++i) {
    const Resident r = MeasureResident(dirs[i], f.threads);
    load_s[i] = r.load_s;
    if (r.rss_bytes < 0 || base.rss_bytes < 0) {
      std::printf("%-40s | could not be measured\n", dirs[i].c_str());
      continue;
    }
    const double params = 4.0 * r.params, resident = static_cast<double>(r.rss_bytes - base.rss_bytes),
                 anon = static_cast<double>(r.anon_bytes - base.anon_bytes);
    if (i == 0) standard = r;
    std::string saving = "-";
    if (i > 0 && standard.rss_bytes >= 0) {
      saving = Fmt("%.2f", 4.0 * (standard.params - r.params) / mib) + " / " +
               Fmt("%.2f", (standard.rss_bytes - r.rss_bytes) / mib) + " / " +
               Fmt("%.2f", (standard.anon_bytes - r.anon_bytes) / mib);
    }
    std::printf(row, dirs[i].c_str(), Fmt("%.1f", params / mib).c_str(), Fmt("%.1f", resident / mib).c_str(),
                Fmt("%.3fx", resident / params).c_str(), Fmt("%.1f", anon / mib).c_str(),
                Fmt("%.3fx", anon / params).c_str(), saving.c_str());
  }
  // Loading: the served form (packed weights, the plain ones dropped) against the same checkpoint
  // loaded without packing, as conversions load it (the read, the tensors, the fused projection).
  std::printf("\nLoad time (Engine::Load wall seconds in the processes above, median of %d; unpacked: %d more "
              "processes each, --pack_weights=0):\n",
              kMemoryRuns, kMemoryRuns);
  const char* load_row = "%-40s | %9s | %11s | %s\n";
  std::printf(load_row, "model", "served s", "unpacked s", "served / unpacked");
  for (size_t i = 0; i < dirs.size(); ++i) {
    const Resident u = MeasureResident(dirs[i], f.threads, /*pack=*/false);
    if (load_s[i] < 0 || u.load_s <= 0) {
      std::printf("%-40s | could not be measured\n", dirs[i].c_str());
      continue;
    }
    std::printf(load_row, dirs[i].c_str(), Fmt("%.3f", load_s[i]).c_str(), Fmt("%.3f", u.load_s).c_str(),
                Fmt("%.2fx", load_s[i] / u.load_s).c_str());
  }
  std::fflush(stdout);
}

int Main(int argc, char** argv) {
  Flags f;
  if (!ParseFlags(argc, argv, &f)) return 2;
  if (!f.rss_child.empty()) return RssChild(f);
  if (f.memory && f.device == "cpu") PrintMemory(f);

  // Process settings (what the server's main should set too). Threads: ATen's intra-op pool (OpenMP here)
  // and OpenBLAS's own pthreads pool, both to --threads.
  at::set_num_threads(f.threads);
  // Keep freed activation buffers (up to glibc's 32 MiB mmap ceiling) in the heap instead of
  // returning them to the kernel after every Run: otherwise each forward pass page-faults and zeroes
  // its buffers afresh (~10% of a BERT-base pass at batch 1).
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  util::SetBlasThreads(f.threads);
  using GetConfig = char* (*)();
  auto openblas_config = reinterpret_cast<GetConfig>(dlsym(RTLD_DEFAULT, "openblas_get_config"));

  std::unique_ptr<Engine> engine = LoadOrDie(f.model, f);
  // One engine per collaborative model and way (--collab_attention), named by the model's
  // directory, and the way where several are measured.
  std::vector<std::unique_ptr<Engine>> collabs;
  std::vector<std::string> collab_names, collab_ways;
  for (const std::string& dir : f.collab_models) {
    for (CollabAttention way : f.collab_attention) {
      collabs.push_back(LoadOrDie(dir, f, way));
      const std::string w = f.collab_attention.size() > 1 ? CollabAttentionName(way) : "";
      collab_names.push_back(w.empty() ? dir : dir + " (" + w + ")");
      collab_ways.push_back(w);
    }
  }
  const Engine* collab = collabs.empty() ? nullptr : collabs[0].get();

  double loadavg[1] = {0};
  getloadavg(loadavg, 1);
  std::printf("engine_bench: at::get_num_threads()=%d, OpenBLAS threads=%d (%s), OMP_WAIT_POLICY=%s, "
              "%ld online CPUs, load average %.2f at start\n",
              at::get_num_threads(), util::BlasThreads(),
              openblas_config ? openblas_config() : "OpenBLAS not found",
              std::getenv("OMP_WAIT_POLICY") ? std::getenv("OMP_WAIT_POLICY") : "(unset)",
              sysconf(_SC_NPROCESSORS_ONLN), loadavg[0]);
  const ModelInfo& info = engine->info();
  std::string graphs;
  if (info.device != "cpu") {
    graphs = f.cuda_graph_max_tokens > 0
                 ? ", CUDA graphs up to " + std::to_string(f.cuda_graph_max_tokens) + " tokens a pass"
                 : ", no CUDA graphs";
  }
  std::printf("device %s, dtype %s%s%s\n", info.device.c_str(), info.dtype.c_str(), graphs.c_str(),
              f.ragged ? ", padded batches (--ragged)" : "");
  std::printf("model: %d layers, hidden %d, %d heads, FFN %d, %zu labels", info.num_layers,
              info.hidden_size, info.num_heads, info.intermediate_size, info.labels.size());
  if (collab && !collab->info().collaborative_ranks.empty()) {
    std::printf("; collaborative column: rank %d (%s)", collab->info().collaborative_ranks[0],
                collab_names[0].c_str());
  }
  std::printf("\n");
  if (f.gpu_kernels > 0 && info.device.rfind("cuda", 0) != 0) {
    std::fprintf(stderr, "engine_bench: --gpu_kernels records a GPU's kernels: it needs --device=cuda\n");
    return 2;
  }
  if (f.op_profile > 0 || f.gpu_kernels > 0) {
    std::vector<std::pair<std::string, const Engine*>> models = {{f.model, engine.get()}};
    for (size_t i = 0; i < collabs.size(); ++i) models.push_back({collab_names[i], collabs[i].get()});
    for (int b : f.batches) {
      for (int s : f.seqs) {
        if (s > info.max_length) continue;
        for (const auto& [dir, e] : models) {
          std::string name = dir;
          while (name.size() > 1 && name.back() == '/') name.pop_back();
          name = name.substr(name.find_last_of('/') + 1);
          if (f.op_profile > 0) PrintOpProfile(name, *e, b, s, f.op_profile);
          if (f.gpu_kernels > 0) PrintGpuKernels(name, *e, b, s, f.gpu_kernels);
        }
      }
    }
    return 0;
  }
  double peak = f.sgemm > 0 ? SgemmPeak(f.sgemm) : 0;
  if (peak > 0) std::printf("SGEMM peak (%d^3, faster of at::mm and PackedLinear, median of 5): %.1f GFLOP/s\n", f.sgemm, peak);
  if (f.stream_mb > 0) {
    std::printf("memory read (%d MiB, %d threads, median of 3): %.1f GB/s\n", f.stream_mb,
                f.threads, StreamReadGBs(f.stream_mb, f.threads));
  }
  std::fflush(stdout);

  auto pytorch = ReadTsv(f.pytorch_tsv);
  auto ort = ReadTsv(f.ort_tsv);
  std::FILE* tsv = f.tsv_out.empty() ? nullptr : std::fopen(f.tsv_out.c_str(), "w");
  if (!f.tsv_out.empty() && !tsv) {
    std::fprintf(stderr, "engine_bench: cannot write %s\n", f.tsv_out.c_str());
    return 1;
  }
  if (tsv) {
    // Then one column per collaborative model (--collab_model's order), named by its first rank,
    // and its way where several are measured (rank_192_qk-column_seq_per_s).
    std::fprintf(tsv, "# batch\tseq\tcollabserve_seq_per_s\truns\tcpu_ms_per_seq");
    for (size_t i = 0; i < collabs.size(); ++i) {
      const auto& ranks = collabs[i]->info().collaborative_ranks;
      std::fprintf(tsv, "\trank_%d%s%s_seq_per_s", ranks.empty() ? 0 : ranks[0],
                   collab_ways[i].empty() ? "" : "_", collab_ways[i].c_str());
    }
    std::fprintf(tsv, "\n");
  }

  struct CollabRow {
    int batch, seq;
    Point standard;
    std::vector<Point> collab;
  };
  std::vector<CollabRow> collab_rows;
  const char* row = "%5s %5s | %11s %9s | %9s %9s | %8s | %8s %6s | %7s %7s %7s %8s | %5s %4s\n";
  std::printf("\n");
  std::printf(row, "batch", "seq", "collabserve", "collab", "PyTorch", "ORT", "vs best", "GFLOP/s",
              "%peak", "CPU ms", "per seq", "", "CPU vs", "CPU%", "runs");
  std::printf(row, "", "", "seq/s", "seq/s", "seq/s", "seq/s", "baseline", "", "", "collab-", "PyTorch",
              "ORT", "best", "", "");
  std::printf(row, "", "", "", "", "", "", "", "", "", "serve", "", "", "baseline", "", "");
  std::printf("------------+-----------------------+---------------------+----------+-----------------+"
              "----------------------------------+-----------\n");
  for (int b : f.batches) {
    for (int s : f.seqs) {
      if (s > info.max_length) {
        std::printf("%5d %5d | longer than the model's max_length %d: skipped\n", b, s, info.max_length);
        continue;
      }
      // Model 0 the standard one, then the collaborative ones.
      std::vector<const Engine*> models = {engine.get()};
      for (const auto& c : collabs) models.push_back(c.get());
      const std::vector<Point> points = MeasureAlternating(models, b, s, f);
      const Point& p = points[0];
      const std::vector<Point> pcs(points.begin() + 1, points.end());
      const Point pc = pcs.empty() ? Point() : pcs[0];
      collab_rows.push_back({b, s, p, pcs});
      std::vector<Baseline> found;
      std::string cells[4] = {"-", "-", "-", "-"};  // PyTorch seq/s, ORT seq/s, PyTorch CPU, ORT CPU
      int i = 0;
      for (auto* m : {&pytorch, &ort}) {
        auto it = m->find({b, s});
        if (it != m->end()) {
          found.push_back(it->second);
          cells[i] = Fmt("%.2f", it->second.seq_per_s);
          cells[i + 2] = Fmt("%.1f", it->second.cpu_ms_per_seq);
        }
        ++i;
      }
      std::string ratio = "-", cpu_ratio = "-";
      if (!found.empty()) {
        double best = 0, best_cpu = 1e300;
        for (const Baseline& x : found) {
          best = std::max(best, x.seq_per_s);
          best_cpu = std::min(best_cpu, x.cpu_ms_per_seq);
        }
        ratio = Fmt("%.2fx", p.seq_per_s / best);
        cpu_ratio = Fmt("%.2fx", best_cpu / p.cpu_ms_per_seq);
      }
      double gflops = ForwardFlops(info, b, s) * p.seq_per_s / b / 1e9;
      std::printf(row, std::to_string(b).c_str(), std::to_string(s).c_str(),
                  Fmt("%.2f", p.seq_per_s).c_str(), collab ? Fmt("%.2f", pc.seq_per_s).c_str() : "-",
                  cells[0].c_str(), cells[1].c_str(), ratio.c_str(), Fmt("%.1f", gflops).c_str(),
                  peak > 0 ? Fmt("%.0f%%", 100 * gflops / peak).c_str() : "-",
                  Fmt("%.1f", p.cpu_ms_per_seq).c_str(), cells[2].c_str(), cells[3].c_str(),
                  cpu_ratio.c_str(), Fmt("%.0f%%", 100 * p.cpu_util).c_str(),
                  std::to_string(p.times.size()).c_str());
      std::fflush(stdout);
      if (tsv) {
        std::fprintf(tsv, "%d\t%d\t%.4f\t%zu\t%.3f", b, s, p.seq_per_s, p.times.size(), p.cpu_ms_per_seq);
        for (const Point& c : pcs) std::fprintf(tsv, "\t%.4f", c.seq_per_s);
        std::fprintf(tsv, "\n");
        std::fflush(tsv);  // a run cut short (a time limit) keeps the rows it measured
      }
    }
  }
  if (tsv) std::fclose(tsv);
  if (!collabs.empty()) {
    std::printf("\nCollaborative models against the standard one (seq/s, same run, the models' runs alternating):\n");
    std::printf("%5s %5s | %9s", "batch", "seq", "standard");
    for (size_t i = 0; i < collabs.size(); ++i) {
      const auto& ranks = collabs[i]->info().collaborative_ranks;
      std::string head = "rank " + (ranks.empty() ? std::string("-") : std::to_string(ranks[0]));
      if (!collab_ways[i].empty()) head += " " + collab_ways[i];
      std::printf(" | %28s", head.c_str());
    }
    std::printf("\n");
    for (const CollabRow& r : collab_rows) {
      std::printf("%5d %5d | %9.2f", r.batch, r.seq, r.standard.seq_per_s);
      for (const Point& c : r.collab) {
        // The spread: the middle half of the rounds' own ratios (one run of each model a round).
        std::vector<double> ratios;
        for (size_t i = 0; i < std::min(c.times.size(), r.standard.times.size()); ++i) {
          ratios.push_back(r.standard.times[i] / c.times[i]);
        }
        std::sort(ratios.begin(), ratios.end());
        const size_t n = ratios.size();
        std::printf(" | %7.2f (%5.2fx, %4.2f-%4.2f)", c.seq_per_s, c.seq_per_s / r.standard.seq_per_s,
                    n > 0 ? ratios[n / 4] : 0.0, n > 0 ? ratios[n - 1 - n / 4] : 0.0);
      }
      std::printf("\n");
    }
    std::printf("(a-b): the middle half of the ratios of the two models' runs in the same round.\n");
  }
  getloadavg(loadavg, 1);
  std::printf("\nmedians of timed runs after one warm-up. vs best baseline = collabserve seq/s / max(PyTorch, ORT);"
              "\nGFLOP/s (the FLOPs collabserve computes: its last layer for [CLS] only, see ForwardFlops), %%peak"
              "\nand CPU%% for collabserve; CPU ms per seq = median process CPU time of a run /"
              "\nbatch (the work done, spinning threads included; less sensitive to other load than seq/s);"
              "\nCPU vs best baseline = min(PyTorch, ORT) CPU ms / collabserve CPU ms; CPU%% = CPU time / wall"
              "\ntime (100%% = one core busy). Load average %.2f at end.\n", loadavg[0]);
  return 0;
}

}  // namespace
}  // namespace collabserve::model

int main(int argc, char** argv) { return collabserve::model::Main(argc, argv); }
