#include "server/model/forward_graphs.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <glog/logging.h>

#include <chrono>
#include <map>
#include <set>
#include <stdexcept>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/model/bert.h"

// COLLABSERVE_WITH_CUDA: set by server/model/CMakeLists.txt where LibTorch was built with CUDA
// (its CUDA headers and libtorch_cuda are there); scripts/check-libtorch2.sh compiles this file
// both ways.
#if COLLABSERVE_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace collabserve::model {

BatchTensors MakeBatchTensors(absl::Span<const TokenizedInput* const> batch, int64_t rows,
                              int64_t length, bool masked, int64_t pad_token_id) {
  const int64_t B = static_cast<int64_t>(batch.size());
  BatchTensors t;
  t.packed = at::zeros({3, rows, length}, at::kLong);
  t.ids = t.packed[0].fill_(pad_token_id);
  t.types = t.packed[1];
  if (masked) t.mask = t.packed[2];
  auto ids = t.ids.accessor<int64_t, 2>();
  auto types = t.types.accessor<int64_t, 2>();
  for (int64_t b = 0; b < B; ++b) {
    const TokenizedInput& in = *batch[b];
    const int64_t n = static_cast<int64_t>(in.input_ids.size());
    for (int64_t s = 0; s < n; ++s) {
      ids[b][s] = in.input_ids[s];
      if (!in.token_type_ids.empty()) types[b][s] = in.token_type_ids[s];
    }
    if (masked) t.mask.select(0, b).narrow(0, 0, n).fill_(1);
  }
  // Rows past the batch: a one-token input of [PAD] (no row of only masked positions).
  if (masked && rows > B) t.mask.narrow(0, B, rows - B).select(1, 0).fill_(1);
  return t;
}

namespace {

int64_t PowerOfTwoAtLeast(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

}  // namespace

std::optional<GraphBucket> GraphBucketFor(int64_t batch, int64_t longest, bool ragged,
                                          int64_t max_positions, int64_t max_tokens) {
  if (max_tokens <= 0 || batch < 1 || longest < 1 || longest > max_positions) return std::nullopt;
  GraphBucket b;
  b.rows = PowerOfTwoAtLeast(batch);
  b.length = std::min(PowerOfTwoAtLeast(std::max<int64_t>(longest, 16)), max_positions);
  b.masked = ragged || b.length != longest;
  if (b.tokens() > max_tokens) return std::nullopt;
  return b;
}

std::vector<WarmUpPass> GraphWarmUpPasses(int64_t max_batch_size, int64_t max_length,
                                          int64_t max_positions, int64_t max_tokens) {
  std::vector<WarmUpPass> passes;
  if (max_batch_size < 1 || max_length < 1) return passes;
  std::set<GraphBucket> done;
  const int64_t max_rows = PowerOfTwoAtLeast(max_batch_size);
  for (int64_t rows = 1; rows <= max_rows; rows *= 2) {
    const int64_t n = std::min(rows, max_batch_size);  // rounds up to `rows`
    for (int64_t length = 16;; length *= 2) {
      const int64_t s = std::min(length, max_length);
      // The bucket of inputs of s tokens (no mask where s fills it), then of s - 1 (masked).
      for (const int64_t tokens : {s, s - 1}) {
        if (tokens < 1) continue;
        const auto bucket = GraphBucketFor(n, tokens, false, max_positions, max_tokens);
        if (bucket && done.insert(*bucket).second) passes.push_back({n, tokens});
      }
      if (length >= max_length) break;
    }
  }
  return passes;
}

std::optional<GraphBucket> ForwardGraphs::BucketFor(int64_t batch, int64_t longest, bool ragged) const {
  if (failed_.load(std::memory_order_relaxed)) return std::nullopt;
  return GraphBucketFor(batch, longest, ragged, model_.config().max_position_embeddings, max_tokens_);
}

#if COLLABSERVE_WITH_CUDA

bool ForwardGraphs::Supported() { return true; }

namespace {

// The engines' graph streams: one per live engine, never shared. c10's pool hands out 32 streams a
// device in turn, so a long-lived server's 33rd engine (every version loaded counts) would share
// one with its first, and a capture on it would take in the other engine's replays. Nor is a
// stream destroyed with its engine: cuBLAS keeps a workspace per (handle, stream) for the life of
// the process, so a stream a version load made and dropped would leave its workspaces behind. A
// stream goes back here, idle, and the next engine on its device takes it. Non-blocking: no
// implicit wait on the legacy default stream, where passes without a graph run.
class GraphStreams {
 public:
  static c10::cuda::CUDAStream Take(c10::DeviceIndex index) {
    {
      std::lock_guard<std::mutex> lock(state().mu);
      std::vector<cudaStream_t>& idle = state().idle[index];
      if (!idle.empty()) {
        cudaStream_t s = idle.back();
        idle.pop_back();
        return c10::cuda::getStreamFromExternal(s, index);
      }
    }
    c10::cuda::CUDAGuard on_device(index);
    cudaStream_t s = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return c10::cuda::getStreamFromExternal(s, index);
  }
  // `stream` (from Take) once nothing is queued on it.
  static void Give(const c10::cuda::CUDAStream& stream) {
    std::lock_guard<std::mutex> lock(state().mu);
    state().idle[stream.device_index()].push_back(stream.stream());
  }

