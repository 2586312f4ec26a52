#include "server/compress/cp_als.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <glog/logging.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/compress/gram_solve.h"
#include "server/model/torch_status.h"
#include "server/util/process_env.h"
#include "server/util/status_macros.h"

namespace collabserve::compress {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The relative error ‖T - T̂‖ / ‖T‖ from ‖T‖², <T, T̂> and ‖T̂‖² (never forming T - T̂).
double RelativeFromInner(double norm_sq, double inner, double estimate_sq) {
  const double norm = std::sqrt(norm_sq);
  const double residual = std::sqrt(std::max(0.0, norm_sq - 2 * inner + estimate_sq));
  return norm > 0 ? residual / norm : residual;
}

bool Cancelled(const CpAlsOptions& options) {
  return options.cancelled != nullptr && options.cancelled->load(std::memory_order_relaxed);
}

// Records sweep `iter`'s relative error and returns whether to stop: the error moved by less than
// options.tol, or the call was cancelled (which the caller turns into CANCELLED).
bool RecordSweep(int iter, double rel, const CpAlsOptions& options, CpResult* result) {
  result->error_history.push_back(rel);
  result->iterations = iter;
  VLOG(2) << "CP-ALS sweep " << iter << ": relative error " << rel;
  if (Cancelled(options)) return true;
  return iter >= 2 && std::abs(rel - result->error_history[iter - 2]) < options.tol;
}

absl::Status CancelledAfter(const CpResult& result) {
  return absl::CancelledError(absl::StrCat("CP-ALS cancelled after ", result.iterations, " sweeps"));
}

std::string ShapeString(const at::Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.sizes(), ", "), "]");
}

at::ScalarType ComputeType(const CpAlsOptions& options) {
  return options.precision == CpAlsOptions::Precision::kFloat32 ? at::kFloat : at::kDouble;
}

// ---------------------------------------------------------------------------------------------
// Argument checks. Every message starts with the function's name and names the argument.

absl::Status CheckTensor(const char* fn, const char* name, const at::Tensor& t, int64_t dim) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(fn, ": ", name, " is undefined"));
  if (t.dim() != dim) {
    return absl::InvalidArgumentError(absl::StrCat(fn, ": ", name, " must have ", dim,
                                                   " dimensions, got shape ", ShapeString(t)));
  }
  if (!at::isFloatingType(t.scalar_type())) {
    return absl::InvalidArgumentError(absl::StrCat(fn, ": ", name, " must be floating point, got ",
                                                   c10::toString(t.scalar_type())));
  }
  for (int64_t i = 0; i < dim; ++i) {
    if (t.size(i) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(fn, ": ", name, " must not be empty, got shape ", ShapeString(t)));
    }
  }
  if (!at::isfinite(t).all().item<bool>()) {
    return absl::InvalidArgumentError(absl::StrCat(fn, ": ", name, " contains NaN or Inf"));
  }
  return absl::OkStatus();
}

absl::Status CheckSameDevice(const char* fn, const char* name_a, const at::Tensor& a,
                             const char* name_b, const at::Tensor& b) {
  if (a.device() != b.device()) {
    return absl::InvalidArgumentError(absl::StrCat(fn, ": ", name_a, " is on ", a.device().str(),
                                                   " but ", name_b, " is on ", b.device().str()));
  }
  return absl::OkStatus();
}

absl::Status CheckFactors(const char* fn, const at::Tensor& P, const at::Tensor& Q) {
  RETURN_IF_ERROR(CheckTensor(fn, "P", P, 3));
  RETURN_IF_ERROR(CheckTensor(fn, "Q", Q, 3));
  RETURN_IF_ERROR(CheckSameDevice(fn, "P", P, "Q", Q));
  if (P.size(0) != Q.size(0) || P.size(2) != Q.size(2)) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": P and Q must both be [N_h, D, d_k] with the same N_h and d_k, got P ",
                     ShapeString(P), " and Q ", ShapeString(Q)));
  }
  return absl::OkStatus();
}

absl::Status CheckOptions(const char* fn, const CpAlsOptions& options) {
  if (options.rank <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": options.rank must be positive, got ", options.rank));
  }
  if (options.max_iters < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": options.max_iters must be at least 1, got ", options.max_iters));
  }
  if (!std::isfinite(options.tol) || options.tol < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": options.tol must be finite and non-negative, got ", options.tol));
  }
  return absl::OkStatus();
}

// Runs `body` and turns any exception LibTorch (or the standard library) throws into a status
// (model::TorchErrorStatus: RESOURCE_EXHAUSTED for an allocation that failed, else INTERNAL).
template <typename T, typename Body>
absl::StatusOr<T> CatchAll(const char* fn, Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    return model::TorchErrorStatus(fn, e);
  }
}

// ---------------------------------------------------------------------------------------------
// Linear algebra helpers.

