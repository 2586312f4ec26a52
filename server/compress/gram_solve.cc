#include "server/compress/gram_solve.h"

#include <ATen/ATen.h>
#include <dlfcn.h>

#include <cstddef>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "server/util/process_env.h"

namespace collabserve::compress {
namespace {

// LAPACK's and BLAS's routines, looked up at run time in the process (the libraries LibTorch
// itself calls), for float (s) and double (d); all or none. Declared with gfortran's hidden
// lengths of the character arguments, which C implementations (OpenBLAS's) ignore.
struct Lapack {
  using Potrf = void (*)(const char* uplo, const int* n, void* a, const int* lda, int* info,
                         size_t uplo_len);
  using Trsm = void (*)(const char* side, const char* uplo, const char* transa, const char* diag,
                        const int* m, const int* n, const void* alpha, const void* a,
                        const int* lda, void* b, const int* ldb, size_t side_len,
                        size_t uplo_len, size_t transa_len, size_t diag_len);
  using Symm = void (*)(const char* side, const char* uplo, const int* m, const int* n,
                        const void* alpha, const void* a, const int* lda, const void* b,
                        const int* ldb, const void* beta, void* c, const int* ldc,
                        size_t side_len, size_t uplo_len);
  using Trtri = void (*)(const char* uplo, const char* diag, const int* n, void* a, const int* lda,
                         int* info, size_t uplo_len, size_t diag_len);
  struct Routines {
    Potrf potrf = nullptr, potri = nullptr, lauum = nullptr;  // potri, lauum: potrf's signature
    Trtri trtri = nullptr;
    Trsm trsm = nullptr;
    Symm symm = nullptr;
  };
  Routines s, d;
};

// Null when the symbols are not found (e.g. a LibTorch that links MKL statically and hides them).
const Lapack* FindLapack() {
  static const Lapack* const lapack = []() -> const Lapack* {
    // The routines of one precision: BLAS/LAPACK names are the precision's letter + the routine.
    auto load = [](char precision, Lapack::Routines* r) {
      auto find = [precision](const char* routine) {
        return ::dlsym(RTLD_DEFAULT, (std::string(1, precision) + routine).c_str());
      };
      *r = {reinterpret_cast<Lapack::Potrf>(find("potrf_")),
            reinterpret_cast<Lapack::Potrf>(find("potri_")),
            reinterpret_cast<Lapack::Potrf>(find("lauum_")),
            reinterpret_cast<Lapack::Trtri>(find("trtri_")),
            reinterpret_cast<Lapack::Trsm>(find("trsm_")),
            reinterpret_cast<Lapack::Symm>(find("symm_"))};
      return r->potrf && r->potri && r->lauum && r->trtri && r->trsm && r->symm;
    };
    static Lapack l;
    return load('s', &l.s) && load('d', &l.d) ? &l : nullptr;
  }();
  return lapack;
}

// COLLABSERVE_CP_SOLVE: "aten" makes kAuto use kAten; "potri" makes kLapack invert with LAPACK's
// potri instead of the blocked inverse below (both for measurements).
bool AtenChosenByEnvironment() {
  static const bool aten = util::EnvString("COLLABSERVE_CP_SOLVE") == "aten";
  return aten;
}

bool PotriChosenByEnvironment() {
  static const bool potri = util::EnvString("COLLABSERVE_CP_SOLVE") == "potri";
  return potri;
}

// Inverts in place the upper-triangular square block U (row-major, zeros below the diagonal) of
// a contiguous matrix: U = [[A, B], [0, C]] has U⁻¹ = [[A⁻¹, −A⁻¹ B C⁻¹], [0, C⁻¹]], so all but
// the ≤ 64 × 64 diagonal blocks (trtri) is two GEMMs per level. LAPACK's trtri on the whole
// 384 × 384 block ran at ~36 GFLOP/s (its level-2 kernels) against ~150 for these GEMMs.
template <typename Scalar>
void InvertUpperTriangular(const Lapack::Routines& f, at::Tensor U) {
  const int64_t n = U.size(0);
  if (n <= 64) {
    // Row-major upper = column-major lower with the same leading dimension.
    const int size = static_cast<int>(n), ld = static_cast<int>(U.stride(0));
    int info = 0;
    f.trtri("L", "N", &size, U.data_ptr<Scalar>(), &ld, &info, 1, 1);
    return;
  }
  const int64_t half = (n / 2 + 15) / 16 * 16;
  at::Tensor A = U.narrow(0, 0, half).narrow(1, 0, half);
  at::Tensor B = U.narrow(0, 0, half).narrow(1, half, n - half);
  at::Tensor C = U.narrow(0, half, n - half).narrow(1, half, n - half);
  InvertUpperTriangular<Scalar>(f, A);
  InvertUpperTriangular<Scalar>(f, C);
  const at::Tensor ab = at::mm(A, B);
  at::addmm_out(B, B, ab, C, /*beta=*/0, /*alpha=*/-1);
}

bool CanUseLapack(const at::Tensor& M, const at::Tensor& G, const at::Tensor& out) {
  const at::ScalarType dtype = G.scalar_type();
  return G.is_cpu() && M.is_cpu() && out.is_cpu() && M.scalar_type() == dtype &&
         out.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kDouble) &&
         G.is_contiguous() && out.is_contiguous() &&
         G.size(0) <= std::numeric_limits<int>::max() &&
         M.size(0) <= std::numeric_limits<int>::max();
}

// Row-major and column-major views of the same buffers: G is symmetric, so its row-major buffer is
// itself in column-major order; a row-major [m, R] matrix is the column-major [R, m] transpose.
// potrf('L') overwrites L's lower (column-major) triangle with the Cholesky factor of G; then
// out = M G⁻¹ is outᵀ = G⁻¹ Mᵀ: for m >= R from the inverse (potri, lower triangle) with symm,
// for m < R by two triangular solves in place. False (out untouched) when G is not numerically
// positive definite.
template <typename Scalar>
bool LapackSolve(const Lapack::Routines& f, const at::Tensor& M, at::Tensor& L, at::Tensor& out) {
  const int r = static_cast<int>(L.size(0)), m = static_cast<int>(M.size(0));
  Scalar* l = L.data_ptr<Scalar>();
  int info = 0;
  f.potrf("L", &r, l, &r, &info, 1);
  if (info != 0) return false;
  const Scalar one = 1, zero = 0;
  if (m < r) {
    out.copy_(M);
    f.trsm("L", "L", "N", "N", &r, &m, &one, l, &r, out.data_ptr<Scalar>(), &r, 1, 1, 1, 1);
    f.trsm("L", "L", "T", "N", &r, &m, &one, l, &r, out.data_ptr<Scalar>(), &r, 1, 1, 1, 1);
    return true;
  }
  if (PotriChosenByEnvironment()) {
    f.potri("L", &r, l, &r, &info, 1);
  } else {
    // L⁻¹ (column-major lower = row-major upper) on a copy with zeros below, then L⁻ᵀ L⁻¹.
    L = L.triu();
    l = L.data_ptr<Scalar>();
    InvertUpperTriangular<Scalar>(f, L);
    f.lauum("L", &r, l, &r, &info, 1);
  }
  if (info != 0) return false;
  const at::Tensor rhs = M.contiguous();
  f.symm("L", "L", &r, &m, &one, l, &r, rhs.data_ptr<Scalar>(), &r, &zero, out.data_ptr<Scalar>(),
         &r, 1, 1);
  return true;
}

}  // namespace

