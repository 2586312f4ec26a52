#include "server/model/dense_ops.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "server/model/kernels.h"

namespace collabserve::model::internal {
namespace {

// How the CPU float32 dense layers run. kPacked: PackedLinear (weights packed at load, AVX-512)
// for up to kPackedMaxRows tokens, where oneDNN's sgemm spends much of a skinny product packing the
// weight (1.5-2x the GFLOP/s at 16 rows, on par at 128); dnnl_sgemm above that, where its own
// blocking beats ours. kDnnl: dnnl_sgemm for every size (the engine before PackedLinear).
// kAten: at::addmm and ATen attention everywhere. COLLABSERVE_GEMM=aten|dnnl|packed chooses;
// "packed" uses PackedLinear at every size (tests, benchmarks); "nosgemm" is the default on a
// LibTorch that does not export dnnl_sgemm (a PyTorch wheel may link oneDNN without exporting it):
// PackedLinear and ATen ops, no sgemm (the tests of that case).
enum class GemmMode { kAten, kDnnl, kHybrid, kPacked };

GemmMode ChosenGemmMode() {
  static const GemmMode mode = [] {
    const std::string choice = util::EnvString("COLLABSERVE_GEMM");
    if (choice == "aten") return GemmMode::kAten;
    if (choice == "dnnl") return GemmMode::kDnnl;
    if (choice == "packed") return GemmMode::kPacked;
    return GemmMode::kHybrid;
  }();
  return mode;
}

bool SgemmHidden() {
  static const bool hidden = util::EnvString("COLLABSERVE_GEMM") == "nosgemm";
  return hidden;
}

}  // namespace

// oneDNN's row-major SGEMM (dnnl_sgemm, oneDNN >= 1.0), looked up at run time in the libraries
// already loaded: Debian's LibTorch links libdnnl.so.2. Against OpenBLAS 0.3.21 (what at::addmm
// calls there) it saves 5-15% of the CPU time of a BERT-base pass at batch 1-8 (OpenBLAS spends
// most of a skinny product packing the weight), and it lets attention run fused per head
// (FusedAttention). When the symbol is absent (a LibTorch that hides its oneDNN) or
// COLLABSERVE_GEMM=aten, everything goes through ATen ops instead.
SgemmFn FindSgemm() {
  static const SgemmFn fn = [] {
    if (ChosenGemmMode() == GemmMode::kAten || SgemmHidden()) return SgemmFn(nullptr);
    return util::DnnlSgemm();
  }();
  return fn;
}

bool AtenOnly() { return ChosenGemmMode() == GemmMode::kAten; }

bool UsePacking(const c10::Device& device, c10::ScalarType dtype) {
  const GemmMode mode = ChosenGemmMode();
  return device.is_cpu() && dtype == at::kFloat && PackedLinearSupported() &&
         (mode == GemmMode::kHybrid || mode == GemmMode::kPacked);
}

namespace {

// Columns per block when the sgemm runs on a weight kept only packed: the block is unpacked into
// a per-thread buffer (K × 512 floats, 1.5-6 MB for BERT-base) right before its product, which
// reads it from cache. Wide enough that re-reading x once per block costs little next to the
// product itself.
constexpr int64_t kUnpackColumns = 512;

// out[:, n0:n1] += x[rows, K] · w[n0:n1, :]^T on the sgemm (one call on its own threads, or
// single-threaded inside a ThreadTeam run): on the plain weight when the model has it, else on
// `unpacked` (w^T, [K, N]) when given, else on blocks of columns unpacked from the packed copy.
// n0 a multiple of PackedWeight::kPanel.
void SgemmAccumulate(SgemmFn sgemm, const float* x, int64_t ldx, int64_t rows, const DenseWeight& w,
                     float* out, int64_t ldo, int64_t n0, int64_t n1, const float* unpacked = nullptr) {
  if (n1 <= n0 || rows == 0) return;
  if (w.plain.defined()) {
    const int64_t K = w.plain.size(1);
    const int st = sgemm('N', 'T', rows, n1 - n0, K, 1.0f, x, ldx, w.plain.data_ptr<float>() + n0 * K,
                         K, 1.0f, out + n0, ldo);
    TORCH_CHECK(st == 0, "dnnl_sgemm failed with status ", st, " for [", rows, ", ", K, "] x [",
                n1 - n0, ", ", K, "]^T");
    return;
  }
  TORCH_CHECK(w.packed != nullptr, "a dense weight has neither its plain nor its packed form");
  const PackedWeight& p = *w.packed;
  const int64_t K = p.k();
  if (unpacked != nullptr) {
    const int st = sgemm('N', 'N', rows, n1 - n0, K, 1.0f, x, ldx, unpacked + n0, p.n(), 1.0f, out + n0, ldo);
    TORCH_CHECK(st == 0, "dnnl_sgemm failed with status ", st, " for [", rows, ", ", K, "] x [", K,
                ", ", n1 - n0, "]");
    return;
  }
  thread_local std::vector<float> block;
  for (int64_t c0 = n0; c0 < n1; c0 += kUnpackColumns) {
    const int64_t c1 = std::min(n1, c0 + kUnpackColumns), n = c1 - c0;
    if (block.size() < static_cast<size_t>(K * n)) block.resize(K * n);
    p.UnpackColumns(c0, c1, block.data());
    const int st = sgemm('N', 'N', rows, n, K, 1.0f, x, ldx, block.data(), n, 1.0f, out + c0, ldo);
    TORCH_CHECK(st == 0, "dnnl_sgemm failed with status ", st, " for [", rows, ", ", K, "] x [", K,
                ", ", n, "]");
  }
}

// Whether the sgemm computes a product with x (CPU float32) and w (packed, or plain float32).
bool SgemmRuns(const at::Tensor& x, const DenseWeight& w) {
  return FindSgemm() != nullptr && x.is_cpu() && x.scalar_type() == at::kFloat &&
         (!w.plain.defined() || (w.plain.scalar_type() == at::kFloat && w.plain.is_contiguous()));
}

}  // namespace

bool UsePackedLinear(const DenseWeight& w, int64_t rows) {
  return w.packed != nullptr &&
         (ChosenGemmMode() == GemmMode::kPacked || rows <= kPackedMaxRows ||
          (!w.plain.defined() && rows <= kPackedMaxMemberRows) || FindSgemm() == nullptr);
}

at::Tensor Dense(const at::Tensor& x, const DenseWeight& w, const at::Tensor& b,
                 const at::Tensor& residual) {
  const int64_t T = x.size(0), N = b.size(0);
  if (UsePackedLinear(w, T) && x.is_contiguous()) {
    at::Tensor out = at::empty({T, N}, x.options());
    at::Tensor r = residual.defined() ? residual.contiguous() : residual;
    PackedLinear(x.data_ptr<float>(), x.size(1), T, *w.packed, b.data_ptr<float>(),
                 r.defined() ? r.data_ptr<float>() : nullptr, N, out.data_ptr<float>(), N);
    return out;
  }
  if (!SgemmRuns(x, w)) {
    // ATen (CUDA, half types, COLLABSERVE_GEMM=aten), as PyTorch's nn.Linear and residual add: the
    // bias in the product's epilogue (cuBLASLt on CUDA). Accumulating into an output filled with
    // the bias first wrote and re-read the whole output once more (on CUDA, three products of a
    // BERT-base layer are [T, 2304], [T, 3072] and [T, 768] wide).
    TORCH_CHECK(w.plain.defined(), "a dense weight kept only packed needs the sgemm or PackedLinear");
    at::Tensor out = at::linear(x, w.plain, b);
    if (residual.defined()) out.add_(residual);
    return out;
  }
  // out = bias (+ residual), then out += x · w^T on the sgemm. clone, not contiguous(): for T = 1
  // the expanded bias is already contiguous, and contiguous() would return the bias parameter
  // itself, which the accumulating GEMM then overwrote.
  at::Tensor out = residual.defined() ? at::add(residual, b)
                                      : b.unsqueeze(0).expand({T, N}).clone(at::MemoryFormat::Contiguous);
  const at::Tensor xc = x.contiguous();
  SgemmAccumulate(FindSgemm(), xc.data_ptr<float>(), xc.size(1), T, w, out.data_ptr<float>(), N, 0, N);
  return out;
}

// Inside a ThreadTeam run the sgemm is single-threaded.
void DenseColumns(SgemmFn sgemm, const float* x, int64_t ldx, int64_t rows, const DenseWeight& w,
                  bool packed, const float* bias, const float* residual, int64_t ldr, float* out,
                  int64_t ldo, int64_t n0, int64_t n1, const float* unpacked) {
  if (n1 <= n0) return;
  if (packed) {
    PackedLinearColumns(x, ldx, rows, *w.packed, bias, residual, ldr, out, ldo, n0, n1);
    return;
  }
  const int64_t n = n1 - n0;
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * ldo + n0;
    if (residual != nullptr) {
      const float* res = residual + r * ldr + n0;
      for (int64_t j = 0; j < n; ++j) o[j] = res[j] + bias[n0 + j];
    } else {
      std::memcpy(o, bias + n0, n * sizeof(float));
    }
  }
  SgemmAccumulate(sgemm, x, ldx, rows, w, out, ldo, n0, n1, unpacked);
}

at::Tensor LayerNormInPlace(at::Tensor x, const at::Tensor& w, const at::Tensor& b, double eps) {
  if (x.is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2 &&
      w.is_contiguous() && b.is_contiguous()) {
    LayerNormRowsInPlace(x.data_ptr<float>(), x.size(1), x.size(0), x.size(1), w.data_ptr<float>(),
                         b.data_ptr<float>(), eps);
    return x;
  }
  return at::layer_norm(x, {x.size(-1)}, w, b, eps);
}


}  // namespace collabserve::model::internal