// Standard normal [rows, cols] from a seeded Mersenne Twister through Box–Muller (not
// std::normal_distribution, whose output differs between standard libraries), so that the
// initialisation is the same everywhere for a seed.
at::Tensor RandomNormal(int64_t rows, int64_t cols, std::mt19937_64& rng,
                        const at::TensorOptions& to) {
  at::Tensor out = at::empty({rows, cols}, at::TensorOptions().dtype(at::kDouble));
  double* data = out.data_ptr<double>();
  const int64_t n = rows * cols;
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  for (int64_t i = 0; i < n; i += 2) {
    // 53 random bits → (0, 1]; never 0, so the log is finite.
    const double u1 = (static_cast<double>(rng() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    const double radius = std::sqrt(-2.0 * std::log(u1));
    data[i] = radius * std::cos(kTwoPi * u2);
    if (i + 1 < n) data[i + 1] = radius * std::sin(kTwoPi * u2);
  }
  return out.to(to);
}

// Makes each column's largest-magnitude entry positive (svd_flip), so that singular vectors
// computed by different routes (from factors or from T) agree.
at::Tensor FixSigns(const at::Tensor& X) {
  at::Tensor idx = X.abs().argmax(0, /*keepdim=*/true);
  at::Tensor pivots = X.gather(0, idx);
  return X * at::where(pivots < 0, -1.0, 1.0).to(X.scalar_type());
}

// The `rank` leading left singular vectors of an unfolding X, from the eigenvectors of its Gram
// matrix G = X Xᵀ ([D, D], symmetric): eigh is 2-3x faster than an SVD of X and, because the Gram
// can be computed from the factors, needs no materialised X. Random columns when rank > D.
at::Tensor LeadingEigenvectors(const at::Tensor& gram, int64_t rank, std::mt19937_64& rng) {
  at::Tensor symmetric = (gram + gram.t()) * 0.5;
  at::Tensor vectors = std::get<1>(at::linalg_eigh(symmetric));  // ascending eigenvalues
  const int64_t dim = gram.size(0);
  const int64_t k = std::min<int64_t>(rank, dim);
  at::Tensor X = FixSigns(vectors.narrow(1, dim - k, k).flip({1}));
  if (k < rank) X = at::cat({X, RandomNormal(dim, rank - k, rng, gram.options())}, 1);
  return X.contiguous();
}

// ---------------------------------------------------------------------------------------------
// The MTTKRPs (matricised tensor times Khatri–Rao product) of the three modes of T: the only
// place where the algorithms differ. A source holds the query and key factors in coordinates,
// here always explicitly (RunCoefficientAls, the fast path for N_h·d_k <= 2·min(D_q, D_k), has its
// own loop and keeps them in the coordinates of the stacked P and Q).
class MttkrpSource {
 public:
  virtual ~MttkrpSource() = default;
  // Takes the factor in coordinates; returns the Gram matrix BᵀB (or CᵀC).
  virtual at::Tensor SetQuery(const at::Tensor& z) = 0;
  virtual at::Tensor SetKey(const at::Tensor& z) = 0;
  // Multiplies column r of the factor by scale[r].
  virtual void ScaleQuery(const at::Tensor& scale) = 0;
  virtual void ScaleKey(const at::Tensor& scale) = 0;
  // Σ_jk T_i[j,k] B[j,r] C[k,r]: [N_h, R].
  virtual at::Tensor ForMixing() = 0;
  // Σ_ik T_i[j,k] A[i,r] C[k,r] and Σ_ij T_i[j,k] A[i,r] B[j,r], in coordinates.
  virtual at::Tensor ForQuery(const at::Tensor& A) = 0;
  virtual at::Tensor ForKey(const at::Tensor& A) = 0;
  // <MTTKRP_C, C> = <T, T̂> for ForKey's result and the current key factor, in float64.
  virtual double KeyInner(const at::Tensor& key_mttkrp) = 0;
  // The explicit factors B: [D_q, R], C: [D_k, R].
  virtual at::Tensor Query() = 0;
  virtual at::Tensor Key() = 0;
};

// [N_h, D, d_k] → [D, N_h·d_k], column i·d_k + t = X_i[:, t].
at::Tensor StackHeads(const at::Tensor& X) {
  return X.permute({1, 0, 2}).reshape({X.size(1), X.size(0) * X.size(2)}).contiguous();
}

// Σ x ∗ y for [n, R] tensors: column sums in the compute dtype, their total in float64 (casting
// both [n, R] operands to float64 first cost ~10% of a float32 sweep).
double InnerAsDouble(const at::Tensor& x, const at::Tensor& y) {
  return (x * y).sum(0).to(at::kDouble).sum().item<double>();
}

// Common part of the two factorised sources: T_i = P_i Q_iᵀ; with U_i = P_iᵀ B and V_i = Q_iᵀ C
// ([d_k, R]), MTTKRP_A[i, r] = Σ_t U_i[t,r] V_i[t,r], MTTKRP_B = Σ_i P_i (V_i diag A_i) and
// MTTKRP_C = Σ_i Q_i (U_i diag A_i); the sums over heads are one GEMM with the heads stacked
// along d_k: [D, N_h·d_k] × [N_h·d_k, R].
class FactorizedSourceBase : public MttkrpSource {
 protected:
  FactorizedSourceBase(const at::Tensor& P, const at::Tensor& Q)
      : heads_(P.size(0)),
        head_size_(P.size(2)),
        p_flat_(StackHeads(P)),
        q_flat_(StackHeads(Q)) {}

  // [N_h, d_k, R] ∗ A[i, r] → [N_h·d_k, R].
  at::Tensor Weighted(const at::Tensor& projected, const at::Tensor& A) const {
    return (projected * A.unsqueeze(1)).view({heads_ * head_size_, A.size(1)});
  }
  at::Tensor Heads(const at::Tensor& flat) const {
    return flat.view({heads_, head_size_, flat.size(1)});
  }

 public:
  at::Tensor ForMixing() override { return (u_ * v_).sum(1); }

 protected:
  const int64_t heads_, head_size_;
  const at::Tensor p_flat_, q_flat_;  // [D, N_h·d_k]
  at::Tensor u_, v_;                  // [N_h, d_k, R]: P_iᵀ B, Q_iᵀ C
};

// Factors held explicitly: per sweep four [D, N_h·d_k] × [N_h·d_k, R] GEMMs (U, V and the two
// MTTKRPs) plus two [R, D] × [D, R] Grams. Used when N_h·d_k > 2·min(D_q, D_k); otherwise
// RunCoefficientAls below does less.
class DirectSource : public FactorizedSourceBase {
 public:
  DirectSource(const at::Tensor& P, const at::Tensor& Q) : FactorizedSourceBase(P, Q) {}

  at::Tensor SetQuery(const at::Tensor& B) override {
    b_ = B;
    u_ = Heads(at::matmul(p_flat_.t(), B));
    return at::matmul(B.t(), B);
  }
  at::Tensor SetKey(const at::Tensor& C) override {
    c_ = C;
    v_ = Heads(at::matmul(q_flat_.t(), C));
    return at::matmul(C.t(), C);
  }
  void ScaleQuery(const at::Tensor& scale) override {
    b_ = b_ * scale;
    u_ = u_ * scale;
  }
  void ScaleKey(const at::Tensor& scale) override {
    c_ = c_ * scale;
    v_ = v_ * scale;
  }
  at::Tensor ForQuery(const at::Tensor& A) override {
    return at::matmul(p_flat_, Weighted(v_, A));
  }
  at::Tensor ForKey(const at::Tensor& A) override { return at::matmul(q_flat_, Weighted(u_, A)); }
  double KeyInner(const at::Tensor& key_mttkrp) override { return InnerAsDouble(key_mttkrp, c_); }
  at::Tensor Query() override { return b_; }
  at::Tensor Key() override { return c_; }

 private:
  at::Tensor b_, c_;
};

// The textbook route: unfolding × explicit Khatri–Rao product.
class DenseSource : public MttkrpSource {
 public:
  explicit DenseSource(const at::Tensor& T)
      : heads_(T.size(0)),
        dq_(T.size(1)),
        dk_(T.size(2)),
        unfold_mixing_(T.reshape({heads_, dq_ * dk_})),
        unfold_query_(T.permute({1, 0, 2}).reshape({dq_, heads_ * dk_}).contiguous()),
        unfold_key_(T.permute({2, 0, 1}).reshape({dk_, heads_ * dq_}).contiguous()) {}

  const at::Tensor& unfold_query() const { return unfold_query_; }
  const at::Tensor& unfold_key() const { return unfold_key_; }

  at::Tensor SetQuery(const at::Tensor& B) override {
    b_ = B;
    return at::matmul(B.t(), B);
  }
  at::Tensor SetKey(const at::Tensor& C) override {
    c_ = C;
    return at::matmul(C.t(), C);
  }
  void ScaleQuery(const at::Tensor& scale) override { b_ = b_ * scale; }
  void ScaleKey(const at::Tensor& scale) override { c_ = c_ * scale; }
  at::Tensor ForMixing() override { return at::matmul(unfold_mixing_, KhatriRao(b_, c_)); }
  at::Tensor ForQuery(const at::Tensor& A) override {
    return at::matmul(unfold_query_, KhatriRao(A, c_));
  }
  at::Tensor ForKey(const at::Tensor& A) override {
    return at::matmul(unfold_key_, KhatriRao(A, b_));
  }
  double KeyInner(const at::Tensor& key_mttkrp) override { return InnerAsDouble(key_mttkrp, c_); }
  at::Tensor Query() override { return b_; }
  at::Tensor Key() override { return c_; }

 private:
  // Row i·J + j is X[i, :] ∗ Y[j, :].
  static at::Tensor KhatriRao(const at::Tensor& X, const at::Tensor& Y) {
    return (X.unsqueeze(1) * Y.unsqueeze(0)).reshape({X.size(0) * Y.size(0), X.size(1)});
  }

  const int64_t heads_, dq_, dk_;
  const at::Tensor unfold_mixing_, unfold_query_, unfold_key_;
  at::Tensor b_, c_;
};

// Column norms from a Gram matrix's diagonal (1 for a zero column).
at::Tensor ColumnNorms(const at::Tensor& gram) {
  at::Tensor norms = gram.diagonal().sqrt();
  return at::where(norms > 0, norms, at::ones_like(norms));
}

// oneDNN's sgemm (util::DnnlSgemm) unless COLLABSERVE_CP_GEMM=aten; null without it.
util::DnnlSgemmFn FindDnnlSgemm() {
  static const util::DnnlSgemmFn fn =
      util::EnvString("COLLABSERVE_CP_GEMM") == "aten" ? nullptr : util::DnnlSgemm();
  return fn;
}

bool IsRowMajor(const at::Tensor& t) {
  return t.dim() == 2 && t.stride(1) == 1 && t.stride(0) >= std::max<int64_t>(1, t.size(1));
}

// out = a · b for 2-D tensors (a may be the transpose of a row-major matrix, out a row-major
// view). The float32 products of the coefficient sweeps go to oneDNN's sgemm when it is
// available and the calling thread runs ATen single-threaded (the command's layer workers): on
// this machine's [768, 768] × [768, 384] and [384, 768] × [768, 384] shapes it took 2.5 and
// 1.4 ms against 3.0 and 1.6 ms for at::mm_out (OpenBLAS), one thread, with the same results
// (bench/compress/RESULTS.md, section 7); with two threads per layer it was not faster.
// Everything else goes to at::mm_out.
void MatMulInto(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  const util::DnnlSgemmFn sgemm = FindDnnlSgemm();
  if (sgemm != nullptr && at::get_num_threads() == 1 && a.scalar_type() == at::kFloat &&
      b.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && a.is_cpu() &&
      b.is_cpu() && out.is_cpu() && IsRowMajor(b) && IsRowMajor(out) && (IsRowMajor(a) || IsRowMajor(a.t())) &&
      out.size(0) == a.size(0) && out.size(1) == b.size(1) && a.size(1) == b.size(0)) {
    const bool transposed = !IsRowMajor(a);
    const at::Tensor stored = transposed ? a.t() : a;
    const int status =
        sgemm(transposed ? 'T' : 'N', 'N', a.size(0), b.size(1), a.size(1), 1.0f,
              stored.data_ptr<float>(), stored.stride(0), b.data_ptr<float>(), b.stride(0), 0.0f,
              out.data_ptr<float>(), out.stride(0));
    if (status == 0) return;
  }
  at::mm_out(out, a, b);
}

// zᵀu into out ([R, R]) when the product is symmetric, as the Grams zᵀ(K z) of RunCoefficientAls
// (K symmetric). For R >= 192 only the blocks on and above the diagonal of a k × k grid
// (k = min(4, R / 96)) are multiplied, 10 of 16 products at R = 384 (1.33 against 1.55 ms for the
// whole [384, 768] × [768, 384] float32 product on one thread, bench/compress/RESULTS.md section
// 7), and the blocks below are their mirror images; those above are bitwise the whole product's.
void SymmetricGramInto(const at::Tensor& z, const at::Tensor& u, at::Tensor& out) {
  const int64_t rank = z.size(1);
  const int64_t blocks = std::min<int64_t>(4, rank / 96);
  if (blocks < 2) {
    MatMulInto(z.t(), u, out);
    return;
  }
  auto edge = [&](int64_t b) { return rank * b / blocks; };
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t start = edge(b), size = edge(b + 1) - start;
    at::Tensor rows = out.narrow(0, start, size).narrow(1, start, rank - start);
    MatMulInto(z.narrow(1, start, size).t(), u.narrow(1, start, rank - start), rows);
  }
  for (int64_t b = 1; b < blocks; ++b) {
    const int64_t start = edge(b), size = edge(b + 1) - start;
    out.narrow(0, start, size).narrow(1, 0, start).copy_(out.narrow(0, 0, start).narrow(1, start, size).t());
  }
}

// The ALS sweeps shared by all algorithms. Sweep order A, B, C; after the B and C updates their
// columns are normalised and the norms moved into A (T̂ unchanged). The error comes from the last
// MTTKRP and the Gram matrices: ||T − T̂||² = ||T||² − 2<T, T̂> + ||T̂||² with
// <T, T̂> = <MTTKRP_C, C> and ||T̂||² = Σ AᵀA ∗ BᵀB ∗ CᵀC.
CpResult RunAls(MttkrpSource& source, double norm_sq, const at::Tensor& B0, const at::Tensor& C0,
                const CpAlsOptions& options, Clock::time_point start) {
  CpResult result;
  at::Tensor gram_b = source.SetQuery(B0);
  at::Tensor gram_c = source.SetKey(C0);
  at::Tensor A;
  const auto sweeps_start = Clock::now();
  result.setup_seconds = std::chrono::duration<double>(sweeps_start - start).count();
  for (int iter = 1; iter <= options.max_iters; ++iter) {
    A = SolveGram(source.ForMixing(), gram_b * gram_c);
    at::Tensor gram_a = at::matmul(A.t(), A);

    gram_b = source.SetQuery(SolveGram(source.ForQuery(A), gram_a * gram_c));
    at::Tensor norms = ColumnNorms(gram_b);
    at::Tensor outer = norms.unsqueeze(1) * norms.unsqueeze(0);
    source.ScaleQuery(norms.reciprocal());
    gram_b = gram_b / outer;
    A = A * norms;
    gram_a = gram_a * outer;

    at::Tensor mttkrp_c = source.ForKey(A);
    gram_c = source.SetKey(SolveGram(mttkrp_c, gram_a * gram_b));
    const double inner = source.KeyInner(mttkrp_c);
    norms = ColumnNorms(gram_c);
    outer = norms.unsqueeze(1) * norms.unsqueeze(0);
    source.ScaleKey(norms.reciprocal());
    gram_c = gram_c / outer;
    A = A * norms;
    gram_a = gram_a * outer;

    const double estimate_sq =
        (gram_a.to(at::kDouble) * gram_b.to(at::kDouble) * gram_c.to(at::kDouble))
            .sum()
            .item<double>();
    if (RecordSweep(iter, RelativeFromInner(norm_sq, inner, estimate_sq), options, &result)) {
      break;
    }
  }
  result.sweep_seconds = SecondsSince(sweeps_start);
  result.relative_error = result.error_history.back();
  result.mixing = A.to(at::kFloat).contiguous();
  result.query = source.Query().to(at::kFloat).contiguous();
  result.key = source.Key().to(at::kFloat).contiguous();
  return result;
}

// The factorised sweeps when N_h·d_k <= 2·min(D_q, D_k) (every BERT: N_h·d_k == D), the same
// iterates as RunAls with fewer operations. After its first update B lies in the column space of
// the stacked P: B = P_flat Z_b diag(s_b) with Z_b = W (AᵀA ∗ CᵀC)⁻¹ and W = [V_i diag A_i]_i,
// so the MTTKRP P_flat W is never formed: U = P_flatᵀ B = K_p Z_b diag(s_b) with K_p = P_flatᵀ
// P_flat ([n, n], n = N_h·d_k) precomputed, and BᵀB = diag(s_b) Z_bᵀ U diag(s_b). Symmetrically
// for C. Per sweep, with n = N_h·d_k:
//   * GEMMs: K_p Z_b and K_q Z_c (2·n²·R multiply-adds), the Grams Z_bᵀ(K_p Z_b) and
//     Z_cᵀ(K_q Z_c) (2·n·R²), the two solves W·G⁻¹ (2·n·R², BLAS symm with the inverse);
//   * LAPACK (gram_solve.h): three R×R Cholesky factorisations and two inverses from them;
//   * four element-wise passes over [n, R]: the two weighted MTTKRP coefficients W and the
//     per-head column sums of U ∗ V.
// What RunAls does on top, and this avoids: the column normalisation of B and C is kept as the
// scale vectors s_b, s_c (folded into the [N_h, R] A-sized factors that multiply U and V) instead
// of rescaling Z and U ([n, R]) each sweep; the mode-A MTTKRP (per-head column sums of U ∗ V) is
// computed once, after the C update, where it also gives <T, T̂> = Σ (A diag s_b) ∗ colsums; and
// ||T̂||² = Σ (AᵀA ∗ BᵀB) ∗ CᵀC reuses the Hadamard product of the C solve. The [n, R] buffers
// are allocated once (out= variants).
// P, Q: [N_h, D, d_k] in the compute dtype; B0, C0: the initial factors. Returns A in
// result.mixing and the explicit B, C (compute dtype) in result.query / result.key.
CpResult RunCoefficientAls(const at::Tensor& P, const at::Tensor& Q, double norm_sq,
                           const at::Tensor& B0, const at::Tensor& C0, const CpAlsOptions& options,
                           Clock::time_point start) {
  const int64_t heads = P.size(0), head_size = P.size(2), rank = B0.size(1);
  const at::Tensor p_flat = StackHeads(P), q_flat = StackHeads(Q);  // [D, n]
  const int64_t n = p_flat.size(1);
  const at::Tensor kernel_p = at::mm(p_flat.t(), p_flat);  // [n, n]
  const at::Tensor kernel_q = at::mm(q_flat.t(), q_flat);
  auto as_heads = [&](const at::Tensor& flat) { return flat.view({heads, head_size, rank}); };
  auto outer = [](const at::Tensor& x) { return x.unsqueeze(1) * x.unsqueeze(0); };

  // One point of the iteration in normal form: B = P_flat z_b diag(scale_b) with unit columns,
  // u = K_p z_b (so P_flatᵀ B = u diag(scale_b)), gram_b = BᵀB; the same for C; A carries the
  // norms; uv[i, r] = Σ_t u_i[t, r] v_i[t, r] (unscaled). z_b, u, z_c, v are [n, R] buffers
  // allocated once and written in place; the rest are [R, R] or smaller.
  struct Point {
    at::Tensor z_b, u, z_c, v, A, scale_b, scale_c, gram_b, gram_c, uv;
  };
  at::Tensor products = at::empty({n, rank}, p_flat.options());
  auto head_sums = [&](const at::Tensor& u, const at::Tensor& v) {
    at::mul_out(products, u, v);
    return as_heads(products).sum(1);
  };
  // Plain ALS updates one point in place. The line search needs three: the last sweep's end
  // point, the one before it and the extrapolated one; which buffer plays which part rotates, so
  // nothing is copied.
  Point points[3];
  const int num_points = options.line_search ? 3 : 1;
  for (int i = 0; i < num_points; ++i) {
    for (at::Tensor* t : {&points[i].z_b, &points[i].u, &points[i].z_c, &points[i].v}) {
      *t = at::empty({n, rank}, p_flat.options());
    }
  }
  // The start: B0 and C0 as given (no coefficients yet: A is updated first, from u and v alone).
  at::mm_out(points[0].u, p_flat.t(), B0);
  at::mm_out(points[0].v, q_flat.t(), C0);
  points[0].gram_b = at::mm(B0.t(), B0);
  points[0].gram_c = at::mm(C0.t(), C0);
  points[0].scale_b = at::ones({rank}, p_flat.options());
  points[0].scale_c = at::ones({rank}, p_flat.options());
  points[0].uv = head_sums(points[0].u, points[0].v);
  at::Tensor w = at::empty({n, rank}, p_flat.options());
  at::Tensor w_heads = as_heads(w);
  // The raw Grams zᵀu of B and C, consumed within the sweep or extrapolation that forms them.
  at::Tensor gram_scratch[2] = {at::empty({rank, rank}, p_flat.options()),
                                at::empty({rank, rank}, p_flat.options())};

  // One ALS sweep from `from` into `to`; `to` may be `from` (each buffer of `from` is last read
  // before `to`'s is written). Returns the relative error of `to`.
  auto sweep = [&](const Point& from, Point& to) {
    at::Tensor A = SolveGram(from.uv * (from.scale_b * from.scale_c), from.gram_b * from.gram_c);
    at::Tensor gram_a = at::mm(A.t(), A);

    // B: W = [V_i diag(A_i)]_i with V = v diag(s_c).
    at::mul_out(w_heads, as_heads(from.v), (A * from.scale_c).unsqueeze(1));
    SolveGramInto(w, gram_a * from.gram_c, to.z_b);
    MatMulInto(kernel_p, to.z_b, to.u);
    at::Tensor gram_raw = gram_scratch[0];
    SymmetricGramInto(to.z_b, to.u, gram_raw);
    at::Tensor norms = ColumnNorms(gram_raw);
    to.scale_b = norms.reciprocal();
    to.gram_b = gram_raw * outer(to.scale_b);
    A.mul_(norms);
    gram_a.mul_(outer(norms));

    // C: W = [U_i diag(A_i)]_i with U = u diag(s_b).
    const at::Tensor a_b = A * to.scale_b;
    at::mul_out(w_heads, as_heads(to.u), a_b.unsqueeze(1));
    const at::Tensor gram_ab = gram_a * to.gram_b;
    SolveGramInto(w, gram_ab.clone(), to.z_c);
    MatMulInto(kernel_q, to.z_c, to.v);
    gram_raw = gram_scratch[1];
    SymmetricGramInto(to.z_c, to.v, gram_raw);
    to.uv = head_sums(to.u, to.v);
    // <T, T̂> = <Q_flat W, Q_flat Z_c> = <W, v> and ||T̂||² = Σ (AᵀA ∗ BᵀB) ∗ Z_cᵀ v, both with
    // C = Q_flat Z_c unscaled and A before it takes C's norms.
    const double inner = (a_b * to.uv).sum(at::kDouble).item<double>();
    const double estimate_sq = (gram_ab * gram_raw).sum(at::kDouble).item<double>();
    norms = ColumnNorms(gram_raw);
    to.scale_c = norms.reciprocal();
    to.gram_c = gram_raw * outer(to.scale_c);
    to.A = A.mul_(norms);
    return RelativeFromInner(norm_sq, inner, estimate_sq);
  };

  // Bro's extrapolation x + s·(x − prev) of A and of the effective coefficients z·diag(scale) of B
  // and C, into `to`. u = K_p z and v = K_q z are linear in the coefficients, so the new u, v cost
  // one element-wise pass each like the new z: z_to = z_x + c·z_prev with the column factor
  // c = −s/(1+s)·scale_prev/scale_x, and the scale (1+s)·scale_x folded into A. Its error needs
  // the Grams z_toᵀu_to, z_toᵀv_to ([R, n] × [n, R]; computing them from the Grams of x and prev
  // plus cross terms cancels badly in float32). Returns the error of `to`; `to` is left in normal
  // form only when `keep_if_below` is above it (otherwise it is scratch).
  auto extrapolate = [&](const Point& x, const Point& prev, double step, double keep_if_below,
                         Point& to) {
    const at::Tensor c_b = prev.scale_b / x.scale_b * (-step / (1 + step));
    const at::Tensor c_c = prev.scale_c / x.scale_c * (-step / (1 + step));
    at::addcmul_out(to.z_b, x.z_b, prev.z_b, c_b);
    at::addcmul_out(to.u, x.u, prev.u, c_b);
    at::addcmul_out(to.z_c, x.z_c, prev.z_c, c_c);
    at::addcmul_out(to.v, x.v, prev.v, c_c);
    at::Tensor& gram_b_raw = gram_scratch[0];
    at::Tensor& gram_c_raw = gram_scratch[1];
    SymmetricGramInto(to.z_b, to.u, gram_b_raw);
    SymmetricGramInto(to.z_c, to.v, gram_c_raw);
    const at::Tensor uv = head_sums(to.u, to.v);
    // A with both scales folded in: T̂ = Σ_r A[:, r] ∘ (P_flat z_b[:, r]) ∘ (Q_flat z_c[:, r]).
    const at::Tensor a = (x.A * (1 + step) - prev.A * step) *
                         (x.scale_b * x.scale_c * ((1 + step) * (1 + step)));
    const double inner = (a * uv).sum(at::kDouble).item<double>();
    const double estimate_sq =
        (at::mm(a.t(), a) * gram_b_raw * gram_c_raw).sum(at::kDouble).item<double>();
    const double rel = RelativeFromInner(norm_sq, inner, estimate_sq);
    if (rel < keep_if_below) {
      const at::Tensor norms_b = ColumnNorms(gram_b_raw), norms_c = ColumnNorms(gram_c_raw);
      to.scale_b = norms_b.reciprocal();
      to.scale_c = norms_c.reciprocal();
      to.gram_b = gram_b_raw * outer(to.scale_b);
      to.gram_c = gram_c_raw * outer(to.scale_c);
      to.uv = uv;
      to.A = a * (norms_b * norms_c);
    }
    return rel;
  };

  CpResult result;
  // Line search: `last` holds the previous sweep's end point before any extrapolation (the
  // direction is always that of one plain sweep); -1 until there is one.
  int current = 0, last = -1;
  auto unused = [](int a, int b) {
    for (int i = 0;; ++i) {
      if (i != a && i != b) return i;
    }
  };
  const auto sweeps_start = Clock::now();
  result.setup_seconds = std::chrono::duration<double>(sweeps_start - start).count();
  for (int iter = 1; iter <= options.max_iters; ++iter) {
    if (!options.line_search) {
      if (RecordSweep(iter, sweep(points[0], points[0]), options, &result)) break;
      continue;
    }
    // The sweep writes into a buffer that is neither its start nor the previous end point (the
    // start itself is free once read, but in place only works for plain ALS's one point).
    const int end = unused(current, last < 0 ? current : last);
    double rel = sweep(points[current], points[end]);
    current = end;
    if (last >= 0) {
      // Bro's step iter^(1/3); kept only when the error falls, so it never rises.
      const int next = unused(end, last);
      const double next_rel =
          extrapolate(points[end], points[last], std::cbrt(static_cast<double>(iter)), rel, points[next]);
      if (next_rel < rel) {
        rel = next_rel;
        ++result.extrapolations;
        current = next;
      }
    }
    last = end;
    if (RecordSweep(iter, rel, options, &result)) break;
  }
  result.sweep_seconds = SecondsSince(sweeps_start);
  result.relative_error = result.error_history.back();
  const Point& final_point = points[current];
  result.mixing = final_point.A.to(at::kFloat).contiguous();
  // max_iters >= 1, so both have been updated at least once.
  result.query = at::mm(p_flat, final_point.z_b).mul_(final_point.scale_b).to(at::kFloat);
  result.key = at::mm(q_flat, final_point.z_c).mul_(final_point.scale_c).to(at::kFloat);
  return result;
}

// ||T||² for T_i = P_i Q_iᵀ: Σ_i Σ (P_iᵀP_i) ∗ (Q_iᵀQ_i), in float64.
double FactorizedNormSq(const at::Tensor& P64, const at::Tensor& Q64) {
  at::Tensor pp = at::matmul(P64.transpose(1, 2), P64);
  at::Tensor qq = at::matmul(Q64.transpose(1, 2), Q64);
  return (pp * qq).sum().item<double>();
}

CpResult ExactBlockCpUnchecked(const at::Tensor& P, const at::Tensor& Q, int64_t rank) {
  const auto start = Clock::now();
  const int64_t heads = P.size(0), head_size = P.size(2);
  const int64_t block = heads * head_size;
  at::TensorOptions to = P.options().dtype(at::kFloat);
  CpResult result;
  result.query = at::zeros({P.size(1), rank}, to);
  result.key = at::zeros({Q.size(1), rank}, to);
  result.mixing = at::zeros({heads, rank}, to);
  result.query.narrow(1, 0, block).copy_(P.permute({1, 0, 2}).reshape({P.size(1), block}));
  result.key.narrow(1, 0, block).copy_(Q.permute({1, 0, 2}).reshape({Q.size(1), block}));
  // A[i, i·d_k + t] = 1: the identity with each column repeated d_k times.
  result.mixing.narrow(1, 0, block)
      .copy_(at::eye(heads, to).unsqueeze(2).expand({heads, heads, head_size}).reshape({heads, block}));
  result.exact = true;
  result.iterations = 0;
  result.seconds = SecondsSince(start);
  return result;
}

// norm_sq: ||T||² when the caller has it (computed here otherwise). The projections P_iᵀB are one
// [n, D] × [D, R] GEMM on the stacked heads (a batched matmul over heads is ~30% slower).
absl::StatusOr<double> RelativeErrorUnchecked(const at::Tensor& P, const at::Tensor& Q,
                                              const at::Tensor& A, const at::Tensor& B,
                                              const at::Tensor& C,
                                              std::optional<double> norm_sq = std::nullopt) {
  const int64_t heads = P.size(0), head_size = P.size(2), rank = A.size(1);
  const at::Tensor P64 = P.to(at::kDouble), Q64 = Q.to(at::kDouble);
  const at::Tensor A64 = A.to(at::kDouble), B64 = B.to(at::kDouble), C64 = C.to(at::kDouble);
  if (!norm_sq) norm_sq = FactorizedNormSq(P64, Q64);
  at::Tensor u = at::mm(StackHeads(P64).t(), B64).view({heads, head_size, rank});
  at::Tensor v = at::mm(StackHeads(Q64).t(), C64).view({heads, head_size, rank});
  const double inner = (A64 * (u * v).sum(1)).sum().item<double>();
  const double estimate_sq =
      (at::mm(A64.t(), A64) * at::mm(B64.t(), B64) * at::mm(C64.t(), C64)).sum().item<double>();
  const double residual = std::sqrt(std::max(0.0, *norm_sq - 2 * inner + estimate_sq));
  return *norm_sq > 0 ? residual / std::sqrt(*norm_sq) : residual;
}

}  // namespace

