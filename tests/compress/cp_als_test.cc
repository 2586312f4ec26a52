#include "server/compress/cp_als.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <tuple>

namespace collabserve::compress {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kHeads = 4, kDim = 32, kHeadSize = 8;

at::Tensor Randn(at::IntArrayRef shape, uint64_t seed) {
  return at::randn(shape, at::make_generator<at::CPUGeneratorImpl>(seed),
                   at::TensorOptions().dtype(at::kDouble));
}

struct Factors {
  at::Tensor P, Q;
};

Factors RandomFactors(uint64_t seed) {
  return {Randn({kHeads, kDim, kHeadSize}, seed), Randn({kHeads, kDim, kHeadSize}, seed + 1)};
}

at::Tensor Materialize(const Factors& f) { return at::matmul(f.P, f.Q.transpose(1, 2)); }

// T̂_i = B diag(A_i) Cᵀ.
at::Tensor Reconstruct(const at::Tensor& A, const at::Tensor& B, const at::Tensor& C) {
  return at::einsum("ir,jr,kr->ijk", {A.to(at::kDouble), B.to(at::kDouble), C.to(at::kDouble)});
}

double DenseRelativeError(const at::Tensor& T, const at::Tensor& T_hat) {
  return ((T - T_hat).norm() / T.norm()).item<double>();
}

CpAlsOptions Options(int rank, int max_iters = 50,
                     CpAlsOptions::Init init = CpAlsOptions::Init::kSvd) {
  CpAlsOptions options;
  options.rank = rank;
  options.max_iters = max_iters;
  options.tol = 0;
  options.init = init;
  options.seed = 7;
  return options;
}

TEST(FactorizedRelativeErrorTest, EqualsErrorOfMaterialisedTensors) {
  const Factors f = RandomFactors(1);
  const at::Tensor A = Randn({kHeads, 10}, 3), B = Randn({kDim, 10}, 4), C = Randn({kDim, 10}, 5);
  auto error = FactorizedRelativeError(f.P, f.Q, A, B, C);
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_NEAR(*error, DenseRelativeError(Materialize(f), Reconstruct(A, B, C)), 1e-8);
}

TEST(FactorizedCpAlsTest, ReportedErrorIsTheErrorOfTheReturnedFactors) {
  const Factors f = RandomFactors(11);
  auto result = FactorizedCpAls(f.P, f.Q, Options(6));
  ASSERT_TRUE(result.ok()) << result.status();
  const double dense =
      DenseRelativeError(Materialize(f), Reconstruct(result->mixing, result->query, result->key));
  EXPECT_NEAR(result->relative_error, dense, 1e-8);
  // The last sweep's error is that of the float64 iterate, before rounding to float32.
  EXPECT_NEAR(result->error_history.back(), dense, 1e-6);
  auto from_factors = FactorizedRelativeError(f.P, f.Q, result->mixing, result->query, result->key);
  ASSERT_TRUE(from_factors.ok()) << from_factors.status();
  EXPECT_NEAR(*from_factors, dense, 1e-8);
  EXPECT_EQ(result->mixing.sizes(), (at::IntArrayRef{kHeads, 6}));
  EXPECT_EQ(result->query.sizes(), (at::IntArrayRef{kDim, 6}));
  EXPECT_EQ(result->key.sizes(), (at::IntArrayRef{kDim, 6}));
  EXPECT_EQ(result->mixing.scalar_type(), at::kFloat);
  EXPECT_FALSE(result->exact);
  EXPECT_EQ(result->iterations, 50);
  EXPECT_EQ(result->error_history.size(), 50u);
}

struct Shape {
  int64_t heads, dq, dk, head_size;
};

// Shapes with N_h·d_k <= 2·D (the coefficient form, as in every BERT), with D_q != D_k, and with
// N_h·d_k > 2·D (factors held explicitly).
class SameIteratesTest
    : public ::testing::TestWithParam<std::tuple<CpAlsOptions::Init, Shape>> {};

TEST_P(SameIteratesTest, FactorizedAndDenseAlsFollowTheSamePath) {
  const auto [init, shape] = GetParam();
  const at::Tensor P = Randn({shape.heads, shape.dq, shape.head_size}, 21);
  const at::Tensor Q = Randn({shape.heads, shape.dk, shape.head_size}, 22);
  const CpAlsOptions options = Options(6, 30, init);
  auto factorized = FactorizedCpAls(P, Q, options);
  auto dense = DenseCpAls(at::matmul(P, Q.transpose(1, 2)), options);
  ASSERT_TRUE(factorized.ok()) << factorized.status();
  ASSERT_TRUE(dense.ok()) << dense.status();
  ASSERT_EQ(factorized->error_history.size(), dense->error_history.size());
  for (size_t i = 0; i < dense->error_history.size(); ++i) {
    EXPECT_NEAR(factorized->error_history[i], dense->error_history[i], 1e-6) << "sweep " << i + 1;
  }
  EXPECT_LT(dense->error_history.back(), dense->error_history.front() - 1e-3);
  EXPECT_EQ(factorized->query.sizes(), (at::IntArrayRef{shape.dq, 6}));
  EXPECT_EQ(factorized->key.sizes(), (at::IntArrayRef{shape.dk, 6}));
  EXPECT_TRUE(at::allclose(Reconstruct(factorized->mixing, factorized->query, factorized->key),
                           Reconstruct(dense->mixing, dense->query, dense->key), 1e-4, 1e-4));
}

INSTANTIATE_TEST_SUITE_P(
    InitsAndShapes, SameIteratesTest,
    ::testing::Combine(::testing::Values(CpAlsOptions::Init::kSvd, CpAlsOptions::Init::kRandom),
                       ::testing::Values(Shape{4, 32, 32, 8}, Shape{4, 32, 24, 8},
                                         Shape{8, 12, 12, 8})));

// At R >= 192 the coefficient form computes its symmetric Grams zᵀ(K z) block by block (the
// blocks above the diagonal mirrored) and solves with LAPACK directly; the iterates still follow
// the dense ALS, which forms every Gram whole.
TEST(FactorizedCpAlsTest, LargeRanksFollowTheDensePath) {
  const at::Tensor P = Randn({4, 192, 64}, 25), Q = Randn({4, 192, 64}, 26);
  const CpAlsOptions options = Options(192, 4);
  auto factorized = FactorizedCpAls(P, Q, options);
  auto dense = DenseCpAls(at::matmul(P, Q.transpose(1, 2)), options);
  ASSERT_TRUE(factorized.ok()) << factorized.status();
  ASSERT_TRUE(dense.ok()) << dense.status();
  ASSERT_EQ(factorized->error_history.size(), 4u);
  ASSERT_EQ(dense->error_history.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_NEAR(factorized->error_history[i], dense->error_history[i], 1e-6) << "sweep " << i + 1;
  }
  EXPECT_LT(factorized->error_history.back(), factorized->error_history.front());
}

// The float32 sweeps follow the dense float32 ALS as well (to float32 resolution), on the
// coefficient form (N_h·d_k <= 2·D) and on explicit factors.
TEST(FactorizedCpAlsTest, Float32FollowsTheDenseFloat32Path) {
  for (const Shape& shape : {Shape{4, 32, 32, 8}, Shape{8, 12, 12, 8}}) {
    const at::Tensor P = Randn({shape.heads, shape.dq, shape.head_size}, 23).to(at::kFloat);
    const at::Tensor Q = Randn({shape.heads, shape.dk, shape.head_size}, 24).to(at::kFloat);
    CpAlsOptions options = Options(6, 30);
    options.precision = CpAlsOptions::Precision::kFloat32;
    auto factorized = FactorizedCpAls(P, Q, options);
    auto dense = DenseCpAls(at::matmul(P, Q.transpose(1, 2)), options);
    ASSERT_TRUE(factorized.ok()) << factorized.status();
    ASSERT_TRUE(dense.ok()) << dense.status();
    ASSERT_EQ(factorized->error_history.size(), dense->error_history.size());
    for (size_t i = 0; i < dense->error_history.size(); ++i) {
      EXPECT_NEAR(factorized->error_history[i], dense->error_history[i], 1e-4)
          << "sweep " << i + 1 << ", N_h " << shape.heads;
    }
    EXPECT_NEAR(factorized->relative_error, dense->relative_error, 1e-4);
  }
}

// T = 0 makes every MTTKRP and Gram zero; the sweeps must stay finite and give T̂ = 0.
TEST(FactorizedCpAlsTest, AZeroTensorGivesAZeroApproximation) {
  const at::Tensor P = at::zeros({kHeads, kDim, kHeadSize}, at::kDouble);
  const at::Tensor Q = Randn({kHeads, kDim, kHeadSize}, 25);
  for (auto init : {CpAlsOptions::Init::kSvd, CpAlsOptions::Init::kRandom}) {
    auto result = FactorizedCpAls(P, Q, Options(5, 3, init));
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->relative_error, 0.0);
    EXPECT_TRUE(at::isfinite(result->query).all().item<bool>());
    EXPECT_TRUE(at::isfinite(result->key).all().item<bool>());
    EXPECT_EQ(Reconstruct(result->mixing, result->query, result->key).abs().max().item<double>(),
              0.0);
  }
}

