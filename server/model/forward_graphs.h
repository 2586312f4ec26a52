// A batch as the forward pass's input tensors, and CUDA graphs of the pass.
//
// A small pass on a GPU is bound by its launches, not by the device: BERT-base's pass dispatches
// ~100 ATen operators, and on the H200 machine both this engine and PyTorch eager spent 2.6-3.3 ms
// a float16 pass launching them whatever the batch, from 1 × 16 up to 8 × 512 tokens
// (bench/engine/RESULTS.md, 2026-12-04). A CUDA graph captures the pass's kernels once and replays
// them with one launch.
//
// A graph fixes its shapes, so passes run in buckets: the batch rounded up to a power of two, the
// length to a power of two from 16 (at most the model's max_position_embeddings), with the padding
// mask or without it. A batch runs in its bucket padded: extra rows of [PAD] tokens (their logits
// dropped), extra positions masked. Every input's logits equal those of its unpadded pass up to
// rounding (other product shapes). Only buckets of at most max_tokens tokens get a graph: above,
// a pass is bound by the GPU's arithmetic, its launches hide behind it, and padding would only cost.
#ifndef COLLABSERVE_SERVER_MODEL_FORWARD_GRAPHS_H_
#define COLLABSERVE_SERVER_MODEL_FORWARD_GRAPHS_H_

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "absl/types/span.h"
#include "server/model/engine.h"

namespace collabserve::model {

class BertClassifier;

// The forward pass's inputs, int64 [rows, length] CPU tensors: token ids ([PAD] after each input's
// end and in rows past the batch), token types, and the attention mask (1 on every input's tokens
// and on the first position of the rows past the batch; undefined when `masked` is false). All
// three are views of `packed` [3, rows, length], so that a graph's inputs take one copy to the
// device.
struct BatchTensors {
  at::Tensor packed;
  at::Tensor ids, types, mask;
};

// The batch's inputs in rows [0, batch.size()) of a [rows, length] pass. Requires rows >=
// batch.size() and length >= every input's length, which the caller has validated (Engine::Run's
// checks); `masked` must be true when an input is shorter than `length`.
BatchTensors MakeBatchTensors(absl::Span<const TokenizedInput* const> batch, int64_t rows,
                              int64_t length, bool masked, int64_t pad_token_id);

// The shape a graph is captured for.
struct GraphBucket {
  int64_t rows = 0;    // the batch rounded up to a power of two
  int64_t length = 0;  // the longest input rounded up to a power of two, at least 16
  bool masked = false;  // a padding mask: inputs of several lengths, or shorter than `length`
  int64_t tokens() const { return rows * length; }
  bool operator<(const GraphBucket& o) const {
    return std::tie(rows, length, masked) < std::tie(o.rows, o.length, o.masked);
  }
  bool operator==(const GraphBucket& o) const {
    return rows == o.rows && length == o.length && masked == o.masked;
  }
};

// The bucket of a batch of `batch` inputs whose longest has `longest` tokens (`ragged`: not all of
// that length), for a model taking at most `max_positions` tokens; nullopt when its pass would
// cover more than max_tokens tokens (or max_tokens is 0, or the inputs are empty or too long).
std::optional<GraphBucket> GraphBucketFor(int64_t batch, int64_t longest, bool ragged,
                                          int64_t max_positions, int64_t max_tokens);

// One pass for each bucket that a batch of up to max_batch_size inputs of up to max_length tokens
// can fall in (GraphBucketFor with the other arguments): `inputs` inputs of `tokens` tokens each.
// What a server runs at load so that no request waits for a capture.
struct WarmUpPass {
  int64_t inputs = 0, tokens = 0;
};
std::vector<WarmUpPass> GraphWarmUpPasses(int64_t max_batch_size, int64_t max_length,
                                          int64_t max_positions, int64_t max_tokens);

// CUDA graphs of one classifier's DeviceLogits, one per bucket, captured on a bucket's first pass
// and replayed after. Their intermediate tensors share one memory pool (the largest bucket's
// pass); one replay runs at a time (replays share that memory), on a stream of their own, while
// passes without a graph run beside them as before. Thread-safe.
class ForwardGraphs {
 public:
  // Whether this build can capture graphs: LibTorch built with CUDA.
  static bool Supported();

  // model: prepared on a CUDA device; outlives this. max_tokens as in GraphBucketFor.
  ForwardGraphs(const BertClassifier& model, int64_t max_tokens);
  ~ForwardGraphs();
  ForwardGraphs(const ForwardGraphs&) = delete;
  ForwardGraphs& operator=(const ForwardGraphs&) = delete;

  // GraphBucketFor with this model's limits; nullopt too once a capture has failed (every pass
  // then runs without graphs; the failure is logged).
  std::optional<GraphBucket> BucketFor(int64_t batch, int64_t longest, bool ragged) const;

  // The logits, float32 [bucket.rows, num_labels] on the CPU, of the pass over `in`
  // (MakeBatchTensors(.., bucket.rows, bucket.length, bucket.masked, ..)). Captures the bucket's
  // graph on its first pass. Throws what the pass throws; where the capture fails, runs this pass
  // without a graph and turns graphs off.
  at::Tensor Logits(const GraphBucket& bucket, const BatchTensors& in);

  // Graphs captured so far.
  int64_t captured() const;
  int64_t max_tokens() const { return max_tokens_; }

  // Tests of the failure path: every later capture fails, by an exception thrown inside it
  // (kThrow) or by a call CUDA forbids during a capture, which invalidates it (kInvalidate: a
  // device synchronisation).
  enum class CaptureFault { kNone, kThrow, kInvalidate };
  void SetCaptureFaultForTesting(CaptureFault fault) { fault_ = fault; }

 private:
  struct Graph;
  // The bucket's graph, its first replay's inputs `in` copied in; nullptr (failed_ set, logged)
  // where the capture fails. Under mu_, on the graphs' stream.
  std::unique_ptr<Graph> Capture(const GraphBucket& bucket, const BatchTensors& in);
  // After a capture failed: its stream's and the caching allocator's capture ended, its graph
  // destroyed. Under mu_.
  void EndFailedCapture(Graph& g);
  const BertClassifier& model_;
  const int64_t max_tokens_;
  std::atomic<bool> failed_{false};
  std::atomic<CaptureFault> fault_{CaptureFault::kNone};
  mutable std::mutex mu_;  // one capture or replay at a time
  std::map<GraphBucket, std::unique_ptr<Graph>> graphs_;  // guarded by mu_
  struct Device;  // the stream and memory pool (CUDA builds)
  std::unique_ptr<Device> device_;
};

}  // namespace collabserve::model

#endif  // COLLABSERVE_SERVER_MODEL_FORWARD_GRAPHS_H_
