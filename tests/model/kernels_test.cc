// The CPU kernels against the ATen compositions they replace: PackedLinear against
// x · w^T + bias (+ residual) by at::addmm, LayerNormRowsInPlace against at::layer_norm, on odd
// shapes (partial panels and row tiles, K not a multiple of the k block, strided rows).
#include "server/model/kernels.h"

#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "server/model/pass_arena.h"
#include "server/util/process_memory.h"

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

TEST(NarrowProduct, EqualsAtenMatmul) {
  if (!PackedLinearSupported()) GTEST_SKIP() << "no AVX-512F";
  at::manual_seed(12);
  for (int64_t N : {1, 12, 13, 30}) {
    for (int64_t K : {1, 16, 40, 768}) {
      at::Tensor x = at::randn({5, K + 3}), w = at::randn({N, K});
      at::Tensor out = at::full({5, N + 2}, 7.0f);
      NarrowProduct(x.data_ptr<float>(), K + 3, 5, w.data_ptr<float>(), N, K, out.data_ptr<float>(), N + 2);
      EXPECT_LT(RelErr(out.narrow(1, 0, N), at::mm(x.narrow(1, 0, K), w.t())), 1e-5) << N << " x " << K;
      EXPECT_TRUE(out.narrow(1, N, 2).eq(7.0f).all().item<bool>());
      // A row's result does not depend on the other rows in the call.
      at::Tensor one = at::empty({1, N});
      NarrowProduct(x.data_ptr<float>() + 3 * (K + 3), K + 3, 1, w.data_ptr<float>(), N, K, one.data_ptr<float>(), N);
      EXPECT_TRUE(at::equal(one[0], out.narrow(1, 0, N)[3]));
    }
  }
}

TEST(PackKeys, PanelsOf32KeysPaddedWithZeros) {
  if (!PackedLinearSupported()) GTEST_SKIP() << "no AVX-512F";
  for (int64_t S : {1, 8, 31, 32, 45, 77}) {
    const int64_t width = 13, ld = width + 3;
    at::Tensor k = at::randn({S, ld});
    std::vector<float> packed(PackedKeysSize(S, width), 7.0f);
    ASSERT_EQ(static_cast<int64_t>(packed.size()), (S + 31) / 32 * 32 * width);
    PackKeys(k.data_ptr<float>(), ld, S, width, packed.data());
    for (int64_t j = 0; j < (S + 31) / 32 * 32; ++j) {
      for (int64_t d = 0; d < width; ++d) {
        const float want = j < S ? k[j][d].item<float>() : 0.0f;
        ASSERT_EQ(packed[((j / 32) * width + d) * 32 + j % 32], want) << "S " << S << " key " << j << " d " << d;
      }
    }
  }
}

// Attention against the ATen composition it replaces (scale · q diag(f) kᵀ, additive key terms,
// softmax, · v), with strided q/k/v as in the fused projection, partial key panels, masked
// positions and one sequence whose keys are all masked (softmax of equal scores: uniform, as in
// ATen). Standard heads (width = dv = dk, a scale) and collaborative ones (a score width R below,
// equal to and above dv, a query factor = the head's mixing row, queries and keys in other columns
// than the values); value widths that are and are not multiples of 16 and 32. Both kernels (scores
// in registers up to 64 positions, on the micro-kernel above) for every S where both run: they
// sum in the same order, so they agree bit for bit.
AttentionHead Head(const at::Tensor& q, const float* keys, const at::Tensor& v, const float* factor,
                   float scale, const float* add) {
  AttentionHead a;
  a.q = q.data_ptr<float>();
  a.keys = keys;
  a.v = v.data_ptr<float>();
  a.ldq = q.stride(0);
  a.ldv = v.stride(0);
  a.width = q.size(1);
  a.dv = v.size(1);
  a.query_factor = factor;
  a.scale = scale;
  a.key_add = add;
  return a;
}