 private:
  struct State {
    std::mutex mu;
    std::map<c10::DeviceIndex, std::vector<cudaStream_t>> idle;  // by device, guarded by mu
  };
  static State& state() {
    static State* s = new State;  // never destroyed: engines may outlive static destruction
    return *s;
  }
};

// One capture at a time in the process: a capture's device synchronisation (below) would
// invalidate another thread's capture in progress (CUDA refuses it while a stream captures, in
// every capture mode), and two engines may warm up at once (--num_load_threads).
std::mutex& CaptureMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}

}  // namespace

struct ForwardGraphs::Device {
  explicit Device(c10::DeviceIndex i)
      : index(i), stream(GraphStreams::Take(i)), pool(at::cuda::graph_pool_handle()) {}
  ~Device() {
    try {
      stream.synchronize();
      GraphStreams::Give(stream);
    } catch (const std::exception& e) {  // a destructor does not throw; the stream is not lent again
      LOG(ERROR) << "the CUDA graphs' stream failed: " << e.what();
    }
  }
  c10::DeviceIndex index;  // the model's device ("cuda" without one: the current device)
  c10::cuda::CUDAStream stream;
  at::cuda::MempoolId_t pool;
};

// A captured pass: its inputs, which each replay's are copied into, and its output, which each
// replay overwrites. The graph is destroyed first (members in reverse order), then the tensors it
// used.
struct ForwardGraphs::Graph {
  at::Tensor packed, ids, types, mask;  // BatchTensors' layout, on the device
  at::Tensor logits;  // float32 [rows, num_labels], in the graphs' pool
  std::unique_ptr<at::cuda::CUDAGraph> graph;
};

ForwardGraphs::ForwardGraphs(const BertClassifier& model, int64_t max_tokens)
    : model_(model), max_tokens_(max_tokens) {
  if (!model.device().is_cuda()) throw std::invalid_argument("ForwardGraphs: the model is not on a CUDA device");
  device_ = std::make_unique<Device>(model.device().has_index() ? model.device().index()
                                                                 : c10::cuda::current_device());
}

ForwardGraphs::~ForwardGraphs() {
  std::lock_guard<std::mutex> lock(mu_);
  // Not while another engine captures: LibTorch 2.4 to 2.8 register every graph with the device's
  // default random generator as its capture begins and unregister it as it is destroyed, in a set
  // no lock guards (the last one out also frees the generator's graph-side state), so an engine
  // unloaded while another warms up on the same device raced with that capture. Same lock order as
  // Logits (mu_, then CaptureMutex).
  std::lock_guard<std::mutex> no_capture(CaptureMutex());
  try {
    if (!graphs_.empty()) device_->stream.synchronize();
  } catch (const std::exception& e) {  // a destructor does not throw
    LOG(ERROR) << "the CUDA graphs' stream failed before they were destroyed: " << e.what();
  }
  graphs_.clear();
}

int64_t ForwardGraphs::captured() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const auto& [bucket, g] : graphs_) n += g != nullptr;
  return n;
}

at::Tensor ForwardGraphs::Logits(const GraphBucket& bucket, const BatchTensors& in) {
  // The graphs' inputs are inference tensors, written in place by every replay: whatever the
  // caller's mode.
  c10::InferenceMode inference;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.load()) {
      c10::cuda::CUDAStreamGuard on_stream(device_->stream);
      std::unique_ptr<Graph>& slot = graphs_[bucket];
      if (slot == nullptr) {
        slot = Capture(bucket, in);
      } else {
        slot->packed.copy_(in.packed);
      }
      if (slot != nullptr) {
        slot->graph->replay();
        return slot->logits.to(at::kCPU);  // waits for the replay
      }
      graphs_.erase(bucket);
    }
  }
  // Graphs are off (this capture, or an earlier one, failed): the pass as without them, on the
  // thread's own stream.
  return model_.Forward(in.ids, in.types, in.mask);
}

