// CPU float32 kernels for the BERT forward pass: a dense layer on weights packed once at load
// time (AVX-512), and an in-place row LayerNorm. They replace chains of ATen ops (prefill the bias,
// GEMM with beta = 1, layer_norm into a new tensor) by single passes over the output. CPU only: the
// CUDA path keeps using ATen ops.
#ifndef COLLABSERVE_SERVER_MODEL_KERNELS_H_
#define COLLABSERVE_SERVER_MODEL_KERNELS_H_

#include <ATen/ATen.h>

#include <cstdint>

namespace collabserve::model {

// True when this CPU can run PackedLinear (AVX-512F). Cheap; cached.
bool PackedLinearSupported();

// A weight w [N, K] (nn.Linear layout: out_features × in_features) re-laid for PackedLinear:
// panels of kPanel output columns, each K × kPanel floats with k outermost, the last panel padded
// with zeros. Immutable after construction; safe to share between threads.
class PackedWeight {
 public:
  static constexpr int64_t kPanel = 32;

  // w: float32, CPU, 2-D. Throws c10::Error otherwise (called from Prepare, which runs inside the
  // engine's exception boundary).
  explicit PackedWeight(const at::Tensor& w);

  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  int64_t panels() const { return (n_ + kPanel - 1) / kPanel; }
  const float* data() const { return data_.data_ptr<float>(); }

 private:
  at::Tensor data_;  // [panels, K, kPanel]
  int64_t n_ = 0, k_ = 0;
};

// out[t, n] = sum_k x[t, k] · w[n, k] + bias[n] (+ residual[t, n]) for t < rows, n < w.n().
// x, residual and out are row-major with leading dimensions ldx, ldr, ldo (in floats); out must
// not overlap x or w (it may be residual). bias and residual may be null. Each output element is
// summed in the same order whatever `rows` is, so a row's result does not depend on the other rows
// in the call (batch invariance). Splits the columns over ATen's intra-op threads. Requires
// PackedLinearSupported().
void PackedLinear(const float* x, int64_t ldx, int64_t rows, const PackedWeight& w,
                  const float* bias, const float* residual, int64_t ldr, float* out, int64_t ldo);

// In place over the rows of x [rows, d] (row-major, leading dimension ldx): x = (x - mean) /
// sqrt(var + eps) * gamma + beta, biased variance, as torch.nn.functional.layer_norm over the
// last dimension. Parallel over rows.
void LayerNormRowsInPlace(float* x, int64_t ldx, int64_t rows, int64_t d, const float* gamma,
                          const float* beta, double eps);

}  // namespace collabserve::model

#endif  // COLLABSERVE_SERVER_MODEL_KERNELS_H_