// setup + sweeps + finish account for the whole call.
TEST(FactorizedCpAlsTest, TimeSplitAddsUpToTheCall) {
  const Factors f = RandomFactors(27);
  auto result = FactorizedCpAls(f.P, f.Q, Options(6, 5));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_GE(result->setup_seconds, 0);
  EXPECT_GE(result->sweep_seconds, 0);
  EXPECT_GE(result->finish_seconds, 0);
  EXPECT_NEAR(result->setup_seconds + result->sweep_seconds + result->finish_seconds,
              result->seconds, 1e-9);
}

TEST(FactorizedCpAlsTest, ErrorNeverRises) {
  const Factors f = RandomFactors(31);
  for (auto init : {CpAlsOptions::Init::kSvd, CpAlsOptions::Init::kRandom}) {
    auto result = FactorizedCpAls(f.P, f.Q, Options(12, 100, init));
    ASSERT_TRUE(result.ok()) << result.status();
    for (size_t i = 1; i < result->error_history.size(); ++i) {
      EXPECT_LE(result->error_history[i], result->error_history[i - 1] + 1e-10) << "sweep " << i + 1;
    }
  }
}

// The line search keeps an extrapolation only when it lowers the error: the error still never
// rises, the reported error is still that of the returned factors, and in the same sweeps it gets
// lower than plain ALS, which it overtakes well before the end.
TEST(FactorizedCpAlsTest, LineSearchNeverRaisesTheErrorAndNeedsFewerSweeps) {
  const Factors f = RandomFactors(33);
  for (auto init : {CpAlsOptions::Init::kSvd, CpAlsOptions::Init::kRandom}) {
    constexpr int kSweeps = 60;
    CpAlsOptions plain = Options(12, kSweeps, init), searched = plain;
    searched.line_search = true;
    auto p = FactorizedCpAls(f.P, f.Q, plain);
    auto s = FactorizedCpAls(f.P, f.Q, searched);
    ASSERT_TRUE(p.ok() && s.ok());
    EXPECT_EQ(p->extrapolations, 0);
    EXPECT_GT(s->extrapolations, 0);
    ASSERT_EQ(s->error_history.size(), static_cast<size_t>(kSweeps));
    for (size_t i = 1; i < s->error_history.size(); ++i) {
      EXPECT_LE(s->error_history[i], s->error_history[i - 1] + 1e-10) << "sweep " << i + 1;
    }
    EXPECT_NEAR(s->relative_error,
                DenseRelativeError(Materialize(f), Reconstruct(s->mixing, s->query, s->key)), 1e-8);
    EXPECT_NEAR(s->error_history.back(), s->relative_error, 1e-6);
    EXPECT_LT(s->relative_error, p->relative_error);
    int overtaken = kSweeps;
    for (int i = 0; i < kSweeps; ++i) {
      if (s->error_history[i] <= p->error_history.back()) {
        overtaken = i + 1;
        break;
      }
    }
    EXPECT_LT(overtaken, kSweeps * 3 / 4) << "plain ALS error after " << kSweeps << " sweeps: " << p->error_history.back();
  }
}