absl::StatusOr<CpResult> FactorizedCpAls(const at::Tensor& P, const at::Tensor& Q,
                                         const CpAlsOptions& options) {
  constexpr char kFn[] = "FactorizedCpAls";
  return CatchAll<CpResult>(kFn, [&]() -> absl::StatusOr<CpResult> {
    RETURN_IF_ERROR(CheckOptions(kFn, options));
    RETURN_IF_ERROR(CheckFactors(kFn, P, Q));
    const auto start = Clock::now();
    const int64_t heads = P.size(0), head_size = P.size(2);
    if (options.rank >= heads * head_size) {
      CpResult result = ExactBlockCpUnchecked(P, Q, options.rank);
      ASSIGN_OR_RETURN(result.relative_error,
                       RelativeErrorUnchecked(P, Q, result.mixing, result.query, result.key));
      result.seconds = SecondsSince(start);
      return result;
    }
    const at::ScalarType dtype = ComputeType(options);
    const at::Tensor Pc = P.to(dtype), Qc = Q.to(dtype);
    const double norm_sq = FactorizedNormSq(P.to(at::kDouble), Q.to(at::kDouble));

    std::mt19937_64 rng(options.seed);
    at::Tensor B, C;
    if (options.init == CpAlsOptions::Init::kSvd) {
      // Gram of the mode-2 unfolding [T_1 … T_N]: Σ_i P_i (Q_iᵀQ_i) P_iᵀ = [P_i Q_iᵀQ_i]_i [P_i]_iᵀ,
      // a [D_q, N_h·d_k] × [N_h·d_k, D_q] product; symmetrically for the key mode.
      auto stacked = [&](const at::Tensor& X) {
        return X.permute({1, 0, 2}).reshape({X.size(1), heads * head_size});
      };
      const at::Tensor pp = at::matmul(Pc.transpose(1, 2), Pc);  // [N_h, d_k, d_k]
      const at::Tensor qq = at::matmul(Qc.transpose(1, 2), Qc);
      B = LeadingEigenvectors(at::matmul(stacked(at::matmul(Pc, qq)), stacked(Pc).t()),
                              options.rank, rng);
      C = LeadingEigenvectors(at::matmul(stacked(at::matmul(Qc, pp)), stacked(Qc).t()),
                              options.rank, rng);
    } else {
      B = RandomNormal(Pc.size(1), options.rank, rng, Pc.options());
      C = RandomNormal(Qc.size(1), options.rank, rng, Qc.options());
    }
    // The coefficient form needs (N_h·d_k)² per GEMM where the direct one needs 2·D·N_h·d_k.
    CpResult result;
    if (heads * head_size <= std::min(Pc.size(1), Qc.size(1)) * 2) {
      result = RunCoefficientAls(Pc, Qc, norm_sq, B, C, options, start);
    } else {
      DirectSource source(Pc, Qc);
      result = RunAls(source, norm_sq, B, C, options, start);
    }
    if (Cancelled(options)) return CancelledAfter(result);
    // The sweeps' Gram-based errors carry the compute precision (float32 cannot resolve errors
    // below ~1e-3); one float64 pass gives the error of the factors actually returned.
    ASSIGN_OR_RETURN(result.relative_error, RelativeErrorUnchecked(P, Q, result.mixing,
                                                                   result.query, result.key,
                                                                   norm_sq));
    result.seconds = SecondsSince(start);
    result.finish_seconds = result.seconds - result.setup_seconds - result.sweep_seconds;
    return result;
  });
}

