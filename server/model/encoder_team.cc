// The ThreadTeam path of the encoder: every layer of a CPU float32 pass in one team run
// (BertClassifier::EncodeOnTeam). bert.cc says when it runs; attention_ops.h and dense_ops.h hold
// the kernels it shares with the per-operation path.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "server/model/attention_ops.h"
#include "server/model/bert.h"
#include "server/model/dense_ops.h"
#include "server/model/kernels.h"
#include "server/model/pass_arena.h"
#include "server/model/threads.h"
#include "server/util/process_env.h"

namespace collabserve::model {

using internal::AttendHeads;
using internal::AttendUnits;
using internal::AttentionLayout;
using internal::AttentionScratchSize;
using internal::ContentScores;
using internal::DenseColumns;
using internal::FindSgemm;
using internal::FusedAttentionAvailable;
using internal::kPackedMaxMemberRows;
using internal::kPackedMaxRows;
using internal::LayoutOf;
using internal::ProjectAndAttendHeads;
using internal::SgemmFn;
using internal::UsePackedLinear;

namespace {

// Up to this many tokens per pass the encoder runs in one ThreadTeam run (EncodeOnTeam); above,
// the per-operation path. No limit unless COLLABSERVE_TEAM_MAX_ROWS=N sets one (A/B measurements:
// 256 gives the engine before the team served long passes).
int64_t TeamMaxRows() {
  static const int64_t rows = util::EnvInt64("COLLABSERVE_TEAM_MAX_ROWS", int64_t{1} << 40);
  return rows;
}

}  // namespace

// The whole encoder in one ThreadTeam run, standard and collaborative layers alike, with the sgemm
// (or, where LibTorch hides it, on PackedLinear and the attention kernel alone). Short passes: each
// parallel ATen/OpenMP op would wake the other threads and let them go back to sleep (dozens of
// times per pass at batch 1). Long passes (above kPackedMaxRows tokens): oneDNN's own 2-thread
// split of one product left a core idle (CPU 147-166% of 2 cores); here every member runs its own
// share of the rows, on PackedLinear up to kPackedMaxMemberRows rows each, else on a
// single-threaded sgemm.
// Member t of n takes, per layer, up to kPackedMaxRows tokens: the q/k/v columns and attention of
// heads [t·H/n, (t+1)·H/n) (no wait between the two, as in ProjectAndAttend); 1/n of the output
// projection's panels (+ residual); 1/n of the rows of the LayerNorm; 1/n of the intermediate
// panels and their activation; 1/n of the output panels (+ residual); 1/n of the rows of the
// LayerNorm; with a barrier after each. Above: the same with 1/n of the rows of every product
// (all columns), and a barrier between the q/k/v product and the attention, which is split by
// (sequence, head). A collaborative layer's heads share its query/key projections, so it always
// has the barrier: first 1/n of the fused projection (panels, or rows above kPackedMaxRows), then
// its heads' attention (by head when prepacked, else by (sequence, head)); the rest of the layer
// as a standard one's. Every element is computed by the kernels of the per-operation path
// (PackedLinear bit for bit; the sgemm's blocking may differ with the shape it is given), except
// that a long pass's member shares may run on PackedLinear where that path takes the sgemm.
// cls_only: the last layer as in Layer(..., cls_only): keys and values for every row, the rest
// for the B [CLS] rows (x's rows b·S: leading dimension S·D), and h becomes [B, 1, D].
bool BertClassifier::EncodeOnTeam(at::Tensor& h, const at::Tensor& mask_add, bool cls_only) const {
  const int n = at::get_num_threads();
  const int64_t B = h.size(0), S = h.size(1), D = config_.hidden_size, T = B * S;
  const int64_t H = config_.num_attention_heads, dk = config_.head_size();
  const int64_t F = config_.intermediate_size;
  SgemmFn sgemm = FindSgemm();
  // Without the sgemm (a LibTorch that hides it) every product runs on PackedLinear: the weights
  // must be kept packed, and attention on the AVX-512 kernel.
  const bool products = sgemm != nullptr || weights_released_;
  if (n <= 1 || at::in_parallel_region() || !products || !FusedAttentionAvailable(sgemm) || !h.is_cpu() ||
      h.scalar_type() != at::kFloat || T > TeamMaxRows() || dk % PackedWeight::kPanel != 0) {
    return false;
  }
  // Each layer's layout; the widest projection row and score width size the shared buffers.
  std::vector<AttentionLayout> layouts;
  int64_t proj_ld = 0, width = 0;
  for (const EncoderLayer& l : layers_) {
    layouts.push_back(LayoutOf(l, H, dk));
    proj_ld = std::max(proj_ld, layouts.back().ld);
    width = std::max(width, layouts.back().width);
  }
  at::Tensor mask2;
  if (mask_add.defined()) mask2 = mask_add.view({B, S}).contiguous();
  const float* mask = mask2.defined() ? mask2.data_ptr<float>() : nullptr;
  at::Tensor cur = h.contiguous().view({T, D});
  const float eps = static_cast<float>(config_.layer_norm_eps);
  // [begin, end) of `count` units for member t of n, in whole multiples of `unit`.
  auto share = [](int64_t count, int64_t unit, int t, int n) {
    const int64_t units = (count + unit - 1) / unit;
    const int64_t b = units * t / n, e = units * (t + 1) / n;
    return std::make_pair(std::min(count, b * unit), std::min(count, e * unit));
  };
  // Per layer: the query positions per sequence (Sq), the rows after the attention (Tq = B·Sq) and
  // the leading dimension of those rows in the layer's input x (the residual).
  const size_t L = layers_.size();
  auto queries = [&](size_t li) { return cls_only && li + 1 == L ? int64_t{1} : S; };
  // Above kPackedMaxRows tokens each member runs its share of the rows of every product (and all
  // columns): each reads the whole weight but only its rows of x, and the rows of x (up to
  // 16384 × 3072 floats here) outgrow the weight. Splitting the columns instead (each member
  // reading all of x) was slower there (8 × 512: 2.07 vs 2.27 seq/s, 32 × 512: 2.17 vs 2.72).
  const bool split_rows = T > kPackedMaxRows;
  // When every product runs on PackedLinear, each activation a product reads is packed once, by
  // the members together, in the step that produces it (each its rows after a LayerNorm, or its
  // columns = k range after the q/k/v + attention and the intermediate product), instead of by
  // every member inside each of its products (three times per layer for the q/k/v parts).
  bool prepacked = !split_rows;
  for (const EncoderLayer& l : layers_) {
    for (const DenseWeight* w : {&l.fused, &l.attn_out, &l.inter, &l.out}) {
      prepacked = prepacked && UsePackedLinear(*w, T);
    }
  }
  // Above kPackedMaxRows tokens a weight kept only packed is unpacked once per product into one
  // [K, N] buffer (w^T), which the members fill together, each its share of the panels, in a step
  // of its own; then each member's sgemm reads all of it for its rows. (Each member unpacking by
  // itself every block of columns it multiplied by read each weight from memory once per member:
  // 8 × 128, 2 threads, ~9% of the CPU time went to unpacking.) Only where some member's share
  // exceeds kPackedMaxMemberRows rows (below, every product runs on PackedLinear; an unused buffer
  // would still take its share of the allocator's resident pages).
  int64_t unpack_floats = 0;
  if (split_rows && (T + n - 1) / n > kPackedMaxMemberRows) {
    for (const EncoderLayer& l : layers_) {
      for (const DenseWeight* w : {&l.fused, &l.attn_out, &l.inter, &l.out}) {
        if (!w->plain.defined() && w->packed != nullptr) {
          unpack_floats = std::max(unpack_floats, w->packed->n() * w->packed->k());
        }
      }
    }
  }
  // The pass's output after an odd number of layers (its input's buffer after an even number).
  at::Tensor next = at::empty({T, D}, cur.options());
  // Its working buffers: in the shared PassArena when it is free (a stream of passes then maps no
  // new pages), else from the allocator. Each starts on a cache line. (The input and output
  // stay with the allocator: on the arena they would be copied in and out, for no gain measured
  // at 8 x 128 and 32 x 128.)
  at::Tensor proj, ctx, mid, inter;
  at::Tensor xpack, cpack, ipack;  // packed rows of the layer input / mid, of ctx, of inter
  at::Tensor unpack_buf;
  std::vector<at::Tensor> member_scores(static_cast<size_t>(n));  // each member's attention scratch
  std::vector<std::pair<at::Tensor*, std::vector<int64_t>>> buffers = {
      {&proj, {T, proj_ld}}, {&ctx, {T, D}}, {&mid, {T, D}}, {&inter, {T, F}}};
  if (prepacked) {
    buffers.push_back({&xpack, {PackedRowsSize(T, D)}});
    buffers.push_back({&cpack, {PackedRowsSize(T, D)}});
    buffers.push_back({&ipack, {PackedRowsSize(T, F)}});
  }
  if (unpack_floats > 0) buffers.push_back({&unpack_buf, {unpack_floats}});
  for (at::Tensor& scores : member_scores) buffers.push_back({&scores, {AttentionScratchSize(S, width, dk)}});
  auto floats = [](const std::vector<int64_t>& sizes) {
    int64_t f = 1;
    for (int64_t d : sizes) f *= d;
    return (f + 15) / 16 * 16;
  };
  int64_t total = 0;
  for (const auto& b : buffers) total += floats(b.second);
  const PassArena::Lease lease = PassArena::Shared().TryLease(total);
  int64_t offset = 0;
  for (const auto& [tensor, sizes] : buffers) {
    *tensor = lease ? at::from_blob(lease.data() + offset, sizes, cur.options()) : at::empty(sizes, cur.options());
    offset += floats(sizes);
  }
  const bool ran = ThreadTeam::Shared().TryRun(n, [&](int t, int n) {
    ThreadTeam& team = ThreadTeam::Shared();
    at::Tensor& scores = member_scores[static_cast<size_t>(t)];
    at::Tensor x = cur, y = next;  // this layer's input and output (swapped after each layer)
    if (prepacked) {
      const std::pair<int64_t, int64_t> rows = share(T, kPackedRowTile, t, n);
      team.Step([&] {
        PackRows(cur.data_ptr<float>(), D, rows.first, rows.second, 0, D, D, xpack.data_ptr<float>());
      });
    }
    for (size_t li = 0; li < L; ++li) {
      const EncoderLayer& l = layers_[li];
      const AttentionLayout& La = layouts[li];
      const float* xp = x.data_ptr<float>();
      const int64_t Sq = queries(li), Tq = B * Sq, ldq = Sq == S ? D : S * D;
      if (prepacked) {
        // (Plain variables, not structured bindings: C++17 lambdas cannot capture those.)
        int64_t h0, h1, r0, r1, d0, d1, f0, f1;
        std::tie(h0, h1) = share(H, 1, t, n);
        std::tie(r0, r1) = share(Tq, kPackedRowTile, t, n);
        std::tie(d0, d1) = share(D, PackedWeight::kPanel, t, n);
        std::tie(f0, f1) = share(F, PackedWeight::kPanel, t, n);
        float* xk = xpack.data_ptr<float>();
        float* ck = cpack.data_ptr<float>();
        float* ik = ipack.data_ptr<float>();
        if (l.collaborative) {
          // The shared query/key projections serve every head: all of the fused projection
          // first (each member its panels), then each member its heads' attention. With the
          // [CLS] queries alone (Sq = 1), the query columns (their whole panels) for the B [CLS]
          // rows only, each member its share of those and of the other columns.
          const int64_t qb = Sq == S ? 0 : La.width / PackedWeight::kPanel * PackedWeight::kPanel;
          int64_t c0, c1, q0, q1, r0c, r1c;
          std::tie(q0, q1) = share(qb, PackedWeight::kPanel, t, n);
          std::tie(c0, c1) = share(La.fused_n - qb, PackedWeight::kPanel, t, n);
          std::tie(r0c, r1c) = share(T, 1, t, n);
          team.Step([&] {
            const float* bias = l.fused_b.data_ptr<float>();
            float* pr = proj.data_ptr<float>();
            if (q1 > q0) DenseColumns(sgemm, xp, ldq, B, l.fused, true, bias, nullptr, 0, pr, S * La.ld, q0, q1);
            PackedLinearColumnsPacked(xk, T, *l.fused.packed, bias, nullptr, 0, pr, La.ld, qb + c0, qb + c1);
            ContentScores(sgemm, l, La, xp, D, r0c, r1c, pr);
          });
          team.Step([&] {
            for (int64_t b = 0; b < B; ++b) {
              AttendHeads(sgemm, proj.data_ptr<float>(), La, mask, b, h0, h1, S, Sq, D, scores,
                          ctx.data_ptr<float>());
            }
            PackRows(ctx.data_ptr<float>(), D, 0, Tq, h0 * dk, h1 * dk, D, ck);
          });
        } else {
          team.Step([&] {
            ProjectAndAttendHeads(sgemm, xp, xk, l.fused, /*packed=*/true, l.fused_b.data_ptr<float>(),
                                  La, mask, B, S, Sq, D, h0, h1, scores, proj.data_ptr<float>(),
                                  ctx.data_ptr<float>());
            PackRows(ctx.data_ptr<float>(), D, 0, Tq, h0 * dk, h1 * dk, D, ck);
          });
        }
        team.Step([&] {
          PackedLinearColumnsPacked(ck, Tq, *l.attn_out.packed, l.attn_out_b.data_ptr<float>(), xp, ldq,
                                    mid.data_ptr<float>(), D, d0, d1);
        });
        team.Step([&] {
          LayerNormRowsInPlace(mid.data_ptr<float>() + r0 * D, D, r1 - r0, D,
                               l.attn_ln_w.data_ptr<float>(), l.attn_ln_b.data_ptr<float>(), eps);
          PackRows(mid.data_ptr<float>(), D, r0, r1, 0, D, D, xk);
        });
        team.Step([&] {
          PackedLinearColumnsPacked(xk, Tq, *l.inter.packed, l.inter_b.data_ptr<float>(), nullptr, 0,
                                    inter.data_ptr<float>(), F, f0, f1);
          if (f1 > f0) Activation(inter.narrow(0, 0, Tq).narrow(1, f0, f1 - f0));
          PackRows(inter.data_ptr<float>(), F, 0, Tq, f0, f1, F, ik);
        });
        team.Step([&] {
          PackedLinearColumnsPacked(ik, Tq, *l.out.packed, l.out_b.data_ptr<float>(),
                                    mid.data_ptr<float>(), D, y.data_ptr<float>(), D, d0, d1);
        });
        const bool last = li + 1 == L;
        team.Step([&] {
          LayerNormRowsInPlace(y.data_ptr<float>() + r0 * D, D, r1 - r0, D,
                               l.out_ln_w.data_ptr<float>(), l.out_ln_b.data_ptr<float>(), eps);
          if (!last) PackRows(y.data_ptr<float>(), D, r0, r1, 0, D, D, xk);
        });
        std::swap(x, y);
        continue;
      }
      // Whether a product of `rows` rows runs on PackedLinear: where the per-operation path would,
      // and, above kPackedMaxRows rows (split by rows between the members), where each member's
      // share is at most kPackedMaxMemberRows and the weight is kept only packed. Else the sgemm.
      auto pick = [&](const DenseWeight& w, int64_t rows) {
        return UsePackedLinear(w, rows) ||
               (rows > kPackedMaxRows && w.packed != nullptr && !w.plain.defined() &&
                (rows + n - 1) / n <= kPackedMaxMemberRows);
      };
      // w^T in unpack_buf for a product on the sgemm, unpacked by the members together in a step
      // of its own; null where the product reads w as it is (packed on PackedLinear, or plain).
      // A collective step: every member calls it with the same weight, in the same order.
      auto unpack = [&](const DenseWeight& w, bool p) -> const float* {
        if (p || !unpack_buf.defined() || w.plain.defined() || w.packed == nullptr) return nullptr;
        const PackedWeight& pw = *w.packed;
        int64_t n0, n1;
        std::tie(n0, n1) = share(pw.n(), PackedWeight::kPanel, t, n);
        float* buf = unpack_buf.data_ptr<float>();
        team.Step([&] {
          if (n1 > n0) pw.UnpackColumns(n0, n1, buf + n0, pw.n());
        });
        return buf;
      };
      // A product's output [rows, N] for member t: on the sgemm with many rows, its share of the
      // rows (each member packs the whole weight, but only its rows of x); otherwise its share of
      // the columns (whole panels). res: the residual, leading dimension ldr.
      // out: leading dimension ldo (0: N). wt: unpack(w, p).
      auto product = [&](const float* in, int64_t ldx, int64_t rows, const DenseWeight& w, bool p,
                         const float* wt, const at::Tensor& bias, const float* res, int64_t ldr,
                         float* out, int64_t N, int64_t ldo = 0) {
        if (ldo == 0) ldo = N;
        if (rows > kPackedMaxRows) {
          const auto [r0, r1] = share(rows, 1, t, n);
          if (r1 > r0) {
            DenseColumns(sgemm, in + r0 * ldx, ldx, r1 - r0, w, p, bias.data_ptr<float>(),
                         res == nullptr ? nullptr : res + r0 * ldr, ldr, out + r0 * ldo, ldo, 0, N, wt);
          }
          return std::make_pair(r0, r1);
        }
        const auto [n0, n1] = share(N, PackedWeight::kPanel, t, n);
        DenseColumns(sgemm, in, ldx, rows, w, p, bias.data_ptr<float>(), res, ldr, out, ldo, n0, n1, wt);
        return std::make_pair(int64_t{-1}, int64_t{-1});
      };
      const bool fused_packed = pick(l.fused, T);
      if (l.collaborative) {
        // Every row's shared key projection, values and content scores, and the shared query
        // projection of the rows whose queries are wanted (each member its share), then attention
        // by (sequence, head).
        const float* wt = unpack(l.fused, fused_packed);
        team.Step([&] {
          float* pr = proj.data_ptr<float>();
          if (!split_rows || Sq == S) {
            product(xp, D, T, l.fused, fused_packed, wt, l.fused_b, nullptr, 0, pr, La.fused_n, La.ld);
          } else {
            // [CLS] queries alone: the query columns (their whole panels) for the B [CLS] rows
            // only, as the prepacked path does; the sgemm, each member its share of the rows.
            const int64_t qb = La.width / PackedWeight::kPanel * PackedWeight::kPanel;
            const float* bias = l.fused_b.data_ptr<float>();
            const auto [r0, r1] = share(T, 1, t, n);
            if (r1 > r0) {
              DenseColumns(sgemm, xp + r0 * D, D, r1 - r0, l.fused, fused_packed, bias, nullptr, 0,
                           pr + r0 * La.ld, La.ld, qb, La.fused_n, wt);
            }
            const auto [c0, c1] = share(B, 1, t, n);
            if (c1 > c0) {
              DenseColumns(sgemm, xp + c0 * ldq, ldq, c1 - c0, l.fused, fused_packed, bias, nullptr, 0,
                           pr + c0 * S * La.ld, S * La.ld, 0, qb, wt);
            }
          }
          const auto [r0, r1] = share(T, 1, t, n);
          ContentScores(sgemm, l, La, xp, D, r0, r1, pr);
        });
        team.Step([&] {
          const auto [u0, u1] = share(B * H, 1, t, n);
          AttendUnits(sgemm, proj.data_ptr<float>(), La, mask, u0, u1, H, S, Sq, D, scores,
                      ctx.data_ptr<float>());
        });
      } else if (split_rows) {
        const float* wt = unpack(l.fused, fused_packed);
        team.Step([&] {
          if (Sq == S) {
            product(xp, D, T, l.fused, fused_packed, wt, l.fused_b, nullptr, 0, proj.data_ptr<float>(), 3 * D);
            return;
          }
          // Keys and values of every row, queries of the [CLS] rows: each member its share of
          // both (rows of the sgemm).
          float* pr = proj.data_ptr<float>();
          const float* bias = l.fused_b.data_ptr<float>();
          const auto [r0, r1] = share(T, 1, t, n);
          if (r1 > r0) {
            DenseColumns(sgemm, xp + r0 * D, D, r1 - r0, l.fused, fused_packed, bias, nullptr, 0,
                         pr + r0 * 3 * D, 3 * D, D, 3 * D, wt);
          }
          const auto [c0, c1] = share(B, 1, t, n);
          if (c1 > c0) {
            DenseColumns(sgemm, xp + c0 * ldq, ldq, c1 - c0, l.fused, fused_packed, bias, nullptr, 0,
                         pr + c0 * S * 3 * D, S * 3 * D, 0, D, wt);
          }
        });
        team.Step([&] {
          const auto [u0, u1] = share(B * H, 1, t, n);
          AttendUnits(sgemm, proj.data_ptr<float>(), La, mask, u0, u1, H, S, Sq, D, scores,
                      ctx.data_ptr<float>());
        });
      } else {
        team.Step([&] {
          const auto [h0, h1] = share(H, 1, t, n);
          ProjectAndAttendHeads(sgemm, xp, nullptr, l.fused, fused_packed, l.fused_b.data_ptr<float>(),
                                La, mask, B, S, Sq, D, h0, h1, scores, proj.data_ptr<float>(),
                                ctx.data_ptr<float>());
        });
      }
      const bool attn_out_packed = pick(l.attn_out, Tq), inter_packed = pick(l.inter, Tq),
                 out_packed = pick(l.out, Tq);
      const float* attn_out_t = unpack(l.attn_out, attn_out_packed);
      team.Step([&] {
        product(ctx.data_ptr<float>(), D, Tq, l.attn_out, attn_out_packed, attn_out_t, l.attn_out_b,
                xp, ldq, mid.data_ptr<float>(), D);
      });
      team.Step([&] {
        const auto [r0, r1] = share(Tq, 1, t, n);
        LayerNormRowsInPlace(mid.data_ptr<float>() + r0 * D, D, r1 - r0, D,
                            l.attn_ln_w.data_ptr<float>(), l.attn_ln_b.data_ptr<float>(), eps);
      });
      const float* inter_t = unpack(l.inter, inter_packed);
      team.Step([&] {
        const auto [r0, r1] = product(mid.data_ptr<float>(), D, Tq, l.inter, inter_packed, inter_t,
                                      l.inter_b, nullptr, 0, inter.data_ptr<float>(), F);
        if (r0 >= 0) {
          if (r1 > r0) Activation(inter.narrow(0, r0, r1 - r0));
        } else {
          const auto [n0, n1] = share(F, PackedWeight::kPanel, t, n);
          if (n1 > n0) Activation(inter.narrow(0, 0, Tq).narrow(1, n0, n1 - n0));
        }
      });
      const float* out_t = unpack(l.out, out_packed);
      team.Step([&] {
        product(inter.data_ptr<float>(), F, Tq, l.out, out_packed, out_t, l.out_b,
                mid.data_ptr<float>(), D, y.data_ptr<float>(), D);
      });
      team.Step([&] {
        const auto [r0, r1] = share(Tq, 1, t, n);
        LayerNormRowsInPlace(y.data_ptr<float>() + r0 * D, D, r1 - r0, D,
                            l.out_ln_w.data_ptr<float>(), l.out_ln_b.data_ptr<float>(), eps);
      });
      std::swap(x, y);
    }
  });
  if (!ran) return false;
  // After an even number of layers the result is back in `cur`'s buffer, else in `next`'s; with
  // cls_only, in its first B rows.
  const at::Tensor& out = L % 2 == 0 ? cur : next;
  h = cls_only && L > 0 ? out.narrow(0, 0, B).view({B, 1, D}) : out.view({B, S, D});
  return true;
}

}  // namespace collabserve::model
