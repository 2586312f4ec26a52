// Activation-aware CP (collaborative.h: LayerWhitening): with Σ = I it is plain CP; on layer inputs
// that are strongly anisotropic it has a lower activation-weighted error than plain CP at the same
// rank; full rank stays exact; calibration text is parsed and refused with clear errors.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "server/compress/collaborative.h"
#include "server/compress/cp_als.h"
#include "server/model/bert.h"
#include "server/model/checkpoint_maker.h"
#include "server/model/config.h"
#include "server/model/param_counts.h"
#include "server/model/state_dict.h"
#include "server/text/bert_tokenizer.h"
#include "tests/compress/compress_test_util.h"
#include "tests/testing/test_util.h"

namespace collabserve::compress {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

using compress_testing::Rank;

class WhiteningTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model::MakeOptions m;
    m.seed = 5;
    m.preset = "tiny";  // 2 layers, D = 64, 4 heads
    ASSERT_TRUE(model::MakeCheckpoint(dir_.path(), m).ok());
    source_ = compress_testing::LoadPrepared(dir_.path());
    ASSERT_NE(source_, nullptr);
    D_ = source_->config().hidden_size;
    H_ = source_->config().num_attention_heads;
    dk_ = source_->config().head_size();
  }

  // Statistics of inputs x = U diag(s) z with s_j = decay^j: most of the energy in a few directions.
  CalibrationStats Anisotropic(double decay, uint64_t seed) const {
    at::manual_seed(seed);
    CalibrationStats st;
    for (size_t l = 0; l < source_->layers().size(); ++l) {
      at::Tensor U = std::get<0>(at::linalg_qr(at::randn({D_, D_}, at::kDouble)));
      at::Tensor s = at::pow(at::full({D_}, decay, at::kDouble), at::arange(D_, at::kDouble));
      st.second_moment.push_back(U.matmul(at::diag(s * s)).matmul(U.t()));
      st.mean.push_back(at::zeros({D_}, at::kDouble));
    }
    st.texts = 1;
    st.tokens = 1;
    return st;
  }

  // ‖L_qᵀ(T − T̂)L_k‖ / ‖L_qᵀ T L_k‖ of a converted layer, computed here from the model's tensors.
  double ActivationError(const model::BertClassifier& c, int layer, const LayerWhitening& w) const {
    const auto& src = source_->layers()[layer];
    const auto& dst = c.layers()[layer];
    at::Tensor P = src.query_w.to(at::kDouble).view({H_, dk_, D_}).transpose(1, 2);
    at::Tensor Q = src.key_w.to(at::kDouble).view({H_, dk_, D_}).transpose(1, 2);
    at::Tensor B = dst.collab_query_w.to(at::kDouble).t(), C = dst.collab_key_w.to(at::kDouble).t();
    at::Tensor A = dst.mixing.to(at::kDouble) * std::sqrt(static_cast<double>(dk_));
    at::Tensor Lq = w.query_factor.t(), Lk = w.key_factor.t();
    auto e = FactorizedRelativeError(at::matmul(Lq, P), at::matmul(Lk, Q), A, Lq.matmul(B), Lk.matmul(C));
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? *e : -1;
  }

  TempDir dir_;
  std::unique_ptr<model::BertClassifier> source_;
  int64_t D_ = 0, H_ = 0, dk_ = 0;
};

TEST_F(WhiteningTest, IdentityStatisticsGivePlainCp) {
  CompressReport plain_report, white_report;
  auto plain = ConvertToCollaborative(*source_, Rank(24), &plain_report);
  ASSERT_TRUE(plain.ok()) << plain.status();
  CompressOptions o = Rank(24);
  for (size_t l = 0; l < source_->layers().size(); ++l) {
    o.whitening.push_back({at::eye(D_, at::kDouble), at::eye(D_, at::kDouble)});
  }
  auto white = ConvertToCollaborative(*source_, o, &white_report);
  ASSERT_TRUE(white.ok()) << white.status();
  for (size_t l = 0; l < source_->layers().size(); ++l) {
    const auto& a = (*plain)->layers()[l];
    const auto& b = (*white)->layers()[l];
    EXPECT_LT((a.collab_query_w - b.collab_query_w).abs().max().item<double>(), 1e-6);
    EXPECT_LT((a.collab_key_w - b.collab_key_w).abs().max().item<double>(), 1e-6);
    EXPECT_LT((a.mixing - b.mixing).abs().max().item<double>(), 1e-6);
    EXPECT_NEAR(white_report.layers[l].activation_error, plain_report.layers[l].relative_error, 1e-6);
    EXPECT_NEAR(white_report.layers[l].relative_error, plain_report.layers[l].relative_error, 1e-6);
    EXPECT_EQ(plain_report.layers[l].activation_error, -1);
  }
}