TEST(FactorizedCpAlsTest, ErrorFallsAsRankGrows) {
  const Factors f = RandomFactors(41);
  double previous = 1.0;
  for (int rank : {2, 8, 16, 24, 31}) {
    auto result = FactorizedCpAls(f.P, f.Q, Options(rank, 100));
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_LT(result->relative_error, previous) << "rank " << rank;
    previous = result->relative_error;
  }
  EXPECT_GT(previous, 0.0);
}

TEST(ExactBlockCpTest, ReconstructsTExactly) {
  const Factors f = RandomFactors(51);
  auto result = ExactBlockCp(f.P, f.Q);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->exact);
  EXPECT_EQ(result->iterations, 0);
  EXPECT_EQ(result->mixing.sizes(), (at::IntArrayRef{kHeads, kHeads * kHeadSize}));
  EXPECT_LT(result->relative_error, 1e-6);
  const at::Tensor T = Materialize(f);
  EXPECT_LT(DenseRelativeError(T, Reconstruct(result->mixing, result->query, result->key)), 1e-6);
}

TEST(FactorizedCpAlsTest, RankAtLeastHeadsTimesHeadSizeGivesTheBlockForm) {
  const Factors f = RandomFactors(61);
  auto result = FactorizedCpAls(f.P, f.Q, Options(kHeads * kHeadSize + 3));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->exact);
  EXPECT_EQ(result->iterations, 0);
  EXPECT_EQ(result->query.size(1), kHeads * kHeadSize + 3);
  EXPECT_LT(result->relative_error, 1e-6);
  EXPECT_LT(DenseRelativeError(Materialize(f),
                               Reconstruct(result->mixing, result->query, result->key)),
            1e-6);
}

