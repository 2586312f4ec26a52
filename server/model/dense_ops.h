// The encoder's dense products and LayerNorm on the CPU float32 kernels (PackedLinear, oneDNN's
// sgemm) or ATen, whichever this build, the device and COLLABSERVE_GEMM choose. Internal to the
// engine (server/model): bert.cc, attention_ops.cc and encoder_team.cc share it.
#ifndef COLLABSERVE_SERVER_MODEL_DENSE_OPS_H_
#define COLLABSERVE_SERVER_MODEL_DENSE_OPS_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>

#include "server/model/bert.h"
#include "server/util/process_env.h"

namespace collabserve::model::internal {

// oneDNN's row-major SGEMM (dnnl_sgemm), or null when the engine runs on ATen alone.
using SgemmFn = util::DnnlSgemmFn;

// Up to this many rows a product with a packed weight runs on PackedLinear; above, on the sgemm.
inline constexpr int64_t kPackedMaxRows = 256;
// A thread's product of up to this many rows still runs on PackedLinear when the model keeps the
// weight only packed (one core, gemm_bench: at 512 rows PackedLinear was 0.96-1.14x the sgemm on
// the weight unpacked first, weighted by a layer's FLOPs ~1.04x; at 1024-2048 rows 0.88-1.03x,
// below on the FFN products), saving the unpacking of every weight on every pass: a one-thread
// pass of up to this many tokens, or a ThreadTeam member's share of the rows (above
// kPackedMaxRows rows a team splits each product by rows between its members).
inline constexpr int64_t kPackedMaxMemberRows = 512;

// The sgemm, looked up once; null with COLLABSERVE_GEMM=aten or when LibTorch hides its oneDNN.
SgemmFn FindSgemm();

// COLLABSERVE_GEMM=aten: every CPU operation on ATen ops, attention included (the tests of the
// path CUDA takes).
bool AtenOnly();

// Whether Prepare packs the dense weights for PackedLinear on this device and dtype.
bool UsePacking(const c10::Device& device, c10::ScalarType dtype);

// Whether a product of `rows` rows with w runs on PackedLinear (w has its packed form).
bool UsePackedLinear(const DenseWeight& w, int64_t rows);

// x[T, K] · w[N, K]^T + b (+ residual[T, N]): PackedLinear when it applies, else one pre-filled
// output and one accumulating GEMM (the sgemm, or ATen's addmm).
at::Tensor Dense(const at::Tensor& x, const DenseWeight& w, const at::Tensor& b,
                 const at::Tensor& residual = at::Tensor());

// out[:, n0:n1] = x · w[n0:n1, :]^T + bias[n0:n1] (+ residual[:, n0:n1]) on the calling thread:
// PackedLinearColumns when `packed`, else the accumulating sgemm, on w's plain form, else on
// `unpacked` when given (w^T as PackedWeight::UnpackColumns writes it: [K, N] row-major, all N
// columns), else on blocks of columns it unpacks itself. n0, n1 multiples of PackedWeight::kPanel
// (or n1 = N).
void DenseColumns(SgemmFn sgemm, const float* x, int64_t ldx, int64_t rows, const DenseWeight& w,
                  bool packed, const float* bias, const float* residual, int64_t ldr, float* out,
                  int64_t ldo, int64_t n0, int64_t n1, const float* unpacked = nullptr);

// LayerNorm over the last dimension of x [T, D], in place on the CPU (x is a temporary).
at::Tensor LayerNormInPlace(at::Tensor x, const at::Tensor& w, const at::Tensor& b, double eps);

}  // namespace collabserve::model::internal

#endif  // COLLABSERVE_SERVER_MODEL_DENSE_OPS_H_