void SolveGramInto(const at::Tensor& M, at::Tensor G, at::Tensor& out, GramSolveMethod method) {
  const int64_t r = G.size(0);
  const double eps = G.scalar_type() == at::kFloat ? std::numeric_limits<float>::epsilon()
                                                   : std::numeric_limits<double>::epsilon();
  const double scale = G.diagonal().max().item<double>();
  if (!(scale > 0)) {
    out.zero_();
    return;
  }
  const double ridge = 10 * eps * scale;
  G.diagonal().add_(ridge);
  const Lapack* lapack = method == GramSolveMethod::kAten ? nullptr : FindLapack();
  if (method == GramSolveMethod::kAuto && AtenChosenByEnvironment()) lapack = nullptr;
  if (lapack != nullptr && CanUseLapack(M, G, out)) {
    at::Tensor L = G.clone();  // G stays intact for the fallback below
    const bool solved = G.scalar_type() == at::kFloat ? LapackSolve<float>(lapack->s, M, L, out)
                                                      : LapackSolve<double>(lapack->d, M, L, out);
    if (solved) return;
  } else {
    at::Tensor L, info;
    std::tie(L, info) = at::linalg_cholesky_ex(G);
    if (info.item<int64_t>() == 0) {
      if (M.size(0) < r) {
        out.copy_(at::cholesky_solve(M.t(), L).t());
      } else {
        at::mm_out(out, M, at::cholesky_inverse(L));
      }
      return;
    }
  }
  G.diagonal().sub_(ridge);
  at::Tensor w, V;
  std::tie(w, V) = at::linalg_eigh(G);
  const double cutoff = w.max().item<double>() * r * eps;
  at::Tensor w_inv = at::where(w > cutoff, w.reciprocal(), at::zeros_like(w));
  out.copy_(at::matmul(at::matmul(M, V * w_inv), V.t()));
}

at::Tensor SolveGram(const at::Tensor& M, at::Tensor G, GramSolveMethod method) {
  at::Tensor out = at::empty(M.sizes(), M.options().memory_format(at::MemoryFormat::Contiguous));
  SolveGramInto(M, std::move(G), out, method);
  return out;
}

}  // namespace collabserve::compress