TEST_F(WhiteningTest, AnisotropicInputsGetALowerActivationError) {
  auto w = WhiteningFromStats(Anisotropic(0.85, 3), 0.01);
  ASSERT_TRUE(w.ok()) << w.status();
  CompressReport plain_report, white_report;
  auto plain = ConvertToCollaborative(*source_, Rank(16), &plain_report);
  ASSERT_TRUE(plain.ok()) << plain.status();
  CompressOptions o = Rank(16);
  o.whitening = *w;
  auto white = ConvertToCollaborative(*source_, o, &white_report);
  ASSERT_TRUE(white.ok()) << white.status();
  for (size_t l = 0; l < source_->layers().size(); ++l) {
    const double plain_act = ActivationError(**plain, l, (*w)[l]);
    const double white_act = ActivationError(**white, l, (*w)[l]);
    EXPECT_NEAR(white_act, white_report.layers[l].activation_error, 1e-4) << "the report's figure";
    EXPECT_LT(white_act, 0.8 * plain_act) << "layer " << l;
    // What it gives up: the weight-space error, which weighs directions no input takes.
    EXPECT_GT(white_report.layers[l].relative_error, plain_report.layers[l].relative_error);
  }
}

TEST_F(WhiteningTest, FullRankStaysExact) {
  auto w = WhiteningFromStats(Anisotropic(0.9, 4), 0.01);
  ASSERT_TRUE(w.ok());
  CompressOptions o = Rank(static_cast<int>(D_));
  o.whitening = *w;
  CompressReport r;
  auto c = ConvertToCollaborative(*source_, o, &r);
  ASSERT_TRUE(c.ok()) << c.status();
  at::manual_seed(0);
  at::Tensor ids = at::randint(1000, 2000, {3, 9}, at::kLong), types = at::zeros_like(ids);
  c10::InferenceMode guard;
  (*c)->Prepare(c10::Device(c10::kCPU), c10::kFloat, false);
  at::Tensor a = source_->Forward(ids, types, at::Tensor()), b = (*c)->Forward(ids, types, at::Tensor());
  EXPECT_LT((a - b).abs().max().item<double>(), 1e-4);
  for (const auto& l : r.layers) EXPECT_LT(l.relative_error, 1e-5);
}

TEST_F(WhiteningTest, StatisticsComeFromTheLayerInputs) {
  std::vector<std::string> texts(20, "a tool to edit text files");
  texts[3] = "a game with levels and a scoreboard";
  auto st = CollectCalibrationStats(*source_, dir_.path(), texts);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->texts, 20);
  ASSERT_EQ(st->second_moment.size(), source_->layers().size());
  // Layer 0's input is the embeddings' output: its mean over the tokens of the texts.
  auto tok = text::BertTokenizer::FromDirectory(dir_.path());
  ASSERT_TRUE(tok.ok());
  at::Tensor sum = at::zeros({D_}, at::kDouble), sum2 = at::zeros({D_, D_}, at::kDouble);
  int64_t tokens = 0;
  c10::InferenceMode guard;
  for (const auto& t : texts) {
    auto e = (*tok)->Encode(t, std::nullopt, 0, true);
    at::Tensor ids = at::tensor(std::vector<int64_t>(e->input_ids.begin(), e->input_ids.end())).view({1, -1});
    const at::Tensor x = source_->Embeddings(ids, at::zeros_like(ids)).view({-1, D_}).to(at::kDouble);
    sum += x.sum(0);
    sum2 += x.t().matmul(x);
    tokens += x.size(0);
  }
  EXPECT_EQ(st->tokens, tokens);
  EXPECT_LT((st->mean[0] - sum / static_cast<double>(tokens)).abs().max().item<double>(), 1e-5);
  // E[x xᵀ] (each batch's product is float32 on the CPU): within 1e-6 of its largest entry.
  const at::Tensor m2 = sum2 / static_cast<double>(tokens);
  EXPECT_EQ(st->second_moment[0].scalar_type(), at::kDouble);
  EXPECT_LT((st->second_moment[0] - m2).abs().max().item<double>(), 1e-6 * m2.abs().max().item<double>());
  auto w = WhiteningFromStats(*st, 0.01);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_THAT(WhiteningFromStats(*st, -1).status().message(), HasSubstr("damping"));
}

