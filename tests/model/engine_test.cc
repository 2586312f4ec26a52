// Engine loading and running: every way a checkpoint directory can be wrong gets an error that
// names the file and the problem; predictions have the documented shape and semantics.
#include "server/model/engine.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/model/bert.h"
#include "server/model/checkpoint_maker.h"
#include "server/model/dense_ops.h"
#include "server/model/device.h"
#include "server/model/kernels.h"
#include "server/model/io/checkpoint.h"
#include "server/model/io/safetensors.h"
#include "server/model/param_counts.h"
#include "server/model/pass_arena.h"
#include "server/model/state_dict.h"
#include "server/model/torch_status.h"
#include "server/text/bert_tokenizer.h"
#include "server/util/status_macros.h"
#include "tests/testing/test_util.h"

namespace collabserve::model {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::TempDir;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MakeOptions o;
    o.label_names = {"neg", "pos", "mixed"};
    ASSERT_TRUE(MakeCheckpoint(dir_.path(), o).ok());
  }
  // The checkpoint loaded as served (packed where this CPU uses PackedLinear) and with its plain
  // weights (pack_weights = false).
  void LoadServedAndPlain(std::unique_ptr<Engine>* served, std::unique_ptr<Engine>* plain) {
    EngineOptions unpacked;
    unpacked.pack_weights = false;
    auto a = Engine::Load(dir_.path());
    auto b = Engine::Load(dir_.path(), unpacked);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    *served = std::move(*a);
    *plain = std::move(*b);
  }
  // Rewrites model.safetensors through `edit` (name → tensor map of float32 tensors).
  void EditWeights(const std::function<void(std::map<std::string, at::Tensor>&)>& edit) {
    auto ckpt = io::ReadCheckpointFile(dir_ / "model.safetensors");
    ASSERT_TRUE(ckpt.ok());
    std::map<std::string, at::Tensor> m;
    for (auto& [k, raw] : ckpt->tensors) m[k] = *RawToFloatTensor(raw, k);
    edit(m);
    std::vector<io::TensorToWrite> out;
    for (auto& [k, t] : m) {
      t = t.contiguous();
      out.push_back({k, io::DType::kF32, t.sizes().vec(), t.data_ptr()});
    }
    ASSERT_TRUE(io::WriteSafetensors(dir_ / "model.safetensors", out, {}).ok());
  }
  TempDir dir_;
};

TEST_F(EngineTest, LoadsAndDescribesTheModel) {
  auto engine = Engine::Load(dir_.path());
  ASSERT_TRUE(engine.ok()) << engine.status();
  const ModelInfo& info = (*engine)->info();
  EXPECT_EQ(info.labels, (std::vector<std::string>{"neg", "pos", "mixed"}));
  EXPECT_EQ(info.num_layers, 2);
  EXPECT_EQ(info.num_heads, 4);
  EXPECT_EQ(info.head_size, 16);
  EXPECT_EQ(info.max_length, 512);
  EXPECT_TRUE(info.collaborative_ranks.empty());
  EXPECT_EQ(info.device, "cpu");
  const ParamCounts& p = info.params;
  EXPECT_EQ(p.attention_qk, 2 * 2 * (64 * 64 + 64));
  EXPECT_EQ(p.total, p.embeddings + p.attention_qk + p.attention_vo + p.ffn + p.layer_norm + p.head);
  EXPECT_EQ(p.embeddings, (30522 + 512 + 2) * 64 + 2 * 64);
}

TEST_F(EngineTest, PredictionsAreDistributions) {
  auto engine = Engine::Load(dir_.path());
  ASSERT_TRUE(engine.ok());
  auto e = (*engine)->tokenizer().Encode("hello world", std::nullopt, 0, true);
  ASSERT_TRUE(e.ok());
  auto preds = (*engine)->Run(std::vector<TokenizedInput>{{e->input_ids, e->token_type_ids}});
  ASSERT_TRUE(preds.ok());
  const Prediction& p = (*preds)[0];
  ASSERT_EQ(p.logits.size(), 3u);
  float sum = 0;
  for (float x : p.probabilities) sum += x;
  EXPECT_NEAR(sum, 1.0, 1e-5);
  EXPECT_EQ(p.label, std::max_element(p.logits.begin(), p.logits.end()) - p.logits.begin());
}

// Whether the dense weights are packed for PackedLinear (where this CPU uses it) is a memory / speed
// trade only: the logits are the same.
TEST_F(EngineTest, UnpackedWeightsGiveTheSameLogits) {
  std::unique_ptr<Engine> a, b;
  ASSERT_NO_FATAL_FAILURE(LoadServedAndPlain(&a, &b));
  std::vector<TokenizedInput> inputs;
  for (const char* text : {"hello world", "a somewhat longer sentence about the weather today"}) {
    auto e = a->tokenizer().Encode(text, std::nullopt, 0, true);
    ASSERT_TRUE(e.ok());
    inputs.push_back({e->input_ids, e->token_type_ids});
  }
  auto pa = a->Run(inputs);
  auto pb = b->Run(inputs);
  ASSERT_TRUE(pa.ok() && pb.ok());
  for (size_t i = 0; i < inputs.size(); ++i) {
    ASSERT_EQ((*pa)[i].logits.size(), (*pb)[i].logits.size());
    for (size_t j = 0; j < (*pa)[i].logits.size(); ++j) {
      EXPECT_NEAR((*pa)[i].logits[j], (*pb)[i].logits[j], 1e-4) << "input " << i << " logit " << j;
    }
  }
}