TEST(Attention, EqualsAtenSoftmaxAttention) {
  if (!PackedLinearSupported()) GTEST_SKIP() << "no AVX-512F";
  c10::InferenceMode guard;
  at::manual_seed(8);
  struct Shape { int64_t width, dv; bool collaborative; };
  for (const Shape& sh : {Shape{16, 16, false}, Shape{64, 64, false}, Shape{128, 128, false},
                          Shape{24, 64, true}, Shape{64, 64, true}, Shape{200, 64, true},
                          Shape{7, 32, true}, Shape{40, 40, false}, Shape{33, 72, true}}) {
    const int64_t width = sh.width, dv = sh.dv;
    for (int64_t S : {1, 5, 16, 17, 33, 48, 64, 65, 100, 128, 200}) {
      const int64_t ld = 2 * width + dv + 7;
      at::Tensor p = at::randn({S, ld});
      at::Tensor q = p.narrow(1, 0, width), k = p.narrow(1, width, width);
      at::Tensor v = p.narrow(1, 2 * width + 3, dv);
      std::vector<float> keys(PackedKeysSize(S, width));
      PackKeys(k.data_ptr<float>(), ld, S, width, keys.data());
      std::vector<float> work(AttentionWorkSize(S, S, width, dv));
      at::Tensor factor = at::randn({width});
      const float scale = sh.collaborative ? 1.0f : 1.0f / std::sqrt(static_cast<float>(width));
      const float* f = sh.collaborative ? factor.data_ptr<float>() : nullptr;
      at::Tensor qf = sh.collaborative ? q * factor : q;
      for (int masking = 0; masking < 3; ++masking) {
        at::Tensor mask = sh.collaborative ? at::randn({S}) : at::zeros({S});
        if (masking == 1) mask.narrow(0, S / 2, S - S / 2).fill_(std::numeric_limits<float>::lowest());
        if (masking == 2) mask.fill_(std::numeric_limits<float>::lowest());
        const float* add = masking == 0 && !sh.collaborative ? nullptr : mask.data_ptr<float>();
        at::Tensor want = at::matmul(at::_softmax(at::matmul(qf, k.t()) * scale + mask, -1, false), v);
        const AttentionHead head = Head(q, keys.data(), v, f, scale, add);
        const std::string what = "S " + std::to_string(S) + " width " + std::to_string(width) +
                                 " dv " + std::to_string(dv) + " mask " + std::to_string(masking);
        at::Tensor ctx = at::full({S, dv + 2}, 7.0f);
        Attention(head, S, S, ctx.data_ptr<float>(), dv + 2, work.data(), kSmallAttentionMaxS);
        EXPECT_LT(RelErr(ctx.narrow(1, 0, dv), want), 1e-5) << what;
        EXPECT_TRUE(ctx.narrow(1, dv, 2).eq(7.0f).all().item<bool>()) << what;
        // The micro-kernel form (small_max_s 0) where the register form ran: the same bits.
        if (S <= kSmallAttentionMaxS) {
          at::Tensor panel = at::full({S, dv + 2}, 7.0f);
          Attention(head, S, S, panel.data_ptr<float>(), dv + 2, work.data(), 0);
          EXPECT_TRUE(at::equal(panel, ctx)) << what << " (micro-kernel form)";
        }
        // The queries packed by the caller (as a collaborative layer's heads share them): the
        // micro-kernel form reads them, the same bits.
        {
          std::vector<float> packed_q(PackedRowsSize(S, width));
          PackRows(q.data_ptr<float>(), ld, 0, S, 0, width, width, packed_q.data());
          AttentionHead with = head;
          with.packed_q = packed_q.data();
          at::Tensor from_packed = at::full({S, dv + 2}, 7.0f);
          Attention(with, S, S, from_packed.data_ptr<float>(), dv + 2, work.data(), 0);
          EXPECT_TRUE(at::equal(from_packed, ctx)) << what << " (queries packed by the caller)";
        }
        // Only the first `queries` positions: the same rows bit for bit, nothing written past them.
        for (int64_t queries : {int64_t{1}, (S + 1) / 2}) {
          at::Tensor part = at::full({S, dv + 2}, 7.0f);
          Attention(head, S, queries, part.data_ptr<float>(), dv + 2, work.data(), kSmallAttentionMaxS);
          EXPECT_TRUE(at::equal(part.narrow(0, 0, queries), ctx.narrow(0, 0, queries)))
              << what << " queries " << queries;
          EXPECT_TRUE(part.narrow(0, queries, S - queries).eq(7.0f).all().item<bool>());
        }
        // Padding keys after the sequence's own (key terms lowest(), as a padded batch's mask has
        // them): its rows do not change, bit for bit, in either form (unless all its own keys are
        // masked too: then the padding keys count as much as they do).
        if (add != nullptr && (masking == 0 || (masking == 1 && S > 1))) {
          const int64_t P = S + 37;
          at::Tensor pp = at::randn({P, ld});
          pp.narrow(0, 0, S).copy_(p);
          std::vector<float> pkeys(PackedKeysSize(P, width));
          PackKeys(pp.data_ptr<float>() + width, ld, P, width, pkeys.data());
          at::Tensor padd = at::full({P}, std::numeric_limits<float>::lowest());
          padd.narrow(0, 0, S).copy_(mask);
          std::vector<float> pwork(AttentionWorkSize(P, S, width, dv));
          AttentionHead ph = Head(pp.narrow(1, 0, width), pkeys.data(), pp.narrow(1, 2 * width + 3, dv), f,
                                  scale, padd.data_ptr<float>());
          for (int64_t small : {kSmallAttentionMaxS, int64_t{0}}) {
            at::Tensor padded = at::full({S, dv + 2}, 7.0f);
            Attention(ph, P, S, padded.data_ptr<float>(), dv + 2, pwork.data(), small);
            EXPECT_TRUE(at::equal(padded, ctx)) << what << " padded to " << P << ", small_max_s " << small;
          }
        }
      }
    }
  }
  at::Tensor x = at::zeros({4, 24});
  std::vector<float> keys(PackedKeysSize(4, 24)), work(AttentionWorkSize(4, 4, 24, 24));
  AttentionHead empty = Head(x.narrow(1, 0, 0), keys.data(), x, nullptr, 1.0f, nullptr);
  EXPECT_THROW(Attention(empty, 4, 4, x.data_ptr<float>(), 24, work.data()), c10::Error);
  for (int64_t queries : {0, 5}) {
    EXPECT_THROW(Attention(Head(x, keys.data(), x, nullptr, 1.0f, nullptr), 4, queries,
                           x.data_ptr<float>(), 24, work.data()),
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

// A model that keeps only the packed form gets its plain weight back exactly: whole, and in
// blocks of columns laid out for a GEMM ([K, n] row-major), a partial last panel included.
TEST(PackedWeight, UnpacksExactly) {
  c10::InferenceMode guard;
  at::manual_seed(12);
  at::Tensor w = at::randn({100, 37});
  PackedWeight p(w);
  EXPECT_TRUE(at::equal(p.Unpack(), w));
  EXPECT_EQ(p.bytes(), 4 * 37 * 32 * 4);
  for (auto [n0, n1] : {std::pair<int64_t, int64_t>{0, 100}, {32, 64}, {64, 100}, {96, 100}, {32, 32}}) {
    at::Tensor block = at::full({37, n1 - n0}, 9.0f);
    p.UnpackColumns(n0, n1, block.data_ptr<float>());
    EXPECT_TRUE(at::equal(block, w.narrow(0, n0, n1 - n0).t())) << n0 << ".." << n1;
  }
  // Ranges filled one by one into one [K, N] buffer (as the members of a team do, each its own),
  // leaving the other columns as they were.
  at::Tensor whole = at::full({37, 100}, 9.0f);
  p.UnpackColumns(64, 100, whole.data_ptr<float>() + 64, 100);
  EXPECT_TRUE(at::equal(whole.narrow(1, 0, 64), at::full({37, 64}, 9.0f)));
  p.UnpackColumns(0, 64, whole.data_ptr<float>(), 100);
  EXPECT_TRUE(at::equal(whole, w.t()));
  at::Tensor out = at::empty({37 * 100});
  EXPECT_THROW(p.UnpackColumns(16, 64, out.data_ptr<float>()), c10::Error);
  EXPECT_THROW(p.UnpackColumns(0, 101, out.data_ptr<float>()), c10::Error);
  EXPECT_THROW(p.UnpackColumns(0, 64, out.data_ptr<float>(), 63), c10::Error);
}

// A packed weight holds pages of its own: resident while it lives, its bytes and not an
// allocator's size class (jemalloc would put a 3.5 MiB weight in a 4 MiB one), and given back to
// the system when it is destroyed.
TEST(PackedWeight, HoldsItsOwnPagesAndGivesThemBack) {
  c10::InferenceMode guard;
  const at::Tensor w = at::ones({1184, 768});  // 37 panels: 3.47 MiB packed
  auto rss = [] {
    auto m = util::ReadProcessMemory();
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? m->rss_bytes : int64_t{0};
  };
  const int64_t before = rss();
  int64_t bytes = 0, during = 0;
  {
    std::vector<std::unique_ptr<PackedWeight>> weights;
    for (int i = 0; i < 8; ++i) {
      weights.push_back(std::make_unique<PackedWeight>(w));
      bytes += weights.back()->bytes();
    }
    during = rss();
  }
  const int64_t after = rss();
  // Under ASan each mapping's shadow (a byte per eight) becomes resident too, and stays after the
  // munmap: 4.6 MB after 8 of these weights (29 MB), 8.2 MB after 16.
#if defined(__SANITIZE_ADDRESS__)
  const int64_t shadow = bytes / 8;
#else
  const int64_t shadow = 0;
#endif
  EXPECT_GE(during - before, bytes * 95 / 100);
  EXPECT_LE(during - before, bytes + shadow + (int64_t{4} << 20));
  EXPECT_LE(after - before, shadow + (int64_t{2} << 20))
      << "before " << before << ", during " << during << ", packed bytes " << bytes;
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

// One lease at a time; a later lease finds the pages (and what the last pass left in them) where
// they were, and the mapping grows for a larger one.
TEST(PassArena, LeasesOneAtATimeAndKeepsItsPages) {
  PassArena arena(std::chrono::hours(1));
  EXPECT_EQ(arena.mapped_bytes(), 0);
  EXPECT_THROW(arena.TryLease(0), c10::Error);
  float* first = nullptr;
  {
    PassArena::Lease a = arena.TryLease(100000);
    ASSERT_TRUE(a);
    first = a.data();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
    EXPECT_FALSE(arena.TryLease(1)) << "a second lease while the first is live";
    for (int64_t i = 0; i < 100000; ++i) first[i] = static_cast<float>(i);
    EXPECT_GE(arena.mapped_bytes(), int64_t{400000});
    EXPECT_GE(arena.resident_bytes(), int64_t{400000});
  }
  {
    PassArena::Lease b = arena.TryLease(50000);
    ASSERT_TRUE(b);
    EXPECT_EQ(b.data(), first);
    EXPECT_EQ(b.data()[49999], 49999.0f);
    PassArena::Lease moved = std::move(b);
    EXPECT_FALSE(b);  // NOLINT(bugprone-use-after-move): a moved-from lease is empty
    EXPECT_FALSE(arena.TryLease(1)) << "the moved lease is still live";
  }
  PassArena::Lease big = arena.TryLease(1000000);
  ASSERT_TRUE(big);
  EXPECT_GE(arena.mapped_bytes(), int64_t{4000000});
  big.data()[999999] = 1.0f;
}

// Leases `floats` floats, writes every one (its pages are then resident), and ends the lease.
void WriteALease(PassArena& arena, int64_t floats) {
  PassArena::Lease a = arena.TryLease(floats);
  ASSERT_TRUE(a);
  for (int64_t i = 0; i < floats; ++i) a.data()[i] = 1.0f;
  EXPECT_GE(arena.resident_bytes(), floats * 4);
}

// Waits (up to 20 s) for the idle release; true once nothing is resident.
bool ReleasedWhenIdle(const PassArena& arena) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (arena.resident_bytes() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return arena.resident_bytes() == 0;
}

// After idle_release without a lease the pages go back to the system (and read as zeros).
TEST(PassArena, GivesItsPagesBackWhenIdle) {
  PassArena arena(std::chrono::milliseconds(50));
  constexpr int64_t kFloats = int64_t{1} << 20;  // 4 MiB
  WriteALease(arena, kFloats);
  EXPECT_TRUE(ReleasedWhenIdle(arena));
  EXPECT_GE(arena.mapped_bytes(), kFloats * 4);
  PassArena::Lease again = arena.TryLease(kFloats);
  ASSERT_TRUE(again);
  EXPECT_EQ(again.data()[kFloats - 1], 0.0f);
  // ReleaseIfIdle: not while a lease is live; at once after.
  again.data()[0] = 2.0f;
  arena.ReleaseIfIdle();
  EXPECT_GT(arena.resident_bytes(), 0);
  again = PassArena::Lease();
  arena.ReleaseIfIdle();
  EXPECT_EQ(arena.resident_bytes(), 0);
}

// A live Pass holds the idle release off, as a lease does; the release follows the last Pass.
TEST(PassArena, APassHoldsTheIdleReleaseOff) {
  PassArena arena(std::chrono::milliseconds(50));
  constexpr int64_t kFloats = int64_t{1} << 20;  // 4 MiB
  WriteALease(arena, kFloats);
  std::optional<PassArena::Pass> first(arena.BeginPass());
  std::optional<PassArena::Pass> second;
  std::thread([&] { second.emplace(arena.BeginPass()); }).join();  // Passes on any thread
  std::this_thread::sleep_for(std::chrono::milliseconds(300));     // 6 idle periods
  EXPECT_GE(arena.resident_bytes(), kFloats * 4);
  arena.ReleaseIfIdle();
  EXPECT_GE(arena.resident_bytes(), kFloats * 4) << "ReleaseIfIdle with Passes live";
  {
    PassArena::Pass moved = std::move(*first);
    first.reset();  // the moved-from Pass ends nothing
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    EXPECT_GE(arena.resident_bytes(), kFloats * 4);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_GE(arena.resident_bytes(), kFloats * 4) << "one Pass is still live";
  second.reset();
  EXPECT_TRUE(ReleasedWhenIdle(arena));
}

}  // namespace
}  // namespace collabserve::model
