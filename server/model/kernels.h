// CPU float32 kernels for the BERT forward pass: a dense layer on weights packed once at load
// time (AVX-512), and an in-place row LayerNorm. They replace chains of ATen ops (prefill the bias,
// GEMM with beta = 1, layer_norm into a new tensor) by single passes over the output. CPU only: the
// CUDA path keeps using ATen ops.
#ifndef COLLABSERVE_SERVER_MODEL_KERNELS_H_
#define COLLABSERVE_SERVER_MODEL_KERNELS_H_

#include <ATen/ATen.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace collabserve::model {

// True when this CPU can run PackedLinear (AVX-512F). Cheap; cached.
bool PackedLinearSupported();

// Zeroed float32 storage of `floats` elements in an anonymous mapping of its own (whole pages, given
// back to the system when the last tensor sharing it goes): for what a served model keeps for its
// lifetime, which the allocator would round up to a size class whose tail stays resident, and for
// PassArena's pages, which it keeps resident between passes (pass_arena.h). populate: map the
// pages in at once (MAP_POPULATE), for a caller that writes all of them right away.
at::Tensor PagesOfItsOwn(int64_t floats, const at::TensorOptions& options, bool populate);

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
  // (A plain pointer: data_ptr<float>() checks the tensor on every call, and a short pass calls
  // this ~10^4 times.)
  const float* data() const { return ptr_; }

  // Writes w[n_begin:n_end, :] transposed, [K, n_end - n_begin] row-major with leading dimension
  // ldo (0: n_end - n_begin), into out: the plain layout a GEMM library reads, so that a model
  // that keeps only the packed form can still run products on it. Threads may fill disjoint
  // column ranges of one [K, N] buffer at once (out at its column n_begin, ldo = N).
  // n_begin, n_end: as PackedLinearColumns's.
  void UnpackColumns(int64_t n_begin, int64_t n_end, float* out, int64_t ldo = 0) const;
  // The weight as it was given: [N, K], equal to it bit for bit.
  at::Tensor Unpack() const;
  // Bytes held (the packed copy, panels padded to kPanel columns).
  int64_t bytes() const { return panels() * k_ * kPanel * static_cast<int64_t>(sizeof(float)); }

 private:
  at::Tensor data_;  // [panels, K, kPanel]
  const float* ptr_ = nullptr;  // data_'s
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

// How many of w's panels PackedLinear gives one task for `rows` rows (at least ~1 MFLOP each: a
// thread wake-up costs more than a smaller share). For callers that split the panels themselves.
int64_t PanelGrain(const PackedWeight& w, int64_t rows);

// PackedLinear for the output columns [n_begin, n_end) only, on the calling thread: for callers
// that split a layer's work over threads themselves (e.g. the q/k/v columns of some heads, then
// those heads' attention, in one parallel region). n_begin is a multiple of PackedWeight::kPanel;
// n_end is one too, or w.n(). Each element equals PackedLinear's bit for bit.
void PackedLinearColumns(const float* x, int64_t ldx, int64_t rows, const PackedWeight& w,
                         const float* bias, const float* residual, int64_t ldr, float* out,
                         int64_t ldo, int64_t n_begin, int64_t n_end);

// Packed rows: an activation x [rows, K] copied into the layout the micro-kernel reads, so that
// the members of a ThreadTeam can pack it once between them (each the rows, or the k range, it has
// just produced) instead of each packing all of it inside PackedLinearColumns. Tiles of
// kPackedRowTile rows, each k-major: row r, column k is at
//   packed[(r / kPackedRowTile) · K · kPackedRowTile + k · kPackedRowTile + r % kPackedRowTile].
constexpr int64_t kPackedRowTile = 8;

// Floats a packed copy of `rows` rows of K columns needs.
int64_t PackedRowsSize(int64_t rows, int64_t K);

// Copies x[r, k] for r in [r0, r1), k in [k0, k1) into `packed` (laid out for K columns), leaving
// every other entry as it is. x points at row 0, column 0, leading dimension ldx. Several threads
// may pack disjoint row ranges, or disjoint k ranges, of one buffer at once.
void PackRows(const float* x, int64_t ldx, int64_t r0, int64_t r1, int64_t k0, int64_t k1,
              int64_t K, float* packed);

