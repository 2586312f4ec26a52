// How a collaborative layer's attention is put to ATen's attention (AtenAttention: CUDA, half
// types, the CPU without the sgemm). Every way computes the same context, head i's
//   softmax(q~ diag(m_i) k~^T + 1 b_i^T + mask) v_i,  b_i = the content scores v_i^T y,
// and differs in what scaled_dot_product_attention is handed, so in which of its kernels runs:
//   kBias:   the queries and the shared keys D~ wide, b_i (and the mask) an additive bias
//            [B, H, 1, S]. With a bias PyTorch runs the memory-efficient kernel, not flash
//            attention.
//   kQkColumn: b_i as one more column of the scores' product: queries [q~ m_i, 1, 0...], keys
//            [k~, b_i, 0...] (D~ + 1 rounded up to 8 wide; the keys become per head), no bias.
//            Values d_k wide, so flash attention (equal widths) does not take it.
//   kQkColumnPadded: the same, the values zero-padded to the queries' width (flash attention up
//            to its widest head, 256).
//   kVFold:  softmax(s + b) v = e^s (w v) / e^s w with w_j = e^(b_j - max b): values [w v, w, 0...]
//            (d_k + 1 rounded up to 8 wide), no bias; the context is divided by w's column.
//            Exact in range only: in float16 a key with b_j - max b below about -17 loses its
//            weight (w underflows), whatever its score; and the divisor, sum_j softmax(s)_j w_j,
//            is a float16 output: where the keys the scores favour are not those the content
//            favours, or masked keys (w_j = 0, but in softmax(s)) take most of the weight, it
//            nears float16's smallest normal (6e-5) and the division loses digits (0/0 below
//            6e-8). bfloat16 and float32 keep float32's range.
//   kVFoldPadded: the same, queries, keys and values one width (flash attention).
// bench/engine/attention_variants.py times each under every SDPA backend; engine_bench
// --collab_attention times them in whole passes.
#ifndef COLLABSERVE_SERVER_MODEL_COLLAB_ATTENTION_H_
#define COLLABSERVE_SERVER_MODEL_COLLAB_ATTENTION_H_

#include <optional>
#include <string_view>

namespace collabserve::model {

enum class CollabAttention { kBias, kQkColumn, kQkColumnPadded, kVFold, kVFoldPadded };

inline constexpr CollabAttention kAllCollabAttentions[] = {
    CollabAttention::kBias, CollabAttention::kQkColumn, CollabAttention::kQkColumnPadded,
    CollabAttention::kVFold, CollabAttention::kVFoldPadded};

// "bias", "qk-column", "qk-column-padded", "v-fold", "v-fold-padded".
inline const char* CollabAttentionName(CollabAttention way) {
  switch (way) {
    case CollabAttention::kBias: return "bias";
    case CollabAttention::kQkColumn: return "qk-column";
    case CollabAttention::kQkColumnPadded: return "qk-column-padded";
    case CollabAttention::kVFold: return "v-fold";
    case CollabAttention::kVFoldPadded: return "v-fold-padded";
  }
  return "?";
}

inline std::optional<CollabAttention> ParseCollabAttention(std::string_view name) {
  for (CollabAttention way : kAllCollabAttentions) {
    if (name == CollabAttentionName(way)) return way;
  }
  return std::nullopt;
}

}  // namespace collabserve::model

#endif  // COLLABSERVE_SERVER_MODEL_COLLAB_ATTENTION_H_