absl::StatusOr<CpResult> ExactBlockCp(const at::Tensor& P, const at::Tensor& Q) {
  constexpr char kFn[] = "ExactBlockCp";
  return CatchAll<CpResult>(kFn, [&]() -> absl::StatusOr<CpResult> {
    RETURN_IF_ERROR(CheckFactors(kFn, P, Q));
    const auto start = Clock::now();
    CpResult result = ExactBlockCpUnchecked(P, Q, P.size(0) * P.size(2));
    ASSIGN_OR_RETURN(result.relative_error,
                     RelativeErrorUnchecked(P, Q, result.mixing, result.query, result.key));
    result.seconds = SecondsSince(start);
    return result;
  });
}

absl::StatusOr<CpResult> DenseCpAls(const at::Tensor& T, const CpAlsOptions& options) {
  constexpr char kFn[] = "DenseCpAls";
  return CatchAll<CpResult>(kFn, [&]() -> absl::StatusOr<CpResult> {
    RETURN_IF_ERROR(CheckOptions(kFn, options));
    RETURN_IF_ERROR(CheckTensor(kFn, "T", T, 3));
    const auto start = Clock::now();
    const at::Tensor Tc = T.to(ComputeType(options));
    const double norm_sq = T.to(at::kDouble).square().sum().item<double>();
    DenseSource source(Tc);
    std::mt19937_64 rng(options.seed);
    at::Tensor B, C;
    if (options.init == CpAlsOptions::Init::kSvd) {
      const at::Tensor& xq = source.unfold_query();
      const at::Tensor& xk = source.unfold_key();
      B = LeadingEigenvectors(at::matmul(xq, xq.t()), options.rank, rng);
      C = LeadingEigenvectors(at::matmul(xk, xk.t()), options.rank, rng);
    } else {
      B = RandomNormal(Tc.size(1), options.rank, rng, Tc.options());
      C = RandomNormal(Tc.size(2), options.rank, rng, Tc.options());
    }
    CpResult result = RunAls(source, norm_sq, B, C, options, start);
    if (Cancelled(options)) return CancelledAfter(result);
    result.seconds = SecondsSince(start);
    result.finish_seconds = result.seconds - result.setup_seconds - result.sweep_seconds;
    return result;
  });
}