// whiten_compressed_inputs: layer 0 is whitened as before (its inputs do not depend on the
// compression); layer 1 by the inputs it gets once layer 0 is converted, which this test collects
// itself from that model and checks against the reported activation error.
TEST_F(WhiteningTest, CompressedInputsWhitenEachLayerByWhatItGetsInTheCompressedModel) {
  std::vector<std::string> texts;
  for (int i = 0; i < 40; ++i) {
    texts.push_back(std::string(i % 2 ? "a game with levels number " : "a tool to edit text files, version ") +
                    std::to_string(i));
  }
  auto run = [&](bool compressed_inputs, std::vector<int> ranks, const std::string& name) {
    CompressOptions o;
    o.spec.kind = RankSpec::Kind::kPerLayer;
    o.spec.ranks = std::move(ranks);
    o.calibration = texts;
    o.calibration_fit_fraction = 1.0;  // every text fits, so both variants see the same ones
    o.whiten_compressed_inputs = compressed_inputs;
    o.parallel_layers = 1;  // as the layer-by-layer variant runs: the same arithmetic, bit for bit
    return CompressLoadedModel(*source_, dir_.path(), dir_.path() + "/" + name, o);
  };
  auto load = [&](const std::string& name) { return compress_testing::LoadPrepared(dir_.path() + "/" + name); };
  auto seq = run(true, {8, 8}, "seq");
  ASSERT_TRUE(seq.ok()) << seq.status();
  auto orig = run(false, {8, 8}, "orig");
  ASSERT_TRUE(orig.ok()) << orig.status();
  auto first = run(false, {8, 0}, "first");  // layer 0 as both convert it, layer 1 standard
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_THAT(seq->whitening_note, HasSubstr("inputs in the compressed model"));
  auto seq_m = load("seq"), first_m = load("first");
  ASSERT_TRUE(seq_m && first_m);
  c10::InferenceMode guard;
  EXPECT_TRUE(at::equal(seq_m->layers()[0].collab_query_w, first_m->layers()[0].collab_query_w));
  EXPECT_NEAR(seq->layers[0].activation_error, orig->layers[0].activation_error, 1e-12);
  // Layer 1's statistics in the model whose layer 0 is converted.
  auto st = CollectCalibrationStats(*first_m, dir_.path(), texts);
  ASSERT_TRUE(st.ok()) << st.status();
  auto w = WhiteningFromStats(*st, 0.01);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_NEAR(ActivationError(*seq_m, 1, (*w)[1]), seq->layers[1].activation_error, 1e-4);
  EXPECT_GT(std::abs(seq->layers[1].activation_error - orig->layers[1].activation_error), 1e-4)
      << seq->layers[1].activation_error << " " << orig->layers[1].activation_error;

  // Refused without calibration text or with a target.
  CompressOptions bad;
  bad.whiten_compressed_inputs = true;
  bad.spec.rank = 8;
  auto r = CompressLoadedModel(*source_, dir_.path(), dir_.path() + "/bad", bad);
  EXPECT_THAT(r.status().message(), HasSubstr("needs calibration text and a fixed rank spec"));
  bad.calibration = texts;
  bad.spec.kind = RankSpec::Kind::kTargetAgreement;
  bad.spec.target_agreement = 0.9;
  r = CompressLoadedModel(*source_, dir_.path(), dir_.path() + "/bad", bad);
  EXPECT_THAT(r.status().message(), HasSubstr("needs calibration text and a fixed rank spec"));
}

TEST(CalibrationTextTest, ParsesLinesAndRefusesWhatIsNotText) {
  auto ok = ParseCalibrationText("one\r\n\n  \ntwo words\n", "c.txt");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, (std::vector<std::string>{"one", "two words"}));
  EXPECT_THAT(ParseCalibrationText("", "c.txt").status().message(), HasSubstr("c.txt: no text lines"));
  EXPECT_THAT(ParseCalibrationText(std::string("ab\0cd", 5), "c.txt").status().message(),
              HasSubstr("NUL byte at offset 2"));
  EXPECT_THAT(ParseCalibrationText("fine\n\xff\xfe bad\n", "c.txt").status().message(),
              HasSubstr("line 2 is not valid UTF-8"));
}

}  // namespace
}  // namespace collabserve::compress