TEST(FactorizedCpAlsTest, RecoversAPlantedExactRankTensor) {
  constexpr int64_t kRank = 5;
  const at::Tensor A = Randn({kHeads, kRank}, 71), B = Randn({kDim, kRank}, 72);
  const at::Tensor C = Randn({kDim, kRank}, 73);
  // T_i = B diag(A_i) Cᵀ = P_i Q_iᵀ with P_i = B diag(A_i), Q_i = C (d_k = kRank).
  const at::Tensor P = B.unsqueeze(0) * A.unsqueeze(1);
  const at::Tensor Q = C.unsqueeze(0).expand({kHeads, kDim, kRank}).contiguous();
  for (auto init : {CpAlsOptions::Init::kSvd, CpAlsOptions::Init::kRandom}) {
    CpAlsOptions options = Options(kRank, 1000, init);
    options.tol = 1e-12;
    auto result = FactorizedCpAls(P, Q, options);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_FALSE(result->exact);
    EXPECT_LT(result->relative_error, 1e-6)
        << "init " << static_cast<int>(init) << " after " << result->iterations << " sweeps";
  }
}

TEST(FactorizedCpAlsTest, DeterministicForASeed) {
  const Factors f = RandomFactors(81);
  for (auto init : {CpAlsOptions::Init::kSvd, CpAlsOptions::Init::kRandom}) {
    auto first = FactorizedCpAls(f.P, f.Q, Options(10, 20, init));
    auto second = FactorizedCpAls(f.P, f.Q, Options(10, 20, init));
    ASSERT_TRUE(first.ok() && second.ok());
    EXPECT_EQ(first->error_history, second->error_history);
    EXPECT_TRUE(at::equal(first->mixing, second->mixing));
    EXPECT_TRUE(at::equal(first->query, second->query));
    EXPECT_TRUE(at::equal(first->key, second->key));
  }
  CpAlsOptions other_seed = Options(10, 20, CpAlsOptions::Init::kRandom);
  other_seed.seed = 8;
  auto first = FactorizedCpAls(f.P, f.Q, Options(10, 20, CpAlsOptions::Init::kRandom));
  auto second = FactorizedCpAls(f.P, f.Q, other_seed);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_FALSE(at::equal(first->query, second->query));
}

