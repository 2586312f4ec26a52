// CP decomposition (alternating least squares) of the stacked per-head attention products
// T_i = W_Q^(i) W_K^(i)ᵀ of one BERT layer, as in Cordonnier, Loukas & Jaggi 2020 ("Multi-Head
// Attention: Collaborate Instead of Concatenate"): T_i ≈ B diag(A[i, :]) Cᵀ, where A is the head
// mixing matrix and B, C are the shared query and key projections.
//
// FactorizedCpAls works from the factors P_i, Q_i alone (T_i = P_i Q_iᵀ) and never forms T; the
// dense version exists as the textbook baseline for the benchmark and as a test oracle.
//
// All functions are pure: they keep no state, so they are safe to call concurrently from several
// threads (each call uses LibTorch's intra-op thread pool, which the caller's main configures).
// No exception escapes: LibTorch errors come back as INTERNAL statuses.
#ifndef COLLABSERVE_SERVER_COMPRESS_CP_ALS_H_
#define COLLABSERVE_SERVER_COMPRESS_CP_ALS_H_

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace collabserve::compress {

struct CpAlsOptions {
  // Number of CP components R. Must be positive.
  int rank = 0;
  // Maximum number of ALS sweeps (each sweep updates A, then B, then C). Must be >= 1.
  int max_iters = 100;
  // Stops after a sweep that changes the relative error by less than `tol` (absolute difference
  // of consecutive relative errors). 0 runs all `max_iters` sweeps. Must be finite and >= 0.
  double tol = 1e-6;
  // Seeds the random initialisation and the random columns that pad an SVD initialisation when
  // rank exceeds the number of singular vectors. Same inputs + same seed => same result on the
  // same device and thread count.
  uint64_t seed = 0;
  // kSvd: B and C start as the leading left singular vectors of the mode-2 and mode-3 unfoldings
  // (sign fixed so that each vector's largest-magnitude entry is positive), as tensorly's
  // init='svd' (computed as eigenvectors of the unfoldings' [D, D] Gram matrices, built from the
  // factors). kRandom: entries of B and C are i.i.d. N(0, 1). A is never read before the first
  // update, so it needs no initialisation.
  enum class Init { kSvd, kRandom };
  Init init = Init::kSvd;
  // Arithmetic used inside the iterations. kFloat32 is about 2x faster on CPU (cp_bench: 41 vs 81
  // CPU-seconds for 12 BERT-base layers at R = 384) and reaches the same error as kFloat64 to 1e-6
  // on unstructured layers, but up to 3e-4 higher on layers whose heads share a subspace (nearly
  // collinear components make the R×R solves ill-conditioned), and its per-sweep error_history
  // cannot resolve errors below ~1e-3. relative_error is computed in float64 either way.
  enum class Precision { kFloat64, kFloat32 };
  Precision precision = Precision::kFloat64;
  // Line search after each sweep (Bro 1998, as tensorly's parafac(linesearch=True) but every
  // sweep, with the step iter^(1/3)): A and the coefficients of B and C move on along the last
  // sweep's change, X + s·(X − X_prev), and the move is kept only when it lowers the error, so the
  // error still never rises (X_prev is the previous sweep's end point before its own move). On
  // BERT-base layers it reaches the error of 100 plain sweeps in 33–36 sweeps (17–35 from the
  // random start), each ~25% dearer: the moved point's error needs two [R, n] × [n, R] Grams
  // (bench/compress/RESULTS.md, section 6; testing only every other sweep, or not right after a
  // kept move, measured 42–46 sweeps instead of 36). Used by FactorizedCpAls when
  // N_h·d_k <= 2·min(D_q, D_k) (every BERT); ignored by the other paths and by DenseCpAls, which
  // keep the textbook iterates.
  bool line_search = false;
  // Checked after every sweep: once it reads true the call stops and returns CANCELLED (a job's
  // CancelJob, a server shutting down). Null: never. Must outlive the call.
  const std::atomic<bool>* cancelled = nullptr;
};

struct CpResult {
  at::Tensor mixing;  // A: [N_h, R], carries the component weights.
  at::Tensor query;   // B: [D_q, R], unit-norm columns after ALS.
  at::Tensor key;     // C: [D_k, R], unit-norm columns after ALS.
  // ||T − T̂||_F / ||T||_F of the returned float32 factors, computed in float64 from the factors
  // (resolution ~1e-8; for T = 0 it is ||T̂||_F).
  double relative_error = 0;
  int iterations = 0;  // ALS sweeps run (0 for the exact block form).
  // Relative error after each sweep, in the compute precision; size() == iterations. Never rises
  // (beyond rounding) in float64.
  std::vector<double> error_history;
  double seconds = 0;                // wall time of the whole call, initialisation included.
  // Where `seconds` went (FactorizedCpAls and DenseCpAls; 0 for the block form): conversions,
  // precomputation and initialisation; the sweeps; forming the returned factors and their
  // float64 error. They add up to `seconds`.
  double setup_seconds = 0;
  double sweep_seconds = 0;
  double finish_seconds = 0;
  bool exact = false;                // true for the block form, which reproduces T exactly.
  int extrapolations = 0;            // line-search moves kept (options.line_search)
};

// Rank-`options.rank` CP-ALS of T = stack_i(P_i Q_iᵀ) for P: [N_h, D_q, d_k], Q: [N_h, D_k, d_k]
// (any floating dtype, both on the same device, CPU or CUDA). Works from the factors only; neither
// T nor a Khatri–Rao product is ever formed. With n = N_h·d_k, a sweep costs 2·n²·R + 4·n·R²
// multiply-adds when n <= 2·min(D_q, D_k) (every BERT: n == D), else 2·n·(D_q+D_k)·R +
// 2·(D_q+D_k)·R², plus three R×R Cholesky factorisations; memory O(n² + (n+D)·R). When rank >= N_h·d_k the result is ExactBlockCp's, padded
// with zero columns up to `rank` (iterations == 0, exact == true).
// Returns float32 factors on P's device.
// INVALID_ARGUMENT (naming the argument) for a non-positive rank, max_iters < 1, a negative or
// non-finite tol, undefined tensors, shapes that are not [N_h, D, d_k] with matching N_h and d_k,
// tensors on different devices, non-floating dtypes, or NaN/Inf entries. CANCELLED once
// options.cancelled reads true (checked after each sweep).
absl::StatusOr<CpResult> FactorizedCpAls(const at::Tensor& P, const at::Tensor& Q,
                                         const CpAlsOptions& options);

// The exact rank-(N_h·d_k) block form: B = [P_1 … P_N], C = [Q_1 … Q_N], A[i, r] = 1 for the
// columns r of head i. relative_error is computed from the factors (0 up to rounding), exact ==
// true, iterations == 0. Same argument checks as FactorizedCpAls (minus the options).
absl::StatusOr<CpResult> ExactBlockCp(const at::Tensor& P, const at::Tensor& Q);

// The textbook baseline: CP-ALS of a materialised T: [N_h, D_q, D_k] with each MTTKRP computed as
// unfolding × explicit Khatri–Rao product (as tensorly's parafac), O(N_h·D_q·D_k·R) per sweep and
// an O(D_q·D_k·R) temporary. Same sweep order, normalisation, linear solves, stopping rule and
// initialisation as FactorizedCpAls (the SVD init here forms the unfoldings' Gram matrices
// from T itself), so from the same options both produce the same iterates up to rounding.
// Same errors as FactorizedCpAls for T and the options.
absl::StatusOr<CpResult> DenseCpAls(const at::Tensor& T, const CpAlsOptions& options);

// ||T − T̂||_F / ||T||_F for T_i = P_i Q_iᵀ and T̂_i = B diag(A[i, :]) Cᵀ, computed from Gram
// matrices in float64 without forming T: O(N_h·D·d_k·R + D·R²). Cancellation limits its
// resolution to about 1e-8. A: [N_h, R], B: [D_q, R], C: [D_k, R]; INVALID_ARGUMENT (naming the
// argument) when shapes or devices disagree.
absl::StatusOr<double> FactorizedRelativeError(const at::Tensor& P, const at::Tensor& Q,
                                               const at::Tensor& A, const at::Tensor& B,
                                               const at::Tensor& C);

}  // namespace collabserve::compress

#endif  // COLLABSERVE_SERVER_COMPRESS_CP_ALS_H_