// Each weight is held once. Served (packed where this CPU uses PackedLinear), the plain dense
// weights are released: the parameter counts are the model's all the same, and what would read
// the released tensors says so by name instead of reading empty ones. Unpacked, the query, key and
// value parameters are views of the fused projection, not copies.
TEST_F(EngineTest, WeightsAreHeldOnce) {
  std::unique_ptr<Engine> served, plain;
  ASSERT_NO_FATAL_FAILURE(LoadServedAndPlain(&served, &plain));
  const ParamCounts& a = served->info().params;
  const ParamCounts& b = plain->info().params;
  EXPECT_EQ(a.total, b.total);
  EXPECT_EQ(a.attention_qk, b.attention_qk);
  EXPECT_EQ(a.ffn, b.ffn);
  EXPECT_EQ(b.total, CountParams(plain->classifier()).total);
  const BertClassifier& m = plain->classifier();
  EXPECT_FALSE(m.weights_released());
  for (const EncoderLayer& l : m.layers()) {
    ASSERT_TRUE(l.fused.plain.defined());
    for (const at::Tensor* t : {&l.query_w, &l.key_w, &l.value_w}) {
      EXPECT_TRUE(t->storage().is_alias_of(l.fused.plain.storage()));
    }
  }
  const BertClassifier& s = served->classifier();
  if (!s.weights_released()) GTEST_SKIP() << "this CPU does not pack (no AVX-512F)";
  for (const EncoderLayer& l : s.layers()) {
    EXPECT_FALSE(l.fused.plain.defined());
    EXPECT_NE(l.fused.packed, nullptr);
    for (const at::Tensor* t : {&l.query_w, &l.key_w, &l.value_w, &l.attn_out_w, &l.inter_w, &l.out_w}) {
      EXPECT_EQ(t->numel(), 0);
    }
    EXPECT_GT(l.query_b.numel(), 0);  // biases and LayerNorms stay
  }
  TempDir out;
  absl::Status saved = SaveWeights(s, out.path(), WeightFormat::kSafetensors);
  EXPECT_EQ(saved.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(saved), HasSubstr("pack_weights = false"));
  EXPECT_FALSE(std::filesystem::exists(out / "model.safetensors"));
}

TEST_F(EngineTest, RejectsBadInputs) {
  auto engine = Engine::Load(dir_.path());
  ASSERT_TRUE(engine.ok());
  auto run = [&](TokenizedInput in) { return (*engine)->Run(std::vector<TokenizedInput>{in}).status(); };
  EXPECT_THAT(Msg(run({})), HasSubstr("is empty"));
  EXPECT_THAT(Msg(run({{101, 40000, 102}, {}})), HasSubstr("token id 40000 is outside the vocabulary"));
  EXPECT_THAT(Msg(run({{101, 102}, {0, 5}})), HasSubstr("token type 5"));
  EXPECT_THAT(Msg(run({{101, 102}, {0}})), HasSubstr("token_type_ids has 1 entries"));
  TokenizedInput too_long;
  too_long.input_ids.assign(513, 1000);
  EXPECT_THAT(Msg(run(too_long)), HasSubstr("has 513 tokens; the model takes at most 512"));
}

