// The linear solves of CP-ALS: M G⁻¹ for the Hadamard product G of factor Grams, a symmetric
// positive semi-definite [R, R] matrix, and a block of right-hand sides M: [m, R] (m = the
// model's N_h·d_k for the B and C updates, N_h for A).
//
// Pure functions, safe to call concurrently; they throw c10::Error like the ATen calls they wrap
// (cp_als.cc turns that into a Status at its boundary).
#ifndef COLLABSERVE_SERVER_COMPRESS_GRAM_SOLVE_H_
#define COLLABSERVE_SERVER_COMPRESS_GRAM_SOLVE_H_

#include <ATen/core/Tensor.h>

namespace collabserve::compress {

enum class GramSolveMethod {
  // kLapack on the CPU when LAPACK's and BLAS's routines are found in the process (Debian's
  // LibTorch calls OpenBLAS, which exports them) and the environment variable
  // COLLABSERVE_CP_SOLVE is not "aten"; kAten otherwise. (COLLABSERVE_CP_SOLVE=potri makes
  // kLapack invert with LAPACK's potri instead of the blocked inverse; both for measurements.)
  kAuto,
  // LAPACK called directly on a copy of the Gram: Cholesky (potrf), then for m >= R the inverse
  // from it (L⁻¹ by a blocked recursion whose off-diagonal blocks are GEMMs, trtri only on blocks
  // of <= 64, then lauum for L⁻ᵀL⁻¹) and one BLAS symm that reads its triangle; for m < R two
  // triangular solves (trsm). Falls back to kAten where the routines are not found, off the CPU,
  // or for dtypes other than float32/float64. [768, 384] float32, one thread: 2.7 ms against
  // 3.9 ms for kAten, 12 right-hand sides 0.6 against 1.2 ms (ATen's Cholesky alone costs
  // 0.8 ms against 0.3 ms for potrf; bench/compress/RESULTS.md, section 7).
  kLapack,
  // ATen: linalg_cholesky_ex, then cholesky_inverse and one GEMM (m >= R; faster than ATen's
  // cholesky_solve for many right-hand sides) or cholesky_solve (m < R).
  kAten,
};

// out ← M G⁻¹. M: [m, R]; out: [m, R], contiguous, M's dtype and device, not overlapping M;
// G: [R, R] symmetric positive semi-definite, G's dtype = M's, taken by value because a ridge of
// 10·eps·max(diag G) goes onto its diagonal in place (pass a fresh tensor, e.g. a Hadamard
// product). If G is numerically singular even with the ridge, the eigenvalue pseudo-inverse
// (eigenvalues below max·R·eps dropped) is used instead; a G with no positive diagonal entry
// gives out = 0.
void SolveGramInto(const at::Tensor& M, at::Tensor G, at::Tensor& out,
                   GramSolveMethod method = GramSolveMethod::kAuto);

// M G⁻¹ as a new contiguous tensor.
at::Tensor SolveGram(const at::Tensor& M, at::Tensor G,
                     GramSolveMethod method = GramSolveMethod::kAuto);

}  // namespace collabserve::compress

#endif  // COLLABSERVE_SERVER_COMPRESS_GRAM_SOLVE_H_