// PackedLinearColumns on rows already packed (PackRows with K = w.k(), all `rows` rows and all K
// columns): the same result, bit for bit, without packing x again.
void PackedLinearColumnsPacked(const float* packed, int64_t rows, const PackedWeight& w,
                               const float* bias, const float* residual, int64_t ldr, float* out,
                               int64_t ldo, int64_t n_begin, int64_t n_end);

// out[r, n] = sum_k x[r, k] · w[n, k] for r < rows, n < N: a product too narrow to pack (a
// collaborative layer's content scores, N = its heads: packing would pad them to a whole panel of
// 32 columns, resident), on the calling thread. w: [N, K] row-major; x, out: leading dimensions
// ldx, ldo. Each element is summed in an order that depends on K only. Requires
// PackedLinearSupported().
void NarrowProduct(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t N, int64_t K,
                   float* out, int64_t ldo);

// Keys packed for the attention kernels: panels of kPanel keys, each [width][kPanel] (key j of
// panel p at packed[(p · width + d) · kPanel + j % kPanel]), padding keys 0. A collaborative layer's
// heads share their keys, so one packing serves all of them.
int64_t PackedKeysSize(int64_t S, int64_t width);
// k: S rows of `width` floats, leading dimension ldk. Requires PackedLinearSupported().
void PackKeys(const float* k, int64_t ldk, int64_t S, int64_t width, float* packed);

// Up to this many positions (and dv a multiple of 16) Attention can keep a head's scores in
// AVX-512 registers; above, it forms them on PackedLinear's micro-kernel. By default it does so up
// to kSmallAttentionDefaultMaxS: one core, 12 heads of one sequence (attention_bench), the
// registers were ahead at 32 positions (150 vs 137 GFLOP/s, d_k 64) and level at 48, the
// micro-kernel ahead at 64 (159 vs 137; width 384: 187 vs 181).
constexpr int64_t kSmallAttentionMaxS = 64;
constexpr int64_t kSmallAttentionDefaultMaxS = 48;

// One attention head's operands: for query row i and key j the score is
//   sum_d (q[i, d] · query_factor[d] · scale) · k[j, d] + key_add[j]
// over d < width (the products summed in d order), and the context row is
// sum_j softmax_j(score) · v[j, :dv]. Standard heads: width = dk, no query_factor,
// scale = 1/sqrt(dk), key_add the padding mask. Collaborative heads (Cordonnier et al.): q and k
// are the shared projections (width = the layer's rank R, the same rows for every head),
// query_factor the head's mixing row m_i, scale 1 (the checkpoint folds 1/sqrt(dk) into m_i),
// key_add the mask plus the head's content scores v_i·y_j. q and v are row-major with leading
// dimensions ldq and ldv (floats); the keys are packed (PackKeys).
struct AttentionHead {
  const float* q = nullptr;
  const float* keys = nullptr;  // PackKeys of the S keys, `width` wide
  const float* v = nullptr;
  int64_t ldq = 0, ldv = 0;
  int64_t width = 0, dv = 0;
  const float* query_factor = nullptr;  // width factors, or null (all 1)
  float scale = 1.0f;
  const float* key_add = nullptr;  // S additive terms, or null
  // The queries already packed (PackRows, K = width, no factors applied), or null. The micro-kernel
  // form reads them instead of packing q: the heads of a collaborative layer share their queries.
  const float* packed_q = nullptr;
};

// Whether Attention keeps the scores in registers for S positions, dv-wide values and small_max_s
// (else it takes the micro-kernel form, which reads AttentionHead::packed_q).
bool AttentionInRegisters(int64_t S, int64_t dv, int64_t small_max_s = kSmallAttentionDefaultMaxS);


// Floats of work space Attention needs for S positions, `queries` query rows, scores `width`
// wide and dv-wide values.
int64_t AttentionWorkSize(int64_t S, int64_t queries, int64_t width, int64_t dv);