TEST_F(EngineTest, MissingFiles) {
  EXPECT_THAT(Msg(Engine::Load(dir_ / "nope").status()), HasSubstr("model directory does not exist"));
  std::filesystem::remove(dir_ / "model.safetensors");
  EXPECT_THAT(Msg(Engine::Load(dir_.path()).status()), HasSubstr("no model.safetensors or pytorch_model.bin"));
  // A weights file that is there but cannot be read is named, not taken for an absent one.
  std::filesystem::create_symlink(dir_ / "gone.safetensors", dir_ / "model.safetensors");
  auto dangling = Engine::Load(dir_.path()).status();
  EXPECT_EQ(dangling.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(dangling), HasSubstr("model.safetensors: exists but is not a readable file"));
  std::filesystem::remove(dir_ / "model.safetensors");
  std::ofstream(dir_ / "model.safetensors.index.json") << R"({"weight_map": {}})";
  auto sharded = Engine::Load(dir_.path()).status();
  EXPECT_EQ(sharded.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(Msg(sharded), HasSubstr("model.safetensors.index.json names a checkpoint sharded"));
  std::filesystem::remove(dir_ / "config.json");
  auto s = Engine::Load(dir_.path()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(s), HasSubstr("config.json"));
}

TEST_F(EngineTest, MissingTensorIsNamed) {
  EditWeights([](auto& m) { m.erase("bert.encoder.layer.1.attention.self.key.weight"); });
  EXPECT_THAT(Msg(Engine::Load(dir_.path()).status()),
              HasSubstr("missing tensors: bert.encoder.layer.1.attention.self.key.weight"));
}

TEST_F(EngineTest, WrongShapeIsNamed) {
  EditWeights([](auto& m) { m["classifier.weight"] = at::zeros({2, 64}); });
  EXPECT_THAT(Msg(Engine::Load(dir_.path()).status()),
              HasSubstr("wrong shapes: classifier.weight is [2, 64], expected [3, 64]"));
}

TEST_F(EngineTest, UnexpectedTensorIsNamedButKnownExtrasAreTolerated) {
  EditWeights([](auto& m) {
    m["bert.embeddings.position_ids"] = at::arange(512).to(at::kFloat).unsqueeze(0);
    m["cls.predictions.bias"] = at::zeros({30522});
  });
  EXPECT_TRUE(Engine::Load(dir_.path()).ok());
  EditWeights([](auto& m) { m["bert.encoder.layer.0.adapter.weight"] = at::zeros({4}); });
  EXPECT_THAT(Msg(Engine::Load(dir_.path()).status()),
              HasSubstr("unexpected tensors: bert.encoder.layer.0.adapter.weight"));
}

TEST_F(EngineTest, AcceptsBareBertKeysAndOldLayerNormNames) {
  EditWeights([](auto& m) {
    std::map<std::string, at::Tensor> renamed;
    for (auto& [k, t] : m) {
      std::string n = k.rfind("bert.", 0) == 0 ? k.substr(5) : k;
      if (n.size() > 16 && n.compare(n.size() - 16, 16, "LayerNorm.weight") == 0) n = n.substr(0, n.size() - 6) + "gamma";
      renamed[n] = t;
    }
    m = renamed;
  });
  EXPECT_TRUE(Engine::Load(dir_.path()).ok());
}

TEST_F(EngineTest, TwoSpellingsOfOneParameterAreRefused) {
  EditWeights([](auto& m) {
    m["bert.embeddings.LayerNorm.gamma"] = m["bert.embeddings.LayerNorm.weight"] * 2;
  });
  EXPECT_THAT(Msg(Engine::Load(dir_.path()).status()),
              HasSubstr("tensors 'bert.embeddings.LayerNorm.gamma' and 'bert.embeddings.LayerNorm.weight' "
                        "are both parameter 'bert.embeddings.LayerNorm.weight'"));
  EditWeights([](auto& m) {
    m.erase("bert.embeddings.LayerNorm.gamma");
    m["pooler.dense.bias"] = m["bert.pooler.dense.bias"];
  });
  EXPECT_THAT(Msg(Engine::Load(dir_.path()).status()), HasSubstr("keep one of them"));
}

TEST_F(EngineTest, NonFiniteWeightsAreRefused) {
  EditWeights([](auto& m) { m["bert.pooler.dense.bias"][3] = std::numeric_limits<float>::quiet_NaN(); });
  EXPECT_THAT(Msg(Engine::Load(dir_.path()).status()),
              HasSubstr("tensor 'bert.pooler.dense.bias' has non-finite values"));
}

TEST_F(EngineTest, OtherArchitecturesAreRefused) {
  std::ofstream(dir_ / "config.json") << R"({"architectures": ["RobertaForSequenceClassification"]})";
  auto s = Engine::Load(dir_.path()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(Msg(s), HasSubstr("RobertaForSequenceClassification\" is not supported"));
}

TEST_F(EngineTest, DevicesAndDtypes) {
  EXPECT_THAT(Msg(Engine::Load(dir_.path(), {"tpu", "float32"}).status()), HasSubstr("device 'tpu'"));
  EXPECT_THAT(Msg(Engine::Load(dir_.path(), {"cpu", "float16"}).status()), HasSubstr("only available on CUDA"));
  if (!at::hasCUDA()) {
    EXPECT_THAT(Msg(Engine::Load(dir_.path(), {"cuda", "float32"}).status()), HasSubstr("CUDA is not available"));
  }
}

// A deterministic input of `len` ids (1000 + (offset + i * 7919) mod 20000) in segment `type_id`.
TokenizedInput SyntheticInput(int len, int offset, int type_id) {
  TokenizedInput in;
  for (int i = 0; i < len; ++i) in.input_ids.push_back(1000 + (offset + i * 7919) % 20000);
  in.token_type_ids.assign(len, type_id);
  return in;
}

// Sets LibTorch's intra-op thread count for a scope (threads started in it inherit it). The
// ThreadTeam paths need at least two; LibTorch's default here is one without OMP_NUM_THREADS, so a
// test of those paths says so.
class IntraOpThreads {
 public:
  explicit IntraOpThreads(int n) : saved_(at::get_num_threads()) { at::set_num_threads(n); }
  ~IntraOpThreads() { at::set_num_threads(saved_); }

 private:
  int saved_;
};

// A mini-preset checkpoint (64-wide heads, the shape the team path serves) made in `dir`, loaded
// with `options`.
std::unique_ptr<Engine> LoadMini(const TempDir& dir, uint64_t seed, const EngineOptions& options = {}) {
  MakeOptions o;
  o.preset = "mini";
  o.seed = seed;
  EXPECT_TRUE(MakeCheckpoint(dir.path(), o).ok());
  auto engine = Engine::Load(dir.path(), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(*engine) : nullptr;
}

// Runs from several threads at once (one of them may take the shared ThreadTeam, the others
// their per-operation path) give each sequence the logits it gets alone. The mini preset has
// 64-wide heads, the shape the team path serves; the 8 × 40 batch (320 tokens) takes the team's
// path for long passes (products split by rows: 160 each, on PackedLinear), the others its
// prepacked PackedLinear path.
TEST(EngineConcurrencyTest, ConcurrentRunsGiveTheSequentialLogits) {
  IntraOpThreads two(2);
  TempDir dir;
  std::unique_ptr<Engine> engine = LoadMini(dir, 11);
  ASSERT_NE(engine, nullptr);
  std::vector<std::vector<TokenizedInput>> batches;
  for (const auto& [len, size] : std::vector<std::pair<int, int>>{{5, 2}, {16, 2}, {40, 2}, {40, 8}}) {
    std::vector<TokenizedInput> batch;
    for (int b = 0; b < size; ++b) batch.push_back(SyntheticInput(len, b * 131, 0));
    batches.push_back(batch);
  }
  std::vector<std::vector<Prediction>> want;
  for (const auto& batch : batches) {
    auto r = engine->Run(batch);
    ASSERT_TRUE(r.ok()) << r.status();
    want.push_back(*r);
  }
  std::atomic<int> mismatches{0}, failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 4; ++rep) {
        const size_t i = (t + rep) % batches.size();
        auto r = engine->Run(batches[i]);
        if (!r.ok()) {
          failures.fetch_add(1);
          continue;
        }
        for (size_t b = 0; b < r->size(); ++b) {
          for (size_t c = 0; c < (*r)[b].logits.size(); ++c) {
            // 1e-4: the 320-token batch's products run on PackedLinear on the team (each
            // member's rows) and on the sgemm on the per-operation path, so the two agree to
            // float rounding (1.3e-5 seen), not bit for bit.
            if (std::abs((*r)[b].logits[c] - want[i][b].logits[c]) > 1e-4) mismatches.fetch_add(1);
          }
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(mismatches.load(), 0);
}

// A sequence's logits do not depend on its batch, also where the batch is long enough (> 256
// tokens) for the team to split the products by rows (on PackedLinear, 216 rows each, or on
// the sgemm where the team is off: the logits then agree to float rounding, 1.1e-5 on a logit of
// 3 here, not bit for bit).
TEST(EngineBatchTest, LongBatchesGiveEachSequenceItsLogitsAlone) {
  IntraOpThreads two(2);
  TempDir dir;
  std::unique_ptr<Engine> engine = LoadMini(dir, 5);
  ASSERT_NE(engine, nullptr);
  std::vector<TokenizedInput> batch;
  // 9 × 48 = 432 tokens, split unevenly over 2 threads' rows.
  for (int b = 0; b < 9; ++b) batch.push_back(SyntheticInput(48, b * 977, b % 2));
  auto batched = engine->Run(batch);
  ASSERT_TRUE(batched.ok()) << batched.status();
  for (size_t b = 0; b < batch.size(); ++b) {
    auto alone = engine->Run({batch[b]});
    ASSERT_TRUE(alone.ok()) << alone.status();
    ASSERT_EQ((*alone)[0].logits.size(), (*batched)[b].logits.size());
    for (size_t c = 0; c < (*alone)[0].logits.size(); ++c) {
      EXPECT_NEAR((*alone)[0].logits[c], (*batched)[b].logits[c], 1e-4) << "sequence " << b;
    }
  }
}

// A team pass takes its buffers from the shared PassArena, whose pages hold what the last pass
// left there: its logits are those of the same pass on freshly allocated buffers (the arena
// leased elsewhere), bit for bit, on the prepacked path (<= 256 tokens) and the long one.
TEST(EnginePassArenaTest, PassesOnTheArenaEqualPassesOnTheAllocator) {
  // The team path runs with the sgemm, or without it on PackedLinear and the AVX-512 kernels.
  if (internal::AtenOnly() || (internal::FindSgemm() == nullptr && !PackedLinearSupported())) {
    GTEST_SKIP() << "no team path here (COLLABSERVE_GEMM=aten, or neither the sgemm nor AVX-512)";
  }
  IntraOpThreads two(2);
  TempDir dir;
  std::unique_ptr<Engine> engine = LoadMini(dir, 17);
  ASSERT_NE(engine, nullptr);
  for (const auto& [len, size] : std::vector<std::pair<int, int>>{{40, 2}, {60, 6}}) {
    std::vector<TokenizedInput> batch;
    for (int b = 0; b < size; ++b) batch.push_back(SyntheticInput(len - 3 * b, b * 257, b % 2));
    auto on_arena = engine->Run(batch);
    ASSERT_TRUE(on_arena.ok()) << on_arena.status();
    EXPECT_GT(PassArena::Shared().mapped_bytes(), 0);
    absl::StatusOr<std::vector<Prediction>> allocated = absl::UnknownError("not run");
    {
      PassArena::Lease held = PassArena::Shared().TryLease(1);
      ASSERT_TRUE(held) << "the arena is free between passes";
      allocated = engine->Run(batch);
    }
    ASSERT_TRUE(allocated.ok()) << allocated.status();
    auto again = engine->Run(batch);  // on the arena's pages as the last pass left them
    ASSERT_TRUE(again.ok()) << again.status();
    for (size_t b = 0; b < batch.size(); ++b) {
      EXPECT_EQ((*on_arena)[b].logits, (*allocated)[b].logits) << len << " x " << size << ", sequence " << b;
      EXPECT_EQ((*on_arena)[b].logits, (*again)[b].logits) << len << " x " << size << ", sequence " << b;
    }
  }
}

// Forward computes the last layer for the [CLS] position alone (keys and values for every
// position, the rest for position 0); its logits must be those of the pooler and classifier on
// position 0 of EncoderOutput, which computes every position. Checked on every path the encoder
// takes: the ThreadTeam on prepacked PackedLinear (<= 256 tokens), the team with the products on
// the sgemm split by rows (> 256), attention in registers (S <= 48) and on the micro-kernel (S > 48),
// padded batches, the per-operation path (one thread), and collaborative layers (ATen attention).
at::Tensor LogitsFromTheFullEncoder(const BertClassifier& m, const at::Tensor& ids,
                                    const at::Tensor& types, const at::Tensor& mask) {
  const auto params = m.named_parameters();
  at::Tensor h = m.EncoderOutput(ids, types, mask);
  EXPECT_EQ(h.size(1), ids.size(1));
  at::Tensor pooled = at::tanh(at::linear(h.select(1, 0), params["bert.pooler.dense.weight"],
                                          params["bert.pooler.dense.bias"]));
  return at::linear(pooled, params["classifier.weight"], params["classifier.bias"]);
}

// B sequences of lengths `lens` (ids as SyntheticInput's), padded to the longest with a 0/1 mask.
std::tuple<at::Tensor, at::Tensor, at::Tensor> PaddedBatch(const std::vector<int>& lens, int vocab) {
  const int64_t B = static_cast<int64_t>(lens.size());
  const int64_t S = *std::max_element(lens.begin(), lens.end());
  at::Tensor ids = at::zeros({B, S}, at::kLong), types = at::zeros({B, S}, at::kLong);
  at::Tensor mask = at::zeros({B, S}, at::kLong);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < lens[b]; ++i) {
      ids[b][i] = (1000 + (b * 131 + i * 7919) % 20000) % vocab;
      types[b][i] = i >= lens[b] / 2 ? 1 : 0;
      mask[b][i] = 1;
    }
  }
  return {ids, types, mask};
}

void ExpectClsOnlyForwardEqualsFullEncoder(const BertClassifier& m, const std::string& what) {
  const int vocab = m.config().vocab_size;
  // Two intra-op threads take the ThreadTeam paths, one the per-operation path.
  for (int n : {2, 1}) {
    IntraOpThreads threads(n);
    for (const std::vector<int>& lens :
         std::vector<std::vector<int>>{{16, 16}, {7, 20, 13}, {100}, {48, 48, 48, 48, 48, 48, 48, 48, 48},
                                       {70, 33}}) {
      c10::InferenceMode guard;
      auto [ids, types, mask] = PaddedBatch(lens, vocab);
      at::Tensor got = m.Forward(ids, types, mask);
      at::Tensor want = LogitsFromTheFullEncoder(m, ids, types, mask);
      ASSERT_EQ(got.sizes(), want.sizes());
      const double diff = (got - want).abs().max().item<double>();
      EXPECT_LT(diff, 1e-4) << what << ", " << n << " thread(s), " << lens.size() << " sequences of up to "
                            << ids.size(1) << " tokens";
      EXPECT_GT(want.abs().max().item<double>(), 1e-3) << what;  // not trivially zero
    }
  }
}

TEST(EngineClsOnlyTest, ForwardEqualsThePoolerOnTheFullEncoderOutput) {
  TempDir dir;
  std::unique_ptr<Engine> engine = LoadMini(dir, 17);
  ASSERT_NE(engine, nullptr);
  ExpectClsOnlyForwardEqualsFullEncoder(engine->classifier(), "mini");
}

// A small model whose last layer is collaborative, with a standard one between (its weights are
// the test's to set).
BertConfig SmallCollaborativeConfig() {
  BertConfig c;
  c.vocab_size = 20000;
  c.hidden_size = 128;
  c.num_attention_heads = 2;
  c.num_hidden_layers = 3;
  c.intermediate_size = 256;
  c.max_position_embeddings = 128;
  c.id2label = {"a", "b", "c"};
  c.collaborative.ranks = {24, 0, 40};
  return c;
}

// That model, its parameters drawn from normal(0, 0.3) after at::manual_seed(seed), prepared on the CPU.
std::unique_ptr<BertClassifier> SmallCollaborativeModel(uint64_t seed) {
  auto m = std::make_unique<BertClassifier>(SmallCollaborativeConfig());
  {
    c10::InferenceMode guard;
    at::manual_seed(seed);
    for (auto& p : m->named_parameters()) p.value().normal_(0.0, 0.3);
  }
  m->Prepare(c10::Device(c10::kCPU), at::kFloat);
  return m;
}

TEST(EngineClsOnlyTest, CollaborativeLayersToo) {
  auto model = SmallCollaborativeModel(5);
  const BertClassifier& m = *model;
  ExpectClsOnlyForwardEqualsFullEncoder(m, "collaborative");
}

// The per-operation path in pieces (Embeddings, RunLayers, LogitsFrom) is the whole pass: from the
// hidden states entering any layer the logits are Forward's, and layers [i, j) take layer i's
// inputs to layer j's, standard and collaborative, on a padded batch.
TEST(EnginePiecesTest, AnyLayersInputsGiveForwardsLogits) {
  auto model = SmallCollaborativeModel(6);
  const BertClassifier& m = *model;
  c10::InferenceMode guard;
  auto [ids, types, mask] = PaddedBatch({9, 30, 17}, m.config().vocab_size);
  const at::Tensor want = m.Forward(ids, types, mask);
  const std::vector<at::Tensor> inputs = m.LayerInputs(ids, types, mask);
  ASSERT_EQ(inputs.size(), 3u);
  EXPECT_TRUE(at::equal(m.Embeddings(ids, types), inputs[0]));
  const at::Tensor last = m.RunLayers(0, 3, inputs[0], mask);
  for (size_t i = 0; i <= 3; ++i) {
    const at::Tensor h = i < 3 ? inputs[i] : last;
    const at::Tensor got = m.LogitsFrom(i, h, mask);
    ASSERT_EQ(got.sizes(), want.sizes());
    EXPECT_LT((got - want).abs().max().item<double>(), 1e-4) << "from layer " << i;
    for (size_t j = i; j < 3; ++j) {
      EXPECT_TRUE(at::equal(m.RunLayers(i, j, h, mask), inputs[j])) << "layers [" << i << ", " << j << ")";
    }
  }
  EXPECT_GT(want.abs().max().item<double>(), 1e-3);  // not trivially zero
  EXPECT_THROW(m.RunLayers(2, 1, inputs[0], mask), c10::Error);
  EXPECT_THROW(m.RunLayers(0, 4, inputs[0], mask), c10::Error);
  EXPECT_THROW(m.LogitsFrom(4, inputs[0], mask), c10::Error);
}

// The small tensors (biases, LayerNorm, mixing, content vectors, fused biases) share one block of
// their own, each at a 64-byte boundary, none overlapping another, the block about their padded
// bytes (with the model-wide ones: the embeddings' LayerNorm, token types, the head's); the fused biases Prepare writes there are the parameters' (zeros for the
// collaborative layers' shared query/key columns and content scores). The embedding tables stay
// out of it.
TEST(EngineMemoryTest, SmallTensorsShareOneBlockOfTheirOwn) {
  const BertConfig c = SmallCollaborativeConfig();
  BertClassifier m(c);
  {
    c10::InferenceMode guard;
    at::manual_seed(7);
    for (auto& p : m.named_parameters()) p.value().normal_(0.0, 0.3);
  }
  m.Prepare(c10::Device(c10::kCPU), at::kFloat);
  const int64_t D = c.hidden_size, H = c.num_attention_heads;
  std::vector<const at::Tensor*> small;
  for (const EncoderLayer& l : m.layers()) {
    for (const at::Tensor* t : {&l.value_b, &l.fused_b, &l.attn_out_b, &l.attn_ln_w, &l.attn_ln_b,
                                &l.inter_b, &l.out_b, &l.out_ln_w, &l.out_ln_b}) {
      small.push_back(t);
    }
    if (l.collaborative) {
      small.push_back(&l.mixing);
      // Unpacked (no AVX-512, COLLABSERVE_GEMM=aten), the content vectors are rows of the fused
      // weight instead.
      if (m.weights_released()) {
        small.push_back(&l.content_bias);
      } else {
        EXPECT_TRUE(l.content_bias.storage().is_alias_of(l.fused.plain.storage()));
      }
      // The projection's row: 2R + D + H rounded up to 16 floats, zeros after the values' bias.
      const int64_t width = (2 * l.rank + D + H + 15) / 16 * 16;
      ASSERT_EQ(l.fused_b.numel(), width);
      EXPECT_TRUE(l.fused_b.narrow(0, 0, 2 * l.rank).eq(0).all().item<bool>());
      EXPECT_TRUE(l.fused_b.narrow(0, 2 * l.rank, D).equal(l.value_b));
      EXPECT_TRUE(l.fused_b.narrow(0, 2 * l.rank + D, width - 2 * l.rank - D).eq(0).all().item<bool>());
    } else {
      small.push_back(&l.query_b);
      small.push_back(&l.key_b);
      EXPECT_TRUE(l.fused_b.equal(at::cat({l.query_b, l.key_b, l.value_b})));
    }
  }
  const at::Storage block = small.front()->storage();
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  int64_t padded = 0;
  for (const at::Tensor* t : small) {
    ASSERT_TRUE(t->storage().is_alias_of(block)) << t->sizes();
    const auto p = reinterpret_cast<uintptr_t>(t->data_ptr());
    EXPECT_EQ(p % 64, 0u) << t->sizes();
    ranges.emplace_back(p, p + t->numel() * sizeof(float));
    padded += (t->numel() * 4 + 63) / 64 * 64;
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) EXPECT_LE(ranges[i - 1].second, ranges[i].first);
  // The block also holds the embeddings' LayerNorm, the token-type table and the head's biases.
  EXPECT_LE(static_cast<int64_t>(block.nbytes()), padded + 64 * 1024);
  for (auto& p : m.named_parameters()) {
    if (p.key().find("word_embeddings") != std::string::npos) {
      EXPECT_FALSE(p.value().storage().is_alias_of(block));
    }
  }
}

// ReadDeviceMemory (what /metrics exports as collabserve_gpu_memory_*): nothing on the CPU or
// without CUDA; on a GPU, a tensor's bytes and a loaded model's weights in `allocated`, freed
// blocks kept in `reserved`, both within the GPU's total.
TEST(EngineMemoryTest, GpuMemoryReadingsFollowTensorsAndModels) {
  EXPECT_FALSE(ReadDeviceMemory(c10::Device(c10::kCPU)).has_value());
  EXPECT_TRUE(InitDevice(c10::Device(c10::kCPU)).ok());
  const c10::Device gpu(c10::kCUDA, 0);
  if (!at::hasCUDA()) {
    EXPECT_FALSE(ReadDeviceMemory(gpu).has_value());
    absl::Status s = InitDevice(gpu);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(Msg(s), HasSubstr("cannot start CUDA on cuda:0: "));
    GTEST_SKIP() << "no CUDA device (scripts/gpu-check.sh runs this)";
  }
  ASSERT_TRUE(InitDevice(gpu).ok());
  EXPECT_TRUE(ReadDeviceMemory(gpu).has_value()) << "InitDevice starts what the reading reads";
  at::Tensor warm = at::zeros({1}, at::TensorOptions().device(gpu));
  std::optional<DeviceMemory> before = ReadDeviceMemory(gpu);
  ASSERT_TRUE(before.has_value()) << "no reading once a tensor is on the GPU";
  EXPECT_GT(before->allocated_bytes, 0);
  EXPECT_GE(before->reserved_bytes, before->allocated_bytes);
  EXPECT_GE(before->total_bytes, before->reserved_bytes);
  EXPECT_GT(before->total_bytes, int64_t{1} << 30);

  constexpr int64_t kBytes = int64_t{64} << 20;
  at::Tensor big = at::empty({kBytes / 4}, at::TensorOptions().dtype(at::kFloat).device(gpu));
  const std::optional<DeviceMemory> with = ReadDeviceMemory(gpu);
  ASSERT_TRUE(with.has_value());
  EXPECT_GE(with->allocated_bytes - before->allocated_bytes, kBytes);
  EXPECT_LE(with->allocated_bytes - before->allocated_bytes, kBytes + (int64_t{2} << 20));  // rounding
  EXPECT_GE(with->reserved_bytes, with->allocated_bytes);
  EXPECT_EQ(with->total_bytes, before->total_bytes);
  big.reset();
  const std::optional<DeviceMemory> freed = ReadDeviceMemory(gpu);
  ASSERT_TRUE(freed.has_value());
  EXPECT_EQ(freed->allocated_bytes, before->allocated_bytes);
  EXPECT_EQ(freed->reserved_bytes, with->reserved_bytes) << "the allocator keeps freed blocks";
  ReleaseCachedMemory(gpu);
  const std::optional<DeviceMemory> released = ReadDeviceMemory(gpu);
  ASSERT_TRUE(released.has_value());
  EXPECT_EQ(released->allocated_bytes, freed->allocated_bytes);
  EXPECT_LE(released->reserved_bytes, freed->reserved_bytes - kBytes) << "the freed 64 MiB went back";

  // A model on the GPU: at least its float32 weights.
  TempDir dir;
  std::unique_ptr<Engine> engine = LoadMini(dir, 0, {"cuda", "float32"});
  ASSERT_NE(engine, nullptr);
  const std::optional<DeviceMemory> loaded = ReadDeviceMemory(gpu);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_GE(loaded->allocated_bytes - freed->allocated_bytes, engine->info().params.total * 4);
}

// LibTorch's exceptions as statuses: an allocation that failed is RESOURCE_EXHAUSTED (a caller may
// retry), anything else INTERNAL; the message is the context and LibTorch's own, without its
// C++ backtrace.
TEST(EngineErrorsTest, TorchErrorsBecomeStatusesWithoutBacktraces) {
  auto status_of = [](auto&& throws) {
    try {
      throws();
    } catch (const std::exception& e) {
      return TorchErrorStatus("loading x", e);
    }
    return absl::OkStatus();
  };
  absl::Status oom = status_of(
      [] { TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate 2.00 GiB"); });
  EXPECT_EQ(oom.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Msg(oom), "loading x: CUDA out of memory. Tried to allocate 2.00 GiB");
  absl::Status torch = status_of([] { TORCH_CHECK(false, "shapes do not match"); });
  EXPECT_EQ(torch.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(Msg(torch), "loading x: shapes do not match");
  absl::Status other = status_of([] { throw std::runtime_error("no space left"); });
  EXPECT_EQ(other.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(Msg(other), "loading x: no space left");
}

// Out of GPU memory: a model that does not fit is refused with RESOURCE_EXHAUSTED, so is a pass
// that does not; once memory is free again the same engine serves (the allocator recovers).
TEST(EngineErrorsTest, OutOfGpuMemoryIsResourceExhaustedAndPassesWhenMemoryIsBack) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device (scripts/gpu-check.sh runs this)";
  const c10::Device gpu(c10::kCUDA, 0);
  TempDir dir;
  EngineOptions eo;
  eo.device = "cuda";
  eo.cuda_graph_max_tokens = 0;  // every pass eager: the test is about the allocator
  std::unique_ptr<Engine> engine = LoadMini(dir, 0, eo);
  ASSERT_NE(engine, nullptr);
  std::vector<TokenizedInput> batch;
  for (int b = 0; b < 16; ++b) batch.push_back(SyntheticInput(500, b * 131, 0));
  auto want = engine->Run(batch);
  ASSERT_TRUE(want.ok()) << want.status();

  // Fill the GPU: chunks of 1 GiB, then 64 MiB, then 2 MiB, until none fits.
  std::vector<at::Tensor> filler;
  for (int64_t chunk : {int64_t{1} << 30, int64_t{64} << 20, int64_t{2} << 20}) {
    for (;;) {
      try {
        filler.push_back(at::empty({chunk}, at::TensorOptions().dtype(at::kByte).device(gpu)));
      } catch (const c10::Error&) {
        break;
      }
    }
  }
  ASSERT_FALSE(filler.empty());
  absl::Status load = Engine::Load(dir.path(), eo).status();
  EXPECT_EQ(load.code(), absl::StatusCode::kResourceExhausted) << load;
  EXPECT_THAT(Msg(load), HasSubstr("out of memory"));
  EXPECT_THAT(Msg(load), Not(HasSubstr("Exception raised from")));
  absl::Status run = engine->Run(batch).status();
  EXPECT_EQ(run.code(), absl::StatusCode::kResourceExhausted) << run;
  EXPECT_THAT(Msg(run), HasSubstr("forward pass failed: "));

  filler.clear();  // back to the allocator's cache: this engine can use it, another process not
  auto again = engine->Run(batch);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_EQ(again->size(), want->size());
  for (size_t i = 0; i < want->size(); ++i) {
    for (size_t k = 0; k < (*want)[i].logits.size(); ++k) {
      EXPECT_NEAR((*again)[i].logits[k], (*want)[i].logits[k], 1e-5);
    }
  }
  ReleaseCachedMemory(gpu);  // the GPU for the tests after this one (a death test's own process)
}

// DeviceErrorStatus on the CPU is TorchErrorStatus: the CPU never fails for good. The mark of a
// device failure survives copies of the status, not a status rebuilt from its code and message.
TEST(EngineErrorsTest, OnTheCpuNoErrorIsADeviceFailure) {
  const c10::Device cpu(c10::kCPU);
  EXPECT_TRUE(CheckDevice(cpu).ok());
  auto status_of = [&](auto&& throws) {
    try {
      throws();
    } catch (const std::exception& e) {
      return DeviceErrorStatus("forward pass failed", e, cpu);
    }
    return absl::OkStatus();
  };
  absl::Status internal = status_of([] { TORCH_CHECK(false, "shapes do not match"); });
  EXPECT_EQ(internal.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(Msg(internal), "forward pass failed: shapes do not match");
  EXPECT_FALSE(IsDeviceFailure(internal));
  absl::Status oom = status_of([] { TORCH_CHECK_WITH(OutOfMemoryError, false, "out of memory"); });
  EXPECT_EQ(oom.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(IsDeviceFailure(oom));

  const absl::Status marked = MarkedDeviceFailure(absl::UnavailableError("cuda:0 can run no more work"));
  EXPECT_TRUE(IsDeviceFailure(marked));
  const absl::Status copy = marked;
  EXPECT_TRUE(IsDeviceFailure(copy));
  EXPECT_FALSE(IsDeviceFailure(absl::Status(marked.code(), marked.message())));
  EXPECT_TRUE(MarkedDeviceFailure(absl::OkStatus()).ok());
  EXPECT_FALSE(IsDeviceFailure(MarkedDeviceFailure(absl::OkStatus())));
  // The context callers add keeps the mark (util::Prefixed), and the code.
  const absl::Status prefixed = util::Prefixed(marked, "model m:1: ");
  EXPECT_TRUE(IsDeviceFailure(prefixed));
  EXPECT_EQ(prefixed.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Msg(prefixed), "model m:1: cuda:0 can run no more work");
  EXPECT_TRUE(util::Prefixed(absl::OkStatus(), "model m:1: ").ok());
  // An INTERNAL status of work on the CPU stays what it was (a job's outcome, say).
  const absl::Status checked = WithDeviceCheck(internal, cpu);
  EXPECT_EQ(checked, internal);
  EXPECT_FALSE(IsDeviceFailure(checked));
}

// In a process of its own (the death test below): loads the mini model on the GPU, checks that it
// serves, then breaks the process's CUDA context for good with a device-side assert (as an illegal
// address or an ECC error would) and checks what the engine and CheckDevice say. Prints "found: "
// and the pass's status when all is as it should be, else "wrong: " and what is not. Leaves every
// CUDA object alive: the process ends with _Exit and no destructor runs on the broken context.
std::string BreakTheGpuAndReport(const TempDir& dir) {
  const c10::Device gpu(c10::kCUDA, 0);
  MakeOptions mo;
  mo.preset = "mini";
  if (absl::Status s = MakeCheckpoint(dir.path(), mo); !s.ok()) return absl::StrCat("wrong: ", s.ToString());
  EngineOptions eo;
  eo.device = "cuda";  // CUDA graphs on: the second pass replays the first one's graph
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Load(dir.path(), eo);
  if (!engine.ok()) return absl::StrCat("wrong: the model did not load: ", engine.status().ToString());
  Engine* e = engine->release();  // never destroyed (see above)
  const std::vector<TokenizedInput> batch = {SyntheticInput(32, 7, 0), SyntheticInput(20, 3, 0)};
  if (absl::Status s = e->Run(batch).status(); !s.ok()) {
    return absl::StrCat("wrong: a pass before the fault failed: ", s.ToString());
  }
  if (absl::Status s = CheckDevice(gpu); !s.ok()) {
    return absl::StrCat("wrong: CheckDevice failed before the fault: ", s.ToString());
  }
  {
    c10::InferenceMode guard;
    auto* zero = new at::Tensor(at::zeros({1}, at::TensorOptions().device(gpu)));
    at::_assert_async(*zero);  // fails on the GPU, later: a sticky cudaErrorAssert
  }
  const absl::Status run = e->Run(batch).status();
  if (run.code() != absl::StatusCode::kUnavailable || !IsDeviceFailure(run) ||
      !absl::StartsWith(run.message(), "forward pass failed: ") ||
      !absl::StrContains(run.message(), "cuda:0 can run no more work") ||
      absl::StrContains(run.message(), "Exception raised from")) {
    return absl::StrCat("wrong: the pass after the fault: ", run.ToString());
  }
  const absl::Status check = CheckDevice(gpu);
  if (check.code() != absl::StatusCode::kUnavailable ||
      !absl::StartsWith(check.message(), "cuda:0 can run no more work: ")) {
    return absl::StrCat("wrong: CheckDevice after the fault: ", check.ToString());
  }
  // What an admin job does with its outcome (compression reports LibTorch's errors unchecked).
  const absl::Status job = WithDeviceCheck(absl::InternalError("compression failed: CUDA error"), gpu);
  if (job.code() != absl::StatusCode::kUnavailable || !IsDeviceFailure(job) ||
      !absl::StartsWith(job.message(), "compression failed: CUDA error; cuda:0 can run no more work")) {
    return absl::StrCat("wrong: a job's INTERNAL error after the fault: ", job.ToString());
  }
  absl::StatusOr<std::unique_ptr<Engine>> again = Engine::Load(dir.path(), eo);
  if (again.ok()) {
    (void)again->release();
    return "wrong: a model loaded on the failed GPU";
  }
  if (!IsDeviceFailure(again.status())) {
    return absl::StrCat("wrong: loading on the failed GPU: ", again.status().ToString());
  }
  return absl::StrCat("found: ", run.ToString());
}

[[noreturn]] void BreakTheGpuAndExit() {
  std::string report;
  {
    TempDir dir;
    report = BreakTheGpuAndReport(dir);
  }
  std::fprintf(stderr, "%s\n", report.c_str());
  std::fflush(stderr);
  std::_Exit(absl::StartsWith(report, "found: ") ? 0 : 1);
}

// A GPU that fails for good (a CUDA error that sticks to the context) turns the engine's errors
// into UNAVAILABLE device failures, which the server answers by going NOT_SERVING
// (server_test's DeviceFailure tests). Run in a process of its own: the fault breaks CUDA for the
// rest of the process.
TEST(EngineErrorsTest, AGpuThatFailsForGoodMakesDeviceFailures) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device (scripts/gpu-check.sh runs this)";
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process, with a CUDA context of its own
  ReleaseCachedMemory(c10::Device(c10::kCUDA, 0));  // what this process's allocator keeps, for it
  EXPECT_EXIT(BreakTheGpuAndExit(), ::testing::ExitedWithCode(0), "found: UNAVAILABLE: forward pass failed: ");
}

// The path CUDA's float16 / bfloat16 take (ATen ops on another dtype), run on the CPU in bfloat16:
// standard and collaborative layers, padded; within bfloat16's rounding of the float32 logits.
TEST(EngineDtypeTest, CollaborativeLayersInBfloat16FollowFloat32) {
  const BertConfig c = SmallCollaborativeConfig();
  BertClassifier f32(c), bf16(c);
  {
    c10::InferenceMode guard;
    at::manual_seed(6);
    for (auto& p : f32.named_parameters()) p.value().normal_(0.0, 0.1);
    auto src = f32.named_parameters();
    for (auto& p : bf16.named_parameters()) p.value().copy_(src[p.key()]);
  }
  f32.Prepare(c10::Device(c10::kCPU), at::kFloat, /*pack_weights=*/false);
  bf16.Prepare(c10::Device(c10::kCPU), at::kBFloat16, /*pack_weights=*/false);
  c10::InferenceMode guard;
  auto [ids, types, mask] = PaddedBatch({12, 30, 7}, c.vocab_size);
  at::Tensor want = f32.Forward(ids, types, mask);
  at::Tensor got = bf16.Forward(ids, types, mask).to(at::kFloat);
  ASSERT_EQ(got.sizes(), want.sizes());
  EXPECT_GT(want.abs().max().item<double>(), 1e-2);
  EXPECT_LT((got - want).abs().max().item<double>(), 0.1 * std::max(1.0, want.abs().max().item<double>()));
}

TEST(CheckpointMakerTest, IsDeterministic) {
  TempDir a, b;
  MakeOptions o;
  o.seed = 3;
  ASSERT_TRUE(MakeCheckpoint(a.path(), o).ok());
  ASSERT_TRUE(MakeCheckpoint(b.path(), o).ok());
  auto ra = testing::RunCommand("cmp " + (a / "model.safetensors") + " " + (b / "model.safetensors"));
  EXPECT_EQ(ra.exit_code, 0);
  o.seed = 4;
  ASSERT_TRUE(MakeCheckpoint(b.path(), o).ok());
  EXPECT_NE(testing::RunCommand("cmp -s " + (a / "model.safetensors") + " " + (b / "model.safetensors")).exit_code, 0);
}

TEST(CheckpointMakerTest, RejectsBadOptions) {
  TempDir a;
  MakeOptions o;
  o.preset = "huge";
  EXPECT_THAT(Msg(MakeCheckpoint(a.path(), o)), HasSubstr("unknown preset 'huge'"));
  o = MakeOptions();
  o.hidden = 100;
  o.heads = 3;
  EXPECT_THAT(Msg(MakeCheckpoint(a.path(), o)), HasSubstr("not a multiple"));
  o = MakeOptions();
  o.hidden_act = "swish";
  EXPECT_THAT(Msg(MakeCheckpoint(a.path(), o)), HasSubstr("swish"));
}

}  // namespace
}  // namespace collabserve::model
