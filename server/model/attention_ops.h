// Self-attention on the CPU float32 kernels (kernels.h's Attention, or oneDNN's sgemm without
// AVX-512) for standard and collaborative layers alike, and with ATen ops for every other device
// and dtype. Internal to the engine (server/model): the per-operation path (BertClassifier::Layer,
// bert.cc) and the ThreadTeam path (encoder_team.cc) run the same per-sequence code, AttendHeads.
#ifndef COLLABSERVE_SERVER_MODEL_ATTENTION_OPS_H_
#define COLLABSERVE_SERVER_MODEL_ATTENTION_OPS_H_

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "server/model/bert.h"
#include "server/model/collab_attention.h"
#include "server/model/dense_ops.h"

namespace collabserve::model::internal {

// Where a layer's attention operands sit in a row of its fused projection (EncoderLayer::fused),
// and how its scores are formed (AttentionHead): one description for standard and collaborative
// layers, so that both run on the same kernels.
struct AttentionLayout {
  int64_t ld = 0;     // floats per projection row (at least fused_n + content_n)
  int64_t fused_n = 0;  // columns the fused product writes (then the content scores, if any)
  int64_t content_n = 0;  // content score columns: H (collaborative), or 0
  int64_t width = 0;  // score width: d_k, or the collaborative rank R
  int64_t dk = 0;     // value width
  int64_t q0 = 0, k0 = 0, v0 = 0;  // columns of head 0's query, key and value
  int64_t head_step = 0;           // query/key column step per head: d_k, or 0 (shared)
  int64_t content0 = -1;           // column of head 0's content score, or -1 (standard)
  const float* mixing = nullptr;   // [H, R] (collaborative), 1/sqrt(d_k) folded in
  float scale = 1.0f;
};

// Scratch for AttendHeads with S positions, scores `width` wide and dk-wide values: the key
// terms, the packed keys and the attention kernel's work space (or the sgemm path's [S, S] scores
// and mixed queries). Allocated per parallel region (not kept per thread), so a served model holds
// nothing between calls. AttentionScratchSize: its size in floats.
at::Tensor AttentionScratch(int64_t S, int64_t width, int64_t dk, const at::TensorOptions& options);
int64_t AttentionScratchSize(int64_t S, int64_t width, int64_t dk);

// Floats per row of a collaborative layer's projection [x W~Q | x W~K | values | content scores]
// (2R + D + H), rounded up to whole 64-byte lines: the CPU kernels' stores and loads stay aligned,
// and on CUDA the keys and values read in place meet the fused attention kernels' alignment (a
// row of 1548 half floats at D~ = 384 failed memory-efficient attention's key-stride check).
int64_t CollaborativeProjectionWidth(int64_t R, int64_t D, int64_t H);

// The layout of layer l's attention, H heads of d_k (its mixing pointer only for CPU float32).
AttentionLayout LayoutOf(const EncoderLayer& l, int64_t H, int64_t dk);

// Heads [h0, h1) of sequence b of self-attention for the queries at the first Sq positions (Sq =
// S, or 1 for [CLS] alone): q, k and v read in place from the projection p (rows of L.ld floats;
// only the first Sq rows of a sequence's queries are read), the context written into its slot of
// ctx [B·Sq, D]. With AVX-512 on the attention kernel (kernels.h: Attention), the keys packed once
// for all the heads of a collaborative layer (they share them) and once per head of a standard
// one; else (or under COLLABSERVE_ATTENTION=sgemm) the [Sq, S] scores on the sgemm, the mixing of a
// collaborative head applied to a copy of its queries, and ATen's softmax. Never a [B, H, S, R]
// tensor. scratch: AttentionScratch(S, L.width, L.dk) or larger. Runs on the calling thread
// (inside a parallel region the sgemm and softmax do).
void AttendHeads(SgemmFn sgemm, const float* p, const AttentionLayout& L, const float* mask,
                 int64_t b, int64_t h0, int64_t h1, int64_t S, int64_t Sq, int64_t D,
                 at::Tensor& scratch, float* ctx);

// AttendHeads for the units [u0, u1) of B·H, unit u = (sequence u / H, head u % H): a share of a
// layer's (sequence, head) pairs, each sequence's heads together.
void AttendUnits(SgemmFn sgemm, const float* p, const AttentionLayout& L, const float* mask,
                 int64_t u0, int64_t u1, int64_t H, int64_t S, int64_t Sq, int64_t D,
                 at::Tensor& scratch, float* ctx);

// Whether AttendHeads (FusedAttention, the team path) can run: on the AVX-512 attention kernel, or
// on the sgemm (`sgemm` non-null). A LibTorch that hides oneDNN's sgemm (a PyTorch wheel) still has
// the kernel wherever AVX-512 is.
bool FusedAttentionAvailable(SgemmFn sgemm);

// Self-attention for one layer, fused per (sequence, head) (AttendHeads) and split over threads
// by (sequence, head); proj [B·S, L.ld] -> ctx [B·Sq, D] (the queries at the first Sq positions of
// each sequence). Needs FusedAttentionAvailable(sgemm).
at::Tensor FusedAttention(SgemmFn sgemm, const at::Tensor& proj, const AttentionLayout& L,
                          const at::Tensor& mask_add, int64_t B, int64_t S, int64_t Sq, int64_t H);

// A collaborative layer's content scores for the rows [r0, r1) of x (leading dimension ldx) into
// their columns of proj (rows of L.ld): x · content_bias^T, on the calling thread (NarrowProduct
// with AVX-512, else the sgemm).
void ContentScores(SgemmFn sgemm, const EncoderLayer& l, const AttentionLayout& L, const float* x,
                   int64_t ldx, int64_t r0, int64_t r1, float* proj);

// The input projection of layer l for x [T, D], [T, L.ld]: the fused product and, for a
// collaborative layer, its content scores beside it.
at::Tensor Project(SgemmFn sgemm, const EncoderLayer& l, const AttentionLayout& L, const at::Tensor& x);

// Heads [h0, h1) of a standard layer, on the calling thread: their q, k and v columns of the
// fused projection into proj [B·S, 3D] (whole panels when dk is a multiple of the panel width),
// then their attention for every sequence into ctx [B·Sq, D]. Keys and values are projected for
// every row; queries for every row when Sq = S, or with Sq = 1 (the [CLS] queries alone) for x's
// rows b·S only, a matrix of B rows with leading dimension S·D, into proj's rows b·S. x: [B·S, D];
// x_packed: the same rows already packed (PackRows) for PackedLinearColumnsPacked, or null;
// packed: run on w's packed form (else the sgemm); scratch: AttentionScratch(S, L.width, L.dk).
void ProjectAndAttendHeads(SgemmFn sgemm, const float* x, const float* x_packed,
                           const DenseWeight& w, bool packed, const float* bias,
                           const AttentionLayout& L, const float* mask, int64_t B, int64_t S,
                           int64_t Sq, int64_t D, int64_t h0, int64_t h1, at::Tensor& scratch,
                           float* proj, float* ctx);

// The q/k/v projection and the attention of a standard layer in one parallel region, split by
// head (ProjectAndAttendHeads), so no thread waits for another between the two. For token counts
// where PackedLinear runs (the pass is short and a thread wake-up per operation is a visible
// cost). x [B·S, D] -> ctx [B·Sq, D]; Sq = S, or 1 for the [CLS] queries alone.
at::Tensor ProjectAndAttend(SgemmFn sgemm, const at::Tensor& x, const EncoderLayer& l,
                            const AttentionLayout& L, const at::Tensor& mask_add, int64_t B,
                            int64_t S, int64_t Sq, int64_t H);

// The dtype's lowest finite value (Hugging Face's finfo(dtype).min): the additive mask's.
double LowestValue(c10::ScalarType dtype);

// Whether this LibTorch has at::scaled_dot_product_attention with a scale (2.1 and later), and
// whether AtenAttention uses it for x's device: on CUDA, and on the CPU under
// COLLABSERVE_ATTENTION=sdpa (the tests of that path on machines without a GPU).
bool SdpaAvailable();
bool UseSdpa(const at::Tensor& x);

// Self-attention with ATen ops for layer l (without the sgemm: CUDA, half types,
// COLLABSERVE_GEMM=aten): proj [B·S, *] -> ctx [B·Sq, D], for the queries at the first Sq positions of each sequence.
// Where UseSdpa (CUDA with LibTorch >= 2.1) one at::scaled_dot_product_attention per layer, as
// PyTorch's own BERT does; else the scores, ATen's softmax and the context as three operations.
// way: how a collaborative layer's attention is put to it (collab_attention.h); the same context.
at::Tensor AtenAttention(const EncoderLayer& l, const at::Tensor& proj, const at::Tensor& mask_add,
                         int64_t B, int64_t S, int64_t Sq, int64_t H, int64_t dk,
                         CollabAttention way = CollabAttention::kBias);

}  // namespace collabserve::model::internal

#endif  // COLLABSERVE_SERVER_MODEL_ATTENTION_OPS_H_
