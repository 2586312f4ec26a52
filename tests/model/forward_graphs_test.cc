// The batch's input tensors and the buckets CUDA graphs run in (forward_graphs.h): the bucket
// rules; a batch padded to its bucket gives every input the logits of its unpadded pass (on the
// CPU here, as on any device: this is what makes a graph's padded pass correct); and, where there
// is a GPU (scripts/gpu-check.sh runs this test there), graph replays against eager passes:
// standard and collaborative, float32 and float16, a bucket replayed with new inputs, several
// buckets, passes from several threads, engines destroyed while others capture, and an engine
// with graphs against one without.
#include "server/model/forward_graphs.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "server/model/bert.h"
#include "server/model/checkpoint_maker.h"
#include "server/model/config.h"
#include "server/model/engine.h"
#include "tests/model/small_model.h"
#include "tests/testing/test_util.h"

namespace collabserve::model {
namespace {

using ::testing::HasSubstr;

TEST(GraphBucketTest, RoundsBatchAndLengthUpToPowersOfTwo) {
  struct Case {
    int64_t batch, longest;
    bool ragged;
    GraphBucket want;
  };
  const Case cases[] = {
      {1, 16, false, {1, 16, false}},    // exact: no mask
      {1, 13, false, {1, 16, true}},     // shorter than its bucket: masked
      {1, 1, false, {1, 16, true}},      // at least 16 positions
      {3, 100, true, {4, 128, true}},
      {8, 128, true, {8, 128, true}},    // inputs of several lengths: masked
      {5, 64, false, {8, 64, false}},    // extra rows need no mask
      {8, 512, false, {8, 512, false}},  // 4096 tokens: the limit
      {128, 32, false, {128, 32, false}},
  };
  for (const Case& c : cases) {
    const auto b = GraphBucketFor(c.batch, c.longest, c.ragged, 512, 4096);
    ASSERT_TRUE(b.has_value()) << c.batch << " x " << c.longest;
    EXPECT_EQ(*b, c.want) << c.batch << " x " << c.longest << ": got " << b->rows << " x " << b->length
                          << (b->masked ? " masked" : "");
  }
  // A model of 384 positions: 300 tokens round up to 384, not 512.
  EXPECT_EQ(*GraphBucketFor(1, 300, false, 384, 4096), (GraphBucket{1, 384, true}));
  EXPECT_EQ(*GraphBucketFor(1, 384, false, 384, 4096), (GraphBucket{1, 384, false}));
}

TEST(GraphBucketTest, NoBucketAboveTheTokenLimitOrForBadShapes) {
  EXPECT_FALSE(GraphBucketFor(9, 512, false, 512, 4096));   // 16 x 512
  EXPECT_FALSE(GraphBucketFor(1, 257, false, 512, 256));    // 512 tokens padded
  EXPECT_FALSE(GraphBucketFor(1, 16, false, 512, 0));       // graphs off
  EXPECT_FALSE(GraphBucketFor(0, 16, false, 512, 4096));    // no input
  EXPECT_FALSE(GraphBucketFor(1, 0, false, 512, 4096));
  EXPECT_FALSE(GraphBucketFor(1, 513, false, 512, 4096));   // longer than the model takes
  EXPECT_TRUE(GraphBucketFor(1, 256, false, 512, 256));
}

// The warm-up passes reach every bucket a batch of up to max_batch_size inputs can fall in (all
// lengths, one length or several), each once, within the batch and length limits.
TEST(GraphBucketTest, WarmUpPassesCoverEveryReachableBucketOnce) {
  struct Case {
    int64_t max_batch, max_length, max_positions, max_tokens;
  };
  for (const Case& c : {Case{8, 512, 512, 4096}, Case{20, 384, 512, 4096}, Case{3, 300, 384, 2048},
                        Case{1, 8, 8, 4096}, Case{32, 512, 512, 256}, Case{32, 512, 512, 0}}) {
    const std::string what = "max batch " + std::to_string(c.max_batch) + ", max length " +
                             std::to_string(c.max_length) + ", " + std::to_string(c.max_tokens) + " tokens";
    std::set<GraphBucket> reachable;
    for (int64_t n = 1; n <= c.max_batch; ++n) {
      for (int64_t s = 1; s <= c.max_length; ++s) {
        for (bool ragged : {false, true}) {
          if (ragged && (n < 2 || s < 2)) continue;
          if (auto b = GraphBucketFor(n, s, ragged, c.max_positions, c.max_tokens)) reachable.insert(*b);
        }
      }
    }
    std::set<GraphBucket> warmed;
    for (const WarmUpPass& p : GraphWarmUpPasses(c.max_batch, c.max_length, c.max_positions, c.max_tokens)) {
      EXPECT_GE(p.inputs, 1) << what;
      EXPECT_LE(p.inputs, c.max_batch) << what;
      EXPECT_GE(p.tokens, 1) << what;
      EXPECT_LE(p.tokens, c.max_length) << what;
      const auto b = GraphBucketFor(p.inputs, p.tokens, false, c.max_positions, c.max_tokens);
      ASSERT_TRUE(b.has_value()) << what;
      EXPECT_TRUE(warmed.insert(*b).second) << what << ": bucket " << b->rows << " x " << b->length
                                            << (b->masked ? " masked" : "") << " twice";
    }
    EXPECT_EQ(warmed.size(), reachable.size()) << what;
    EXPECT_TRUE(warmed == reachable) << what;
    if (c.max_tokens == 0) {
      EXPECT_TRUE(warmed.empty());
    }
  }
  // BERT-base served with batches of up to 32: 33 shapes, with and without the mask.
  EXPECT_EQ(GraphWarmUpPasses(32, 512, 512, 4096).size(), 66u);
}

std::vector<TokenizedInput> Inputs(const std::vector<int>& lengths, int seed) {
  std::vector<TokenizedInput> out;
  for (size_t i = 0; i < lengths.size(); ++i) {
    TokenizedInput in;
    for (int s = 0; s < lengths[i]; ++s) {
      in.input_ids.push_back(1000 + (seed * 131 + static_cast<int>(i) * 37 + s * 11) % 1900);
      in.token_type_ids.push_back(s >= lengths[i] / 2 ? 1 : 0);
    }
    out.push_back(std::move(in));
  }
  return out;
}

std::vector<const TokenizedInput*> Ptrs(const std::vector<TokenizedInput>& v) {
  std::vector<const TokenizedInput*> p;
  for (const auto& x : v) p.push_back(&x);
  return p;
}

TEST(MakeBatchTensorsTest, PadsRowsAndPositionsAndMasksThem) {
  const auto batch = Inputs({3, 5}, 1);
  const BatchTensors t = MakeBatchTensors(Ptrs(batch), 4, 8, /*masked=*/true, /*pad_token_id=*/7);
  ASSERT_EQ(t.ids.sizes(), (std::vector<int64_t>{4, 8}));
  ASSERT_EQ(t.types.sizes(), (std::vector<int64_t>{4, 8}));
  ASSERT_EQ(t.mask.sizes(), (std::vector<int64_t>{4, 8}));
  for (int64_t b = 0; b < 4; ++b) {
    const int64_t n = b < 2 ? static_cast<int64_t>(batch[b].input_ids.size()) : 0;
    for (int64_t s = 0; s < 8; ++s) {
      const std::string at = "row " + std::to_string(b) + ", position " + std::to_string(s);
      EXPECT_EQ(t.ids[b][s].item<int64_t>(), s < n ? batch[b].input_ids[s] : 7) << at;
      EXPECT_EQ(t.types[b][s].item<int64_t>(), s < n ? batch[b].token_type_ids[s] : 0) << at;
      // Rows past the batch: a one-token input, so that no row is masked everywhere.
      EXPECT_EQ(t.mask[b][s].item<int64_t>(), (s < n || (b >= 2 && s == 0)) ? 1 : 0) << at;
    }
  }
  const BatchTensors u = MakeBatchTensors(Ptrs(Inputs({4, 4}, 2)), 2, 4, /*masked=*/false, 0);
  EXPECT_FALSE(u.mask.defined());
  EXPECT_EQ(u.ids.sizes(), (std::vector<int64_t>{2, 4}));
}

std::unique_ptr<BertClassifier> SmallModel(std::vector<int> ranks, const c10::Device& device,
                                           at::ScalarType dtype) {
  return SmallBertModel(std::move(ranks), 3, 5, device, dtype);
}

// The shape of a batch as Engine::Run pads it: inputs, longest input, whether lengths differ.
struct Shape {
  int64_t batch = 0, longest = 0;
  bool ragged = false;
};
Shape ShapeOf(const std::vector<TokenizedInput>& batch) {
  Shape s;
  s.batch = static_cast<int64_t>(batch.size());
  for (const auto& in : batch) {
    const int64_t n = static_cast<int64_t>(in.input_ids.size());
    if (s.longest != 0 && n != s.longest) s.ragged = true;
    s.longest = std::max(s.longest, n);
  }
  return s;
}

// The batches the tests run: exact buckets, shorter inputs, inputs of several lengths, rows
// rounded up.
const std::vector<std::vector<int>> kBatches = {{16}, {9}, {16, 16}, {5, 16, 11}, {32, 20, 32, 32, 7}, {40}};

// The bucket's pass gives each input the logits of the batch's own pass: padding rows and
// positions changes nothing but rounding.
TEST(ForwardGraphsTest, PaddedToItsBucketEveryInputKeepsItsLogits) {
  for (const std::vector<int>& ranks : {std::vector<int>{}, std::vector<int>{24, 0}, std::vector<int>{20, 12}}) {
    auto m = SmallModel(ranks, c10::Device(c10::kCPU), at::kFloat);
    c10::InferenceMode guard;
    for (size_t i = 0; i < kBatches.size(); ++i) {
      const auto batch = Inputs(kBatches[i], static_cast<int>(i));
      const auto ptrs = Ptrs(batch);
      const auto [B, S, ragged] = ShapeOf(batch);
      const auto bucket = GraphBucketFor(B, S, ragged, 64, 4096);
      ASSERT_TRUE(bucket.has_value());
      const BatchTensors own = MakeBatchTensors(ptrs, B, S, ragged, 0);
      const BatchTensors padded = MakeBatchTensors(ptrs, bucket->rows, bucket->length, bucket->masked, 0);
      const at::Tensor want = m->Forward(own.ids, own.types, own.mask);
      const at::Tensor got = m->Forward(padded.ids, padded.types, padded.mask);
      ASSERT_EQ(got.size(0), bucket->rows);
      EXPECT_TRUE(at::allclose(got.narrow(0, 0, B), want, 1e-4, 1e-5))
          << "ranks " << ranks.size() << ", batch " << i << ": max |diff| "
          << (got.narrow(0, 0, B) - want).abs().max().item<float>();
    }
  }
}

TEST(ForwardGraphsTest, NoGraphsOnTheCpu) {
  testing::TempDir dir;
  ASSERT_TRUE(MakeCheckpoint(dir.path(), MakeOptions{}).ok());
  auto e = Engine::Load(dir.path());
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_TRUE((*e)->WarmUpGraphs(8).ok());
  EXPECT_EQ((*e)->cuda_graphs(), 0);
}

TEST(ForwardGraphsTest, EngineRejectsANegativeTokenLimit) {
  testing::TempDir dir;
  ASSERT_TRUE(MakeCheckpoint(dir.path(), MakeOptions{}).ok());
  EngineOptions o;
  o.cuda_graph_max_tokens = -1;
  auto e = Engine::Load(dir.path(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(e.status().message()), HasSubstr("cuda_graph_max_tokens"));
}

// ---- With a GPU ----

#define REQUIRE_CUDA_GRAPHS()                                                              \
  do {                                                                                     \
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device (scripts/gpu-check.sh runs this)"; \
    ASSERT_TRUE(ForwardGraphs::Supported()) << "a CUDA LibTorch, but built without COLLABSERVE_WITH_CUDA"; \
  } while (0)

// Graph replays equal eager passes over the same tensors (the same kernels: float32 within 1e-5,
// float16 within 1e-2), for every bucket and for a bucket replayed with other inputs; one graph
// per bucket.
TEST(ForwardGraphsTest, ReplaysEqualEagerPassesOnCuda) {
  REQUIRE_CUDA_GRAPHS();
  for (at::ScalarType dtype : {at::kFloat, at::kHalf}) {
    for (const std::vector<int>& ranks : {std::vector<int>{}, std::vector<int>{24, 0}, std::vector<int>{20, 12}}) {
      auto m = SmallModel(ranks, c10::Device(c10::kCUDA), dtype);
      const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;
      c10::InferenceMode guard;
      ForwardGraphs graphs(*m, 4096);
      std::vector<GraphBucket> seen;
      for (int round = 0; round < 2; ++round) {
        for (size_t i = 0; i < kBatches.size(); ++i) {
          // The second round replays every bucket with other token ids.
          const auto batch = Inputs(kBatches[i], static_cast<int>(i + 10 * round));
          const auto ptrs = Ptrs(batch);
          const auto [B, S, ragged] = ShapeOf(batch);
          const auto bucket = graphs.BucketFor(B, S, ragged);
          ASSERT_TRUE(bucket.has_value());
          if (std::find(seen.begin(), seen.end(), *bucket) == seen.end()) seen.push_back(*bucket);
          const BatchTensors in = MakeBatchTensors(ptrs, bucket->rows, bucket->length, bucket->masked, 0);
          const at::Tensor got = graphs.Logits(*bucket, in);
          const at::Tensor want = m->Forward(in.ids, in.types, in.mask);
          const std::string what = std::string(c10::toString(dtype)) + ", ranks " + std::to_string(ranks.size()) +
                                   ", batch " + std::to_string(i) + ", round " + std::to_string(round);
          ASSERT_EQ(got.sizes(), want.sizes()) << what;
          EXPECT_EQ(got.device().type(), c10::kCPU) << what;
          EXPECT_EQ(got.scalar_type(), at::kFloat) << what;
          EXPECT_TRUE(at::allclose(got, want, 0, tol))
              << what << ": max |diff| " << (got - want).abs().max().item<float>();
        }
        EXPECT_EQ(graphs.captured(), static_cast<int64_t>(seen.size()));  // none failed, none twice
      }
    }
  }
}

// Passes from several threads, each with its own inputs, through the same graphs (and one bucket
// above the limit, without a graph, beside them): each gets its own inputs' logits.
TEST(ForwardGraphsTest, ConcurrentPassesGetTheirOwnLogitsOnCuda) {
  REQUIRE_CUDA_GRAPHS();
  auto m = SmallModel({24, 0}, c10::Device(c10::kCUDA), at::kFloat);
  ForwardGraphs graphs(*m, 64);
  constexpr int kThreads = 4, kPasses = 25;
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      c10::InferenceMode guard;
      for (int p = 0; p < kPasses; ++p) {
        // Buckets at a limit of 64 tokens: 1 x 16; 1 x 16 masked; none (5 x 14 rounds to 8 x 16);
        // 1 x 64 masked.
        const int len = t == 3 ? 40 : 16 - t;
        const auto batch = Inputs(t == 2 ? std::vector<int>{len, len, len, len, len} : std::vector<int>{len}, 100 * t + p);
        const auto ptrs = Ptrs(batch);
        const int64_t B = static_cast<int64_t>(batch.size());
        const auto bucket = graphs.BucketFor(B, len, false);
        at::Tensor got, want;
        if (bucket) {
          const BatchTensors in = MakeBatchTensors(ptrs, bucket->rows, bucket->length, bucket->masked, 0);
          got = graphs.Logits(*bucket, in).narrow(0, 0, B);
        } else {
          const BatchTensors in = MakeBatchTensors(ptrs, B, len, false, 0);
          got = m->Forward(in.ids, in.types, in.mask);
        }
        const BatchTensors own = MakeBatchTensors(ptrs, B, len, false, 0);
        want = m->Forward(own.ids, own.types, own.mask);
        if (!at::allclose(got, want, 1e-4, 1e-5)) {
          errors[t] = "thread " + std::to_string(t) + ", pass " + std::to_string(p) + ": max |diff| " +
                      std::to_string((got - want).abs().max().item<float>());
          return;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& e : errors) EXPECT_EQ(e, "");
  // Thread 2's 5 x 14 rounds to 8 x 16 = 128 tokens, over the limit of 64: no graph for it.
  EXPECT_EQ(graphs.captured(), 3);
}

// Two engines capture at the same time (servables warming up together) while a third thread runs
// eager passes: every capture succeeds and every replay gives its own model's logits.
TEST(ForwardGraphsTest, TwoEnginesCaptureAtOnceOnCuda) {
  REQUIRE_CUDA_GRAPHS();
  std::vector<std::unique_ptr<BertClassifier>> models;
  models.push_back(SmallModel({}, c10::Device(c10::kCUDA), at::kFloat));
  models.push_back(SmallModel({20, 12}, c10::Device(c10::kCUDA), at::kFloat));
  std::vector<std::unique_ptr<ForwardGraphs>> graphs;
  for (const auto& m : models) graphs.push_back(std::make_unique<ForwardGraphs>(*m, 4096));
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      c10::InferenceMode guard;
      const BertClassifier& m = *models[t % 2];
      for (int round = 0; round < 2; ++round) {
        for (size_t i = 0; i < kBatches.size(); ++i) {
          const auto batch = Inputs(kBatches[i], static_cast<int>(100 * t + i + 10 * round));
          const auto ptrs = Ptrs(batch);
          const auto [B, S, ragged] = ShapeOf(batch);
          const auto bucket = graphs[0]->BucketFor(B, S, ragged);
          if (!bucket) {
            errors[t] = "batch " + std::to_string(i) + " has no bucket";
            return;
          }
          const BatchTensors in = MakeBatchTensors(ptrs, bucket->rows, bucket->length, bucket->masked, 0);
          const at::Tensor want = m.Forward(in.ids, in.types, in.mask);
          // Threads 0 and 1 through their model's graphs; thread 2 eagerly, beside them.
          const at::Tensor got = t < 2 ? graphs[t]->Logits(*bucket, in) : m.Forward(in.ids, in.types, in.mask);
          if (!at::allclose(got, want, 0, 1e-5)) {
            errors[t] = "thread " + std::to_string(t) + ", batch " + std::to_string(i) + ": max |diff| " +
                        std::to_string((got - want).abs().max().item<float>());
            return;
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_EQ(graphs[0]->captured(), graphs[1]->captured());
  EXPECT_GT(graphs[0]->captured(), 0);
  EXPECT_TRUE(graphs[0]->BucketFor(1, 16, false).has_value()) << "a capture failed: graphs are off";
  EXPECT_TRUE(graphs[1]->BucketFor(1, 16, false).has_value()) << "a capture failed: graphs are off";
}

// Engines come and go while others capture (a version unloaded while the next one warms up):
// each thread makes graphs of its own model, captures every bucket, checks the replays and destroys
// them, six times over, beside the other. Every capture succeeds and every replay gives its model's
// logits. (LibTorch 2.4 to 2.8 register a graph with the device's random generator as its capture
// begins and unregister it as it is destroyed, unguarded: ~ForwardGraphs holds the capture lock.)
TEST(ForwardGraphsTest, EnginesDestroyedWhileOthersCaptureOnCuda) {
  REQUIRE_CUDA_GRAPHS();
  std::vector<std::unique_ptr<BertClassifier>> models;
  models.push_back(SmallModel({}, c10::Device(c10::kCUDA), at::kFloat));
  models.push_back(SmallModel({20, 12}, c10::Device(c10::kCUDA), at::kFloat));
  constexpr int kRounds = 6;
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      c10::InferenceMode guard;
      const BertClassifier& m = *models[t];
      for (int round = 0; round < kRounds; ++round) {
        ForwardGraphs graphs(m, 4096);
        std::set<GraphBucket> buckets;
        for (size_t i = 0; i < kBatches.size(); ++i) {
          const auto batch = Inputs(kBatches[i], static_cast<int>(100 * t + 10 * round + i));
          const auto ptrs = Ptrs(batch);
          const auto [B, S, ragged] = ShapeOf(batch);
          const auto bucket = graphs.BucketFor(B, S, ragged);
          const std::string what = "thread " + std::to_string(t) + ", round " + std::to_string(round) +
                                   ", batch " + std::to_string(i);
          if (!bucket) {
            errors[t] = what + ": no bucket (a capture failed: graphs are off)";
            return;
          }
          buckets.insert(*bucket);
          const BatchTensors in = MakeBatchTensors(ptrs, bucket->rows, bucket->length, bucket->masked, 0);
          const at::Tensor got = graphs.Logits(*bucket, in);
          const at::Tensor want = m.Forward(in.ids, in.types, in.mask);
          if (!at::allclose(got, want, 0, 1e-5)) {
            errors[t] = what + ": max |diff| " + std::to_string((got - want).abs().max().item<float>());
            return;
          }
        }
        if (graphs.captured() != static_cast<int64_t>(buckets.size())) {
          errors[t] = "thread " + std::to_string(t) + ", round " + std::to_string(round) + ": " +
                      std::to_string(graphs.captured()) + " graphs captured of " + std::to_string(buckets.size());
          return;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

// The engine with graphs (the default on CUDA) against one without: the same predictions.
TEST(ForwardGraphsTest, EngineWithGraphsMatchesEngineWithoutOnCuda) {
  REQUIRE_CUDA_GRAPHS();
  testing::TempDir dir;
  MakeOptions mo;
  mo.preset = "mini";
  ASSERT_TRUE(MakeCheckpoint(dir.path(), mo).ok());
  EngineOptions with, without;
  with.device = without.device = "cuda";
  without.cuda_graph_max_tokens = 0;
  auto a = Engine::Load(dir.path(), with);
  auto b = Engine::Load(dir.path(), without);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  // The warm-up captures a graph for every bucket of up to 8 inputs: the passes after it capture
  // none.
  ASSERT_TRUE((*a)->WarmUpGraphs(8).ok());
  const int64_t warmed = (*a)->cuda_graphs();
  EXPECT_EQ(warmed, static_cast<int64_t>(GraphWarmUpPasses(8, (*a)->info().max_length, 512, 4096).size()));
  EXPECT_TRUE((*b)->WarmUpGraphs(8).ok());
  EXPECT_EQ((*b)->cuda_graphs(), 0);
  for (size_t i = 0; i < kBatches.size(); ++i) {
    for (int round = 0; round < 2; ++round) {
      const auto batch = Inputs(kBatches[i], static_cast<int>(i + 10 * round));
      auto x = (*a)->Run(batch);
      auto y = (*b)->Run(batch);
      ASSERT_TRUE(x.ok()) << x.status();
      ASSERT_TRUE(y.ok()) << y.status();
      ASSERT_EQ(x->size(), batch.size());
      for (size_t r = 0; r < batch.size(); ++r) {
        EXPECT_EQ((*x)[r].label, (*y)[r].label) << "batch " << i << ", input " << r;
        for (size_t k = 0; k < (*x)[r].logits.size(); ++k) {
          EXPECT_NEAR((*x)[r].logits[k], (*y)[r].logits[k], 1e-4) << "batch " << i << ", input " << r;
        }
      }
    }
  }
  EXPECT_EQ((*a)->cuda_graphs(), warmed);
}

// A capture that fails (an exception inside it; a call CUDA forbids while capturing) gives that
// pass's logits without a graph and turns graphs off for its engine, and leaves the device as it
// was: another engine on the same model then captures and replays as usual. Last in this file, so
// that a failure that left the device in a bad state could not fail the tests above.
TEST(ForwardGraphsTest, AFailedCaptureLeavesEagerPassesAndOtherGraphsWorkingOnCuda) {
  REQUIRE_CUDA_GRAPHS();
  auto m = SmallModel({24, 0}, c10::Device(c10::kCUDA), at::kFloat);
  c10::InferenceMode guard;
  const auto batch = Inputs(kBatches[0], 7);
  const auto ptrs = Ptrs(batch);
  const auto [B, S, ragged] = ShapeOf(batch);
  for (auto fault : {ForwardGraphs::CaptureFault::kThrow, ForwardGraphs::CaptureFault::kInvalidate}) {
    const std::string what = fault == ForwardGraphs::CaptureFault::kThrow ? "an exception" : "an invalidated capture";
    {
      ForwardGraphs failing(*m, 4096);
      failing.SetCaptureFaultForTesting(fault);
      const auto bucket = failing.BucketFor(B, S, ragged);
      ASSERT_TRUE(bucket.has_value()) << what;
      const BatchTensors in = MakeBatchTensors(ptrs, bucket->rows, bucket->length, bucket->masked, 0);
      const at::Tensor got = failing.Logits(*bucket, in);
      const at::Tensor want = m->Forward(in.ids, in.types, in.mask);
      EXPECT_TRUE(at::allclose(got.to(at::kCPU), want, 0, 1e-5)) << what;
      EXPECT_EQ(failing.captured(), 0) << what;
      EXPECT_FALSE(failing.BucketFor(B, S, ragged).has_value()) << what << ": graphs still on";
    }
    ForwardGraphs working(*m, 4096);
    for (int round = 0; round < 2; ++round) {
      const auto other = Inputs(kBatches[0], 20 + round);
      const auto other_ptrs = Ptrs(other);
      const auto bucket = working.BucketFor(B, S, ragged);
      ASSERT_TRUE(bucket.has_value()) << what;
      const BatchTensors in = MakeBatchTensors(other_ptrs, bucket->rows, bucket->length, bucket->masked, 0);
      EXPECT_TRUE(at::allclose(working.Logits(*bucket, in), m->Forward(in.ids, in.types, in.mask), 0, 1e-5))
          << what << ", round " << round;
    }
    EXPECT_EQ(working.captured(), 1) << what;
  }
}

}  // namespace
}  // namespace collabserve::model