// On a GPU (none on the development machines: scripts/gpu-check.sh runs this there) the same
// factors give the same decomposition as on the CPU from the same seed: the same error, and the
// same T-hat (the factors themselves may differ in sign where the SVDs do).
TEST(FactorizedCpAlsTest, CudaAgreesWithTheCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU";
  const Factors f = RandomFactors(71);
  for (auto precision : {CpAlsOptions::Precision::kFloat64, CpAlsOptions::Precision::kFloat32}) {
    CpAlsOptions options = Options(12, 30);
    options.precision = precision;
    auto cpu = FactorizedCpAls(f.P, f.Q, options);
    auto gpu = FactorizedCpAls(f.P.to(at::kCUDA), f.Q.to(at::kCUDA), options);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    const double tol = precision == CpAlsOptions::Precision::kFloat64 ? 1e-6 : 1e-4;
    EXPECT_NEAR(gpu->relative_error, cpu->relative_error, tol);
    at::Tensor a = Reconstruct(cpu->mixing.to(at::kDouble), cpu->query.to(at::kCPU, at::kDouble),
                               cpu->key.to(at::kCPU, at::kDouble));
    at::Tensor b = Reconstruct(gpu->mixing.to(at::kCPU, at::kDouble), gpu->query.to(at::kCPU, at::kDouble),
                               gpu->key.to(at::kCPU, at::kDouble));
    EXPECT_LT(DenseRelativeError(a, b), 100 * tol);
  }
}

TEST(FactorizedCpAlsTest, Float32AgreesWithFloat64) {
  const Factors f = RandomFactors(91);
  CpAlsOptions options = Options(12, 50);
  auto exact = FactorizedCpAls(f.P, f.Q, options);
  options.precision = CpAlsOptions::Precision::kFloat32;
  auto single = FactorizedCpAls(f.P.to(at::kFloat), f.Q.to(at::kFloat), options);
  ASSERT_TRUE(exact.ok() && single.ok());
  EXPECT_NEAR(single->relative_error, exact->relative_error, 1e-4);
}

TEST(FactorizedCpAlsTest, Float32ResolvesAPlantedTensorToRoundingLevel) {
  constexpr int64_t kRank = 5;
  const at::Tensor A = Randn({kHeads, kRank}, 74), B = Randn({kDim, kRank}, 75);
  const at::Tensor C = Randn({kDim, kRank}, 76);
  const at::Tensor P = (B.unsqueeze(0) * A.unsqueeze(1)).to(at::kFloat);
  const at::Tensor Q = C.unsqueeze(0).expand({kHeads, kDim, kRank}).contiguous().to(at::kFloat);
  CpAlsOptions options = Options(kRank, 1000);
  options.tol = 1e-9;
  options.precision = CpAlsOptions::Precision::kFloat32;
  auto result = FactorizedCpAls(P, Q, options);
  ASSERT_TRUE(result.ok()) << result.status();
  auto from_factors = FactorizedRelativeError(P, Q, result->mixing, result->query, result->key);
  ASSERT_TRUE(from_factors.ok());
  EXPECT_LT(*from_factors, 1e-3);
  // The reported error is that of the returned factors even where float32 sweeps cannot see it.
  EXPECT_NEAR(result->relative_error, *from_factors, 1e-8);
}

TEST(FactorizedCpAlsTest, StopsWhenTheErrorSettles) {
  const Factors f = RandomFactors(101);
  CpAlsOptions options = Options(8, 1000);
  options.tol = 1e-4;
  auto result = FactorizedCpAls(f.P, f.Q, options);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_LT(result->iterations, 1000);
  const auto& h = result->error_history;
  EXPECT_LT(std::abs(h[h.size() - 1] - h[h.size() - 2]), 1e-4);
}

