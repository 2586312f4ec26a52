// The CPU kernels against the ATen compositions they replace: PackedLinear against
// x · w^T + bias (+ residual) by at::addmm, LayerNormRowsInPlace against at::layer_norm, on odd
// shapes (partial panels and row tiles, K not a multiple of the k block, strided rows).
#include "server/model/kernels.h"

#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include <atomic>
#include <limits>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

namespace collabserve::model {
namespace {

// max |a - b| / (1 + max |b|): the products sum hundreds of terms in a different order than BLAS.
double RelErr(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / (1.0 + b.abs().max().item<double>());
}

class PackedLinearTest : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t>> {
 protected:
  void SetUp() override {
    if (!PackedLinearSupported()) GTEST_SKIP() << "this CPU has no AVX-512F: PackedLinear is never used here";
  }
};

TEST_P(PackedLinearTest, EqualsAddmmWithBiasAndResidual) {
  c10::InferenceMode guard;
  const auto [rows, n, k] = GetParam();
  at::manual_seed(rows * 1000 + n * 10 + k);
  // Strided rows: x and out live in wider buffers, as q/k/v do inside the fused projection.
  at::Tensor xbuf = at::randn({rows, k + 3}), w = at::randn({n, k}), b = at::randn({n});
  at::Tensor res = at::randn({rows, n + 5}), out = at::full({rows, n + 2}, 7.0f);
  at::Tensor x = xbuf.narrow(1, 1, k), r = res.narrow(1, 0, n);
  PackedWeight pw(w);
  EXPECT_EQ(pw.n(), n);
  EXPECT_EQ(pw.k(), k);

  PackedLinear(x.data_ptr<float>(), k + 3, rows, pw, b.data_ptr<float>(), r.data_ptr<float>(),
               n + 5, out.data_ptr<float>(), n + 2);
  at::Tensor want = at::addmm(r + b, x, w.t());
  EXPECT_LT(RelErr(out.narrow(1, 0, n), want), 1e-5);
  // The padding columns of out are not written.
  EXPECT_TRUE(out.narrow(1, n, 2).eq(7.0f).all().item<bool>());

  // No bias, no residual.
  PackedLinear(x.data_ptr<float>(), k + 3, rows, pw, nullptr, nullptr, 0, out.data_ptr<float>(), n + 2);
  EXPECT_LT(RelErr(out.narrow(1, 0, n), at::mm(x, w.t())), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Shapes, PackedLinearTest,
                         ::testing::Values(std::make_tuple(1, 1, 1), std::make_tuple(1, 32, 768),
                                           std::make_tuple(7, 17, 5), std::make_tuple(8, 33, 300),
                                           std::make_tuple(9, 100, 513), std::make_tuple(16, 64, 256),
                                           std::make_tuple(130, 48, 257),
                                           std::make_tuple(600, 40, 70)));

TEST(PackedLinear, OutputMayBeTheResidual) {
  if (!PackedLinearSupported()) GTEST_SKIP() << "no AVX-512F";
  c10::InferenceMode guard;
  at::manual_seed(3);
  at::Tensor x = at::randn({20, 50}), w = at::randn({45, 50}), b = at::randn({45}), r = at::randn({20, 45});
  at::Tensor want = at::addmm(r + b, x, w.t());
  PackedWeight pw(w);
  PackedLinear(x.data_ptr<float>(), 50, 20, pw, b.data_ptr<float>(), r.data_ptr<float>(), 45,
               r.data_ptr<float>(), 45);
  EXPECT_LT(RelErr(r, want), 1e-5);
}

TEST(PackedLinear, ARowsResultDoesNotDependOnTheOtherRows) {
  if (!PackedLinearSupported()) GTEST_SKIP() << "no AVX-512F";
  c10::InferenceMode guard;
  at::manual_seed(4);
  const int64_t k = 3072, n = 100;
  at::Tensor x = at::randn({300, k}), w = at::randn({n, k}), b = at::randn({n});
  PackedWeight pw(w);
  at::Tensor all = at::empty({300, n});
  PackedLinear(x.data_ptr<float>(), k, 300, pw, b.data_ptr<float>(), nullptr, 0, all.data_ptr<float>(), n);
  for (int64_t row : {0, 7, 8, 150, 299}) {
    at::Tensor one = at::empty({1, n});
    PackedLinear(x[row].data_ptr<float>(), k, 1, pw, b.data_ptr<float>(), nullptr, 0, one.data_ptr<float>(), n);
    EXPECT_TRUE(at::equal(one[0], all[row])) << "row " << row;
  }
}

TEST(PackedLinearColumns, PiecesEqualTheWholeBitForBit) {
  if (!PackedLinearSupported()) GTEST_SKIP() << "no AVX-512F";
  c10::InferenceMode guard;
  at::manual_seed(6);
  const int64_t n = 150, k = 300;  // a partial last panel
  for (int64_t rows : {3, 16, 100}) {
    at::Tensor x = at::randn({rows, k}), w = at::randn({n, k}), b = at::randn({n}), r = at::randn({rows, n});
    PackedWeight pw(w);
    at::Tensor whole = at::empty({rows, n}), pieces = at::full({rows, n}, 7.0f);
    PackedLinear(x.data_ptr<float>(), k, rows, pw, b.data_ptr<float>(), r.data_ptr<float>(), n,
                 whole.data_ptr<float>(), n);
    // Columns [32, 96) first: the others stay untouched.
    PackedLinearColumns(x.data_ptr<float>(), k, rows, pw, b.data_ptr<float>(), r.data_ptr<float>(), n,
                        pieces.data_ptr<float>(), n, 32, 96);
    EXPECT_TRUE(pieces.narrow(1, 0, 32).eq(7.0f).all().item<bool>());
    EXPECT_TRUE(pieces.narrow(1, 96, n - 96).eq(7.0f).all().item<bool>());
    for (auto [b0, b1] : {std::pair<int64_t, int64_t>{0, 32}, {96, 128}, {128, n}}) {
      PackedLinearColumns(x.data_ptr<float>(), k, rows, pw, b.data_ptr<float>(), r.data_ptr<float>(), n,
                          pieces.data_ptr<float>(), n, b0, b1);
    }
    EXPECT_TRUE(at::equal(pieces, whole)) << rows << " rows";
  }
  at::Tensor x = at::randn({2, k}), out = at::empty({2, n});
  PackedWeight pw(at::randn({n, k}));
  EXPECT_THROW(PackedLinearColumns(x.data_ptr<float>(), k, 2, pw, nullptr, nullptr, 0,
                                   out.data_ptr<float>(), n, 16, 64),
               c10::Error);
  EXPECT_THROW(PackedLinearColumns(x.data_ptr<float>(), k, 2, pw, nullptr, nullptr, 0,
                                   out.data_ptr<float>(), n, 0, n + 1),
               c10::Error);
}

// A team packs an activation in pieces (each member its rows, or its k range) and every member
// then runs its columns on the shared copy: the result must be PackedLinear's, bit for bit.
TEST(PackedLinearColumnsPacked, PackedInPiecesEqualsPackedLinearBitForBit) {
  if (!PackedLinearSupported()) GTEST_SKIP() << "no AVX-512F";
  c10::InferenceMode guard;
  at::manual_seed(7);
  const int64_t n = 150, k = 300;  // a partial last panel; k not a multiple of the 8-wide transpose
  for (int64_t rows : {1, 3, 16, 45, 130, 600}) {
    // Strided rows, as inside the fused projection.
    at::Tensor xbuf = at::randn({rows, k + 5}), w = at::randn({n, k}), b = at::randn({n});
    at::Tensor x = xbuf.narrow(1, 2, k), r = at::randn({rows, n});
    PackedWeight pw(w);
    at::Tensor whole = at::empty({rows, n});
    PackedLinear(x.data_ptr<float>(), k + 5, rows, pw, b.data_ptr<float>(), r.data_ptr<float>(), n,
                 whole.data_ptr<float>(), n);
    // By rows (a cut inside a tile) and, separately, by k ranges.
    at::Tensor by_rows = at::full({PackedRowsSize(rows, k)}, 7.0f);
    at::Tensor by_k = at::full({PackedRowsSize(rows, k)}, 7.0f);
    const int64_t cut = rows / 3;
    PackRows(x.data_ptr<float>(), k + 5, 0, cut, 0, k, k, by_rows.data_ptr<float>());
    PackRows(x.data_ptr<float>(), k + 5, cut, rows, 0, k, k, by_rows.data_ptr<float>());
    for (auto [k0, k1] : {std::pair<int64_t, int64_t>{0, 13}, {13, 160}, {160, k}}) {
      PackRows(x.data_ptr<float>(), k + 5, 0, rows, k0, k1, k, by_k.data_ptr<float>());
    }
    for (const at::Tensor& packed : {by_rows, by_k}) {
      at::Tensor out = at::full({rows, n}, 7.0f);
      for (auto [n0, n1] : {std::pair<int64_t, int64_t>{0, 64}, {64, n}}) {
        PackedLinearColumnsPacked(packed.data_ptr<float>(), rows, pw, b.data_ptr<float>(),
                                  r.data_ptr<float>(), n, out.data_ptr<float>(), n, n0, n1);
      }
      EXPECT_TRUE(at::equal(out, whole)) << rows << " rows";
    }
    // The layout itself: row i, column j at tile i / 8, offset j · 8 + i % 8.
    const float* p = by_k.data_ptr<float>();
    for (int64_t i : {int64_t{0}, rows / 2, rows - 1}) {
      for (int64_t j : {int64_t{0}, int64_t{7}, int64_t{8}, k - 1}) {
        EXPECT_EQ(p[(i / kPackedRowTile) * k * kPackedRowTile + j * kPackedRowTile + i % kPackedRowTile],
                  x[i][j].item<float>());
      }
    }
  }
  EXPECT_EQ(PackedRowsSize(9, 10), 16 * 10);
  at::Tensor x = at::randn({2, 4}), packed = at::empty({PackedRowsSize(2, 4)});
  EXPECT_THROW(PackRows(x.data_ptr<float>(), 4, 0, 2, 2, 5, 4, packed.data_ptr<float>()), c10::Error);
  PackedWeight pw(at::randn({40, 4}));
  at::Tensor out = at::empty({2, 40});
  EXPECT_THROW(PackedLinearColumnsPacked(packed.data_ptr<float>(), 2, pw, nullptr, nullptr, 0,
                                         out.data_ptr<float>(), 40, 8, 40),
               c10::Error);
}

// SmallAttention against the ATen composition it replaces (scores, additive mask, softmax, · v),
// with strided q/k/v as in the fused projection, a partial key tile, masked positions and one
// sequence whose keys are all masked (softmax of equal scores: uniform, as in ATen).
TEST(SmallAttention, EqualsAtenSoftmaxAttention) {
  if (!PackedLinearSupported()) GTEST_SKIP() << "no AVX-512F";
  c10::InferenceMode guard;
  at::manual_seed(8);
  for (int64_t dk : {16, 64, 128}) {
    for (int64_t S : {1, 5, 16, 17, 33, 48, 64}) {
      ASSERT_TRUE(SmallAttentionSupported(S, dk));
      const int64_t ld = 3 * dk + 7;
      at::Tensor p = at::randn({S, ld});
      at::Tensor q = p.narrow(1, 0, dk), k = p.narrow(1, dk, dk), v = p.narrow(1, 2 * dk + 3, dk);
      for (int masking = 0; masking < 3; ++masking) {
        at::Tensor mask = at::zeros({S});
        if (masking == 1) mask.narrow(0, S / 2, S - S / 2).fill_(std::numeric_limits<float>::lowest());
        if (masking == 2) mask.fill_(std::numeric_limits<float>::lowest());
        at::Tensor want = at::matmul(at::_softmax(at::matmul(q, k.t()) + mask, -1, false), v);
        at::Tensor ctx = at::full({S, dk + 2}, 7.0f);
        SmallAttention(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), ld,
                       masking == 0 ? nullptr : mask.data_ptr<float>(), S, dk,
                       ctx.data_ptr<float>(), dk + 2, S);
        EXPECT_LT(RelErr(ctx.narrow(1, 0, dk), want), 1e-5) << "S " << S << " dk " << dk << " mask " << masking;
        EXPECT_TRUE(ctx.narrow(1, dk, 2).eq(7.0f).all().item<bool>());
        // Only the first `queries` positions: the same rows bit for bit, nothing written past them.
        for (int64_t queries : {int64_t{1}, (S + 1) / 2}) {
          at::Tensor part = at::full({S, dk + 2}, 7.0f);
          SmallAttention(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), ld,
                         masking == 0 ? nullptr : mask.data_ptr<float>(), S, dk,
                         part.data_ptr<float>(), dk + 2, queries);
          EXPECT_TRUE(at::equal(part.narrow(0, 0, queries), ctx.narrow(0, 0, queries)))
              << "S " << S << " dk " << dk << " mask " << masking << " queries " << queries;
          EXPECT_TRUE(part.narrow(0, queries, S - queries).eq(7.0f).all().item<bool>());
        }
      }
    }
  }
  EXPECT_FALSE(SmallAttentionSupported(kSmallAttentionMaxS + 1, 64));
  EXPECT_FALSE(SmallAttentionSupported(16, 24));
  EXPECT_FALSE(SmallAttentionSupported(0, 64));
  at::Tensor x = at::zeros({4, 24});
  EXPECT_THROW(SmallAttention(x.data_ptr<float>(), x.data_ptr<float>(), x.data_ptr<float>(), 24,
                              nullptr, 4, 24, x.data_ptr<float>(), 24, 4),
               c10::Error);
  at::Tensor y = at::zeros({4, 48});
  for (int64_t queries : {0, 5}) {
    EXPECT_THROW(SmallAttention(y.data_ptr<float>(), y.data_ptr<float>() + 16, y.data_ptr<float>() + 32,
                                48, nullptr, 4, 16, y.data_ptr<float>(), 48, queries),
                 c10::Error);
  }
}

TEST(GeluRowsInPlace, EqualsAtenGelu) {
  if (!PackedLinearSupported()) GTEST_SKIP() << "no AVX-512F";
  c10::InferenceMode guard;
  at::manual_seed(9);
  at::Tensor x = at::randn({5, 70}) * 4;
  x[0][3] = 0.0f;
  x[0][4] = -30.0f;
  x[0][5] = 30.0f;
  at::Tensor want = x.clone();
  want.narrow(1, 3, 60) = at::gelu(x.narrow(1, 3, 60));
  GeluRowsInPlace(x.data_ptr<float>(), 70, 5, 3, 63);  // 60 columns: 3 vectors and a partial one
  EXPECT_TRUE(at::equal(x.narrow(1, 0, 3), want.narrow(1, 0, 3)));   // untouched
  EXPECT_TRUE(at::equal(x.narrow(1, 63, 7), want.narrow(1, 63, 7)));
  EXPECT_LT((x - want).abs().max().item<double>(), 2e-6);
}

TEST(PackedWeight, RejectsWhatItCannotPack) {
  c10::InferenceMode guard;
  EXPECT_THROW(PackedWeight(at::zeros({4, 4}, at::kDouble)), c10::Error);
  EXPECT_THROW(PackedWeight(at::zeros({4})), c10::Error);
}

TEST(LayerNormRowsInPlace, OneColumnGivesTheBias) {
  at::Tensor x = at::full({2, 1}, 5.0f), g = at::full({1}, 3.0f), b = at::full({1}, -0.5f);
  LayerNormRowsInPlace(x.data_ptr<float>(), 1, 2, 1, g.data_ptr<float>(), b.data_ptr<float>(), 1e-12);
  EXPECT_EQ(x[0][0].item<float>(), -0.5f);
  EXPECT_EQ(x[1][0].item<float>(), -0.5f);
}

TEST(LayerNormRowsInPlace, EqualsAtenLayerNorm) {
  c10::InferenceMode guard;
  at::manual_seed(5);
  for (int64_t d : {15, 37, 768}) {
    for (int64_t rows : {1, 3, 100}) {
      // Rows with a large common offset: a one-pass variance would lose the small spread.
      at::Tensor buf = at::randn({rows, d + 4}) * 3 + 50, g = at::randn({d}), bt = at::randn({d});
      at::Tensor x = buf.narrow(1, 0, d);
      at::Tensor want = at::layer_norm(x, {d}, g, bt, 1e-12);
      at::Tensor pad_before = buf.narrow(1, d, 4).clone();
      LayerNormRowsInPlace(x.data_ptr<float>(), d + 4, rows, d, g.data_ptr<float>(), bt.data_ptr<float>(), 1e-12);
      EXPECT_LT(RelErr(x, want), 1e-5) << "d=" << d << " rows=" << rows;
      EXPECT_TRUE(at::equal(buf.narrow(1, d, 4), pad_before));
    }
  }
}

TEST(ThreadTeam, MembersRunTogetherAndStepsAreOrdered) {
  for (int n : {1, 2, 3}) {
    std::atomic<int> entered{0}, step_one{0};
    std::atomic<bool> out_of_order{false};
    std::vector<int> seen(n, -1);
    bool ran = ThreadTeam::Shared().TryRun(n, [&](int member, int members) {
      seen[member] = members;
      ThreadTeam& team = ThreadTeam::Shared();
      team.Step([&] { entered.fetch_add(1); });
      // Every member finished the first step before any starts the second.
      team.Step([&] {
        if (entered.load() != n) out_of_order = true;
        step_one.fetch_add(1);
      });
    });
    EXPECT_TRUE(ran);
    EXPECT_EQ(entered.load(), n);
    EXPECT_EQ(step_one.load(), n);
    EXPECT_FALSE(out_of_order.load());
    for (int m = 0; m < n; ++m) EXPECT_EQ(seen[m], n) << "member " << m << " of " << n;
  }
}

TEST(ThreadTeam, AFailingStepIsRethrownAndTheTeamStaysUsable) {
  std::atomic<int> later_steps{0};
  EXPECT_THROW(ThreadTeam::Shared().TryRun(2, [&](int member, int) {
    ThreadTeam& team = ThreadTeam::Shared();
    team.Step([&] { TORCH_CHECK(member != 1, "member 1 fails"); });
    team.Step([&] { later_steps.fetch_add(1); });  // skipped after a failure
  }), c10::Error);
  EXPECT_EQ(later_steps.load(), 0);
  std::atomic<int> runs{0};
  EXPECT_TRUE(ThreadTeam::Shared().TryRun(2, [&](int, int) { runs.fetch_add(1); }));
  EXPECT_EQ(runs.load(), 2);
}

TEST(ThreadTeam, OneRunAtATime) {
  bool other = true;
  EXPECT_TRUE(ThreadTeam::Shared().TryRun(2, [&](int member, int) {
    if (member == 0) {
      std::thread t([&] { other = ThreadTeam::Shared().TryRun(2, [](int, int) {}); });
      t.join();
    }
  }));
  EXPECT_FALSE(other);
}

}  // namespace
}  // namespace collabserve::model