void ForwardGraphs::EndFailedCapture(Graph& g) {
  // CUDAGraph::capture_end checks the stream's capture first and throws when it was invalidated,
  // before it tells the caching allocator that the capture is over: the allocator would go on
  // routing this stream's allocations to the graphs' pool and, while a capture is on record,
  // would not free its cached blocks when an allocation runs out of memory (for every engine on
  // the device). Nor would the graph give back its hold on the pool (it does for a capture that
  // ended), whose memory would then stay reserved after the engine is gone. So: the stream's
  // capture ended (when capture_end has not), then the allocator's, and the hold given back.
  // Left as capture_end leaves them: newer LibTorch's pinned host allocator, which also keeps a
  // capture on record (nothing here allocates pinned memory), and in LibTorch 2.4 to 2.8 the
  // default random generator's capture state, under which a random op on the device throws until a
  // capture ends (nothing here draws random numbers on a GPU).
  try {
    g.graph->capture_end();
  } catch (...) {
  }
  bool ended_here = false;
  try {
    c10::cuda::CUDACachingAllocator::endAllocateToPool(device_->index, device_->pool);
    ended_here = true;
  } catch (...) {  // capture_end got that far, or the capture never began
  }
  if (ended_here) {
    try {
      c10::cuda::CUDACachingAllocator::releasePool(device_->index, device_->pool);
    } catch (...) {
    }
  }
  g.graph.reset();
}

std::unique_ptr<ForwardGraphs::Graph> ForwardGraphs::Capture(const GraphBucket& bucket,
                                                             const BatchTensors& in) {
  std::lock_guard<std::mutex> one_capture(CaptureMutex());
  const auto start = std::chrono::steady_clock::now();
  auto g = std::make_unique<Graph>();
  try {
    g->packed = in.packed.to(model_.device());
    g->ids = g->packed[0];
    g->types = g->packed[1];
    if (bucket.masked) g->mask = g->packed[2];
    // The parameters were written on other streams (loading); this stream has not waited for
    // them. Then the captured pass once on this stream before capturing: cuBLAS makes its
    // handle's workspace for a stream on its first product there, nothing may be allocated outside
    // the graphs' pool during a capture, and every kernel is loaded (CUDA loads them lazily).
    c10::cuda::device_synchronize();
    model_.DeviceLogits(g->ids, g->types, g->mask).to(at::kFloat);
    device_->stream.synchronize();
    g->graph = std::make_unique<at::cuda::CUDAGraph>();
    try {
      // Thread-local: other threads' passes (buckets without a graph) go on meanwhile.
      g->graph->capture_begin(device_->pool, cudaStreamCaptureModeThreadLocal);
      g->logits = model_.DeviceLogits(g->ids, g->types, g->mask).to(at::kFloat);
      if (fault_ == CaptureFault::kThrow) throw std::runtime_error("a fault injected into the capture");
      if (fault_ == CaptureFault::kInvalidate) C10_CUDA_CHECK(cudaDeviceSynchronize());
    } catch (...) {
      EndFailedCapture(*g);
      throw;
    }
    try {
      g->graph->capture_end();
    } catch (...) {
      EndFailedCapture(*g);
      throw;
    }
  } catch (const std::exception& e) {
    failed_ = true;
    LOG(ERROR) << "capturing the CUDA graph of " << bucket.rows << " x " << bucket.length
               << (bucket.masked ? " masked" : "") << " passes failed; passes run without graphs from now on: "
               << e.what();
    return nullptr;
  }
  LOG(INFO) << "captured the CUDA graph of " << bucket.rows << " x " << bucket.length
            << (bucket.masked ? " masked" : "") << " passes in "
            << std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count()
            << " ms (" << graphs_.size() << " graphs)";
  return g;
}

#else  // !COLLABSERVE_WITH_CUDA

bool ForwardGraphs::Supported() { return false; }

struct ForwardGraphs::Device {};
struct ForwardGraphs::Graph {};

ForwardGraphs::ForwardGraphs(const BertClassifier& model, int64_t max_tokens)
    : model_(model), max_tokens_(max_tokens) {
  throw std::logic_error("ForwardGraphs: this build's LibTorch has no CUDA (ForwardGraphs::Supported())");
}

ForwardGraphs::~ForwardGraphs() = default;

int64_t ForwardGraphs::captured() const { return 0; }

at::Tensor ForwardGraphs::Logits(const GraphBucket&, const BatchTensors&) {
  throw std::logic_error("ForwardGraphs: this build's LibTorch has no CUDA");
}

#endif  // COLLABSERVE_WITH_CUDA

}  // namespace collabserve::model