// A job's cancellation stops CP-ALS after the sweep that sees it, on every path (a million-sweep
// request used to run to its end, whatever CancelJob said).
TEST(FactorizedCpAlsTest, ACancelledCallStopsAfterOneSweep) {
  const Factors f = RandomFactors(107);
  std::atomic<bool> cancelled{true};
  for (bool line_search : {false, true}) {
    CpAlsOptions options = Options(8, 1000);
    options.tol = 0;
    options.line_search = line_search;
    options.cancelled = &cancelled;
    auto result = FactorizedCpAls(f.P, f.Q, options);
    EXPECT_EQ(result.status().code(), absl::StatusCode::kCancelled) << "line_search " << line_search;
    EXPECT_THAT(result.status().message(), HasSubstr("cancelled after 1 sweeps"));
  }
  CpAlsOptions options = Options(8, 1000);
  options.cancelled = &cancelled;
  EXPECT_EQ(DenseCpAls(Materialize(f), options).status().code(), absl::StatusCode::kCancelled);
  cancelled = false;  // not cancelled: runs as before
  EXPECT_TRUE(FactorizedCpAls(f.P, f.Q, options).ok());
}

TEST(CpAlsArgumentsTest, BadOptionsAreInvalidArgument) {
  const Factors f = RandomFactors(111);
  auto zero_rank = FactorizedCpAls(f.P, f.Q, Options(0));
  EXPECT_EQ(zero_rank.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(zero_rank.status().message(), HasSubstr("options.rank"));

  auto no_iters = FactorizedCpAls(f.P, f.Q, Options(4, 0));
  EXPECT_EQ(no_iters.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_iters.status().message(), HasSubstr("options.max_iters"));

  CpAlsOptions nan_tol = Options(4);
  nan_tol.tol = std::numeric_limits<double>::quiet_NaN();
  auto bad_tol = DenseCpAls(Materialize(f), nan_tol);
  EXPECT_EQ(bad_tol.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_tol.status().message(), HasSubstr("options.tol"));
}

TEST(CpAlsArgumentsTest, BadTensorsAreInvalidArgumentNamingTheArgument) {
  const Factors f = RandomFactors(121);
  auto mismatched = FactorizedCpAls(f.P, Randn({kHeads, kDim, kHeadSize - 1}, 1), Options(4));
  EXPECT_EQ(mismatched.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(mismatched.status().message(), HasSubstr("P and Q"));

  auto wrong_rank = ExactBlockCp(f.P, f.Q[0]);
  EXPECT_EQ(wrong_rank.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong_rank.status().message(), HasSubstr("Q must have 3 dimensions"));

  at::Tensor nan_p = f.P.clone();
  nan_p[1][2][3] = std::numeric_limits<double>::quiet_NaN();
  auto nan = FactorizedCpAls(nan_p, f.Q, Options(4));
  EXPECT_EQ(nan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(nan.status().message(), HasSubstr("P contains NaN"));

  at::Tensor inf_t = Materialize(f);
  inf_t[0][0][0] = std::numeric_limits<double>::infinity();
  auto inf = DenseCpAls(inf_t, Options(4));
  EXPECT_EQ(inf.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(inf.status().message(), HasSubstr("T contains NaN or Inf"));

  auto undefined = FactorizedCpAls(at::Tensor(), f.Q, Options(4));
  EXPECT_EQ(undefined.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(undefined.status().message(), HasSubstr("P is undefined"));

  auto integer = FactorizedCpAls(f.P.to(at::kInt), f.Q, Options(4));
  EXPECT_EQ(integer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(integer.status().message(), HasSubstr("P must be floating point"));

  auto bad_a = FactorizedRelativeError(f.P, f.Q, Randn({kHeads + 1, 3}, 1), Randn({kDim, 3}, 2),
                                       Randn({kDim, 3}, 3));
  EXPECT_EQ(bad_a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_a.status().message(), HasSubstr("A, B, C must be"));
}

}  // namespace
}  // namespace collabserve::compress