absl::StatusOr<double> FactorizedRelativeError(const at::Tensor& P, const at::Tensor& Q,
                                               const at::Tensor& A, const at::Tensor& B,
                                               const at::Tensor& C) {
  constexpr char kFn[] = "FactorizedRelativeError";
  return CatchAll<double>(kFn, [&]() -> absl::StatusOr<double> {
    RETURN_IF_ERROR(CheckFactors(kFn, P, Q));
    RETURN_IF_ERROR(CheckTensor(kFn, "A", A, 2));
    RETURN_IF_ERROR(CheckTensor(kFn, "B", B, 2));
    RETURN_IF_ERROR(CheckTensor(kFn, "C", C, 2));
    RETURN_IF_ERROR(CheckSameDevice(kFn, "P", P, "A", A));
    RETURN_IF_ERROR(CheckSameDevice(kFn, "P", P, "B", B));
    RETURN_IF_ERROR(CheckSameDevice(kFn, "P", P, "C", C));
    const int64_t rank = A.size(1);
    if (A.size(0) != P.size(0) || B.size(0) != P.size(1) || C.size(0) != Q.size(1) ||
        B.size(1) != rank || C.size(1) != rank) {
      return absl::InvalidArgumentError(absl::StrCat(
          kFn, ": A, B, C must be [N_h, R], [D_q, R], [D_k, R] for P ", ShapeString(P), " and Q ",
          ShapeString(Q), ", got A ", ShapeString(A), ", B ", ShapeString(B), ", C ",
          ShapeString(C)));
    }
    return RelativeErrorUnchecked(P, Q, A, B, C);
  });
}

}  // namespace collabserve::compress
