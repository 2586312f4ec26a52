// The CP-ALS solves M G⁻¹: LAPACK called directly (potrf, then potri + symm or trsm) against
// ATen's route it replaced and a float64 reference.
#include "server/compress/gram_solve.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

namespace collabserve::compress {
namespace {

at::Tensor Randn(at::IntArrayRef shape, uint64_t seed, at::ScalarType dtype) {
  return at::randn(shape, at::make_generator<at::CPUGeneratorImpl>(seed),
                   at::TensorOptions().dtype(dtype));
}

// The Hadamard product of two factor Grams with unit columns, as in a B or C update. `shared`
// > 0 draws both factors' columns mostly from a `shared`-dimensional subspace (as the planted
// model's heads): nearly collinear columns and an ill-conditioned G.
at::Tensor HadamardGram(int64_t dim, int64_t rank, int64_t shared, uint64_t seed,
                        at::ScalarType dtype) {
  auto factor = [&](uint64_t s) {
    at::Tensor f = Randn({dim, rank}, s, at::kDouble);
    if (shared > 0) {
      f = at::mm(Randn({dim, shared}, seed, at::kDouble), Randn({shared, rank}, s + 1, at::kDouble)) +
          0.1 * f;
    }
    return f / f.norm(2, 0, true);
  };
  at::Tensor b = factor(seed + 10), c = factor(seed + 20);
  return (at::mm(b.t(), b) * at::mm(c.t(), c)).to(dtype);
}

double RelativeDiff(const at::Tensor& x, const at::Tensor& ref) {
  return ((x.to(at::kDouble) - ref.to(at::kDouble)).norm() / ref.to(at::kDouble).norm()).item<double>();
}

at::Tensor Solve(const at::Tensor& M, const at::Tensor& G, GramSolveMethod method) {
  return SolveGram(M, G.clone(), method);
}

// X G⁻¹ in float64 from the ridged G (the ridge both methods add).
at::Tensor Reference(const at::Tensor& M, const at::Tensor& G, double eps) {
  at::Tensor g = G.to(at::kDouble).clone();
  g.diagonal().add_(10 * eps * g.diagonal().max().item<double>());
  return at::linalg_solve(g, M.to(at::kDouble).t()).t();
}

TEST(GramSolveTest, LapackEqualsAtenOnAWellConditionedGram) {
  for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const at::Tensor G = HadamardGram(96, 48, 0, 1, dtype);
    for (int64_t rows : {96, 5}) {  // many right-hand sides (B, C updates) and few (A update)
      const at::Tensor M = Randn({rows, 48}, 2, dtype);
      const at::Tensor tri = Solve(M, G, GramSolveMethod::kLapack);
      const at::Tensor inv = Solve(M, G, GramSolveMethod::kAten);
      EXPECT_EQ(tri.scalar_type(), dtype);
      EXPECT_EQ(tri.sizes(), M.sizes());
      EXPECT_LT(RelativeDiff(tri, inv), dtype == at::kFloat ? 1e-5 : 1e-12) << rows;
      EXPECT_EQ(RelativeDiff(Solve(M, G, GramSolveMethod::kAuto), tri), 0) << rows;
    }
  }
}

TEST(GramSolveTest, LapackIsAsAccurateAsAtenOnAnIllConditionedGram) {
  const double eps = 1.1920928955078125e-07;
  const at::Tensor G = HadamardGram(192, 96, 4, 3, at::kFloat);
  ASSERT_GT(at::linalg_cond(G.to(at::kDouble)).item<double>(), 1e3);
  const at::Tensor M = Randn({192, 96}, 4, at::kFloat);
  const at::Tensor ref = Reference(M, G, eps);
  const double tri = RelativeDiff(Solve(M, G, GramSolveMethod::kLapack), ref);
  const double inv = RelativeDiff(Solve(M, G, GramSolveMethod::kAten), ref);
  EXPECT_LE(tri, inv * 1.5);
  EXPECT_LT(tri, 1e-2) << "aten " << inv;
}

TEST(GramSolveTest, IntoWritesTheGivenBufferAndReadsANonContiguousM) {
  const at::Tensor G = HadamardGram(64, 32, 0, 5, at::kFloat);
  const at::Tensor M = Randn({32, 64}, 6, at::kFloat).t();  // [64, 32], column-major
  for (GramSolveMethod method : {GramSolveMethod::kLapack, GramSolveMethod::kAten}) {
    at::Tensor out = at::empty({64, 32});
    const void* data = out.data_ptr();
    SolveGramInto(M, G.clone(), out, method);
    EXPECT_EQ(out.data_ptr(), data);
    EXPECT_LT(RelativeDiff(out, Reference(M, G, 1.1920928955078125e-07)), 1e-5);
  }
}

TEST(GramSolveTest, AZeroGramGivesZero) {
  const at::Tensor M = Randn({8, 4}, 7, at::kFloat);
  for (GramSolveMethod method : {GramSolveMethod::kLapack, GramSolveMethod::kAten}) {
    EXPECT_EQ(Solve(M, at::zeros({4, 4}), method).abs().max().item<float>(), 0);
  }
}

TEST(GramSolveTest, ASingularGramFallsBackToThePseudoInverseEitherWay) {
  // Rank 2 of 6 with an eigenvalue well below the ridge: Cholesky fails in both methods.
  at::Tensor v = Randn({6, 2}, 8, at::kDouble);
  at::Tensor G = at::mm(v, v.t());
  G.diagonal().sub_(1e-3);
  G = G.to(at::kFloat);
  const at::Tensor M = Randn({10, 6}, 9, at::kFloat);
  const at::Tensor tri = Solve(M, G, GramSolveMethod::kLapack);
  const at::Tensor inv = Solve(M, G, GramSolveMethod::kAten);
  EXPECT_TRUE(at::isfinite(tri).all().item<bool>());
  EXPECT_GT(tri.abs().max().item<float>(), 0);
  EXPECT_LT(RelativeDiff(tri, inv), 1e-6);
}

}  // namespace
}  // namespace collabserve::compress