// Softmax attention of one head over one sequence of S positions, on the calling thread:
// ctx[i, :dv] for the first `queries` positions (1 <= queries <= S; fewer than S when only the
// first positions' outputs are wanted, e.g. [CLS] in a classifier's last layer), leading dimension
// ldc. Up to small_max_s positions (at most kSmallAttentionMaxS, dv a multiple of 16) in registers:
// the per-call costs of an sgemm and an ATen softmax outweigh the arithmetic there. Above, the
// [queries, S] scores on PackedLinear's micro-kernel (queries packed with their factors applied,
// the key terms added as the scores are written), an AVX-512 softmax, and the context on the
// micro-kernel again (the probabilities and the values packed for it): no sgemm, no ATen op. Each
// row's result depends only on its own query and sequence, bit for bit whatever `queries` is, and
// is the same whatever padding keys (key_add lowest(), or -inf) follow the sequence's own.
// work: AttentionWorkSize(S, queries, width, dv) floats. Requires PackedLinearSupported(),
// width >= 1, dv >= 1.
void Attention(const AttentionHead& head, int64_t S, int64_t queries, float* ctx, int64_t ldc,
               float* work, int64_t small_max_s = kSmallAttentionDefaultMaxS);

// In place on the columns [c0, c1) of the rows of x [rows, *] (leading dimension ldx), on the
// calling thread: x = x · (1 + erf(x / sqrt 2)) / 2, the "gelu" of BERT, with ATen's vectorised
// erf (Abramowitz-Stegun 7.1.26, |error| < 1.5e-7). Requires PackedLinearSupported().
void GeluRowsInPlace(float* x, int64_t ldx, int64_t rows, int64_t c0, int64_t c1);

// In place over the rows of x [rows, d] (row-major, leading dimension ldx): x = (x - mean) /
// sqrt(var + eps) * gamma + beta, biased variance, as torch.nn.functional.layer_norm over the
// last dimension. Parallel over rows.
void LayerNormRowsInPlace(float* x, int64_t ldx, int64_t rows, int64_t d, const float* gamma,
                          const float* beta, double eps);

// A fixed group of threads for forward passes too short to pay a thread wake-up per operation
// (OpenMP with OMP_WAIT_POLICY=PASSIVE puts its workers to sleep after every parallel op, and a
// batch-1 pass has dozens of them): TryRun starts one function on n threads at once, the caller
// being member 0, and its members meet at Step boundaries, where they spin briefly (steps are
// microseconds apart) before yielding. Between runs the other members sleep.
//
// Thread-safety: one run at a time; TryRun returns false at once, running nothing, while another
// thread's run is in progress (the caller then takes its ordinary path). Inside a run every
// member's ATen and oneDNN calls run single-threaded, under the caller's InferenceMode.
class ThreadTeam {
 public:
  // The process-wide team (its threads start on first use, and live until exit).
  static ThreadTeam& Shared();

  // Runs fn(member, n) for member = 0..n-1 on n threads at once and returns when all have
  // returned. Rethrows the first exception a Step raised. n >= 1.
  bool TryRun(int n, const std::function<void(int member, int n)>& fn);

  // Called by every member of a run, in the same order: runs f on this member (unless a member
  // has already failed), then waits until all members have finished theirs.
  void Step(const std::function<void()>& f);

  ~ThreadTeam();

 private:
  ThreadTeam() = default;
  void WorkerLoop(int member);
  void Barrier();

  std::mutex run_mu_;  // held for a whole run
  std::mutex mu_;      // guards workers_ creation and the sleep/wake handshake
  std::condition_variable wake_;
  std::vector<std::thread> workers_;  // member i + 1
  bool stop_ = false;
  // The job: published by generation_ (release), read by the workers after acquiring it.
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<int> job_n_{0};
  bool job_inference_mode_ = false;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> finished_{0};
  // Barrier.
  std::atomic<int> arrived_{0};
  std::atomic<uint64_t> barrier_generation_{0};
  // First failure of the run.
  std::atomic<bool> failed_{false};
  std::mutex error_mu_;
  std::exception_ptr error_;
};

}  // namespace collabserve::model

#endif  // COLLABSERVE_SERVER_MODEL_KERNELS_H_
