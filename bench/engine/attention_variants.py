#!/usr/bin/python3
"""A collaborative layer's attention on the device, written five ways, against the standard layer's.

usage: attention_variants.py [--device cuda|cpu] [--dtype float16|bfloat16|float32]
                             [--batches 1,8,32,128] [--seqs 128,512] [--ranks 384,192]
                             [--heads 12] [--dk 64] [--reps 10] [--bias_std 2] [--masked]
                             [--check]

The engine's collaborative attention (server/model/attention_ops.cc, AtenAttention) hands
scaled-dot-product attention each head's queries x W~_Q diag(m_i) and the shared keys y W~_K, D~ wide,
and the content term v_i^T y as an additive bias [B, H, 1, S]. With a bias, PyTorch runs the
memory-efficient kernel, not flash attention (which takes none). Two exact rewrites need no bias
(the engine has all five ways: server/model/collab_attention.h, EngineOptions::collab_attention,
the bias by default; engine_bench --collab_attention times them in whole passes):

  qk-column: the bias as one more column of the product: queries [q m_i, 1, 0...], keys
             [k, b_i, 0...] (D~ + 8 wide; the keys become per head). Values stay d_k wide, so
             flash attention (equal widths) does not take it; "-padded": values zero-padded to D~ + 8.
  v-fold:    softmax(s + b) v = (e^s (w * v)) / (e^s w) with w_j = e^(b_j - max b): values
             [w * v, w, 0...] (d_k + 8 wide; "-padded": D~, at least d_k + 8), the context divided
             by the column of w.
             In float16 a key whose b_j - max b < ~-17 loses its weight (the factor underflows);
             the error column shows what that costs at --bias_std.

Each way starts from the projection's rows as the engine has them ([B·S, W]: q~ | k~ | v | content
bias | padding, W = CollaborativeProjectionWidth) and ends with the context [B·S, D], so the copies
a way needs are in its time. For every grid point: the standard layer's attention ([B·S, 3D] -> [B·S,
D]) and, per rank, each way under every SDPA backend that takes it (auto = what the engine's call
gets, then flash, efficient, cudnn forced, and math for the standard and bias ways); "-" where a
backend refuses. Times are device microseconds per call (CUDA events around --reps calls, median
of 5 groups; on the CPU wall time): where the device outruns the host (batch 1), they count the
launches of a way's copies too.
"err" is the largest |context - reference| over the first sequence, the reference being the
collaborative formula evaluated per head in float64 from the same inputs. Headline lines
("attention: ...") compare the engine's way with the fastest one. Without scaled_dot_product_attention
with a scale (torch < 2.1) every way runs as explicit products and a softmax ("math").

--masked: every point once more as a padded batch (the even-numbered sequences' last quarter
masked, the engine's additive mask): the standard layer then takes a bias too, which the
collaborative ways fold in with the content term (qk-column: into the keys' column; v-fold: into w).

--check: after the whole grid, exits non-zero unless every way's error was within 1e-4 (float32) or
5e-2 (half types) of the reference, naming those that were not: what `make test` runs (through
scripts/gpu-check.sh) so that the rewrites stay exact.
"""
import argparse
import math
import statistics
import sys
import time

import torch



def sdpa_with_scale():
    """torch's scaled_dot_product_attention where it takes a scale (2.1 and later), else None."""
    f = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
    try:
        x = torch.zeros(1, 1, 2, 8)
        f(x, x, x, scale=1.0)
        return f
    except (TypeError, RuntimeError):
        return None


SDPA = sdpa_with_scale()
BACKENDS = ["flash", "efficient", "cudnn", "math"]


def ints(s):
    return [int(x) for x in s.split(",")]


def backend_context(name):
    """A context manager that allows SDPA the named backend alone; None where this torch cannot."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        member = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                  "cudnn": "CUDNN_ATTENTION", "math": "MATH"}[name]
        return sdpa_kernel([getattr(SDPBackend, member)]) if hasattr(SDPBackend, member) else None
    except ImportError:
        pass
    try:  # torch 2.0-2.2
        if name == "cudnn":
            return None
        return torch.backends.cuda.sdp_kernel(enable_flash=name == "flash", enable_math=name == "math",
                                              enable_mem_efficient=name == "efficient")
    except AttributeError:
        return None


def auto_choice(q, k, v, mask, scale):
    """The backend SDPA picks for these inputs (torch._fused_sdp_choice), as a name."""
    try:
        choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, False, scale=scale)
    except (AttributeError, RuntimeError, TypeError):
        return "?"
    try:
        from torch.nn.attention import SDPBackend
        return {getattr(SDPBackend, m, None): n for m, n in [
            ("FLASH_ATTENTION", "flash"), ("EFFICIENT_ATTENTION", "efficient"),
            ("CUDNN_ATTENTION", "cudnn"), ("MATH", "math")]}.get(SDPBackend(choice), str(choice))
    except (ImportError, ValueError, TypeError):
        return str(choice)


def attend(q, k, v, mask, scale, record=None):
    """SDPA where this torch has it, else explicit products; record[0] gets the auto choice."""
    if SDPA is None:
        if record is not None:
            record[0] = "math"
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        if mask is not None:
            s = s + mask
        return torch.matmul(torch.softmax(s.float(), -1).to(q.dtype), v)
    if record is not None and record[0] is None:
        record[0] = auto_choice(q, k, v, mask, scale)
    return SDPA(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=scale)


class Shapes:
    def __init__(self, B, S, H, dk, R=0, mask=None):
        self.B, self.S, self.H, self.dk, self.R, self.D = B, S, H, dk, R, H * dk
        self.W = (2 * R + self.D + H + 15) // 16 * 16  # CollaborativeProjectionWidth
        self.mask = mask  # the padding mask's additive form [B, 1, 1, S], or None


def padding_mask(B, S, device, dtype):
    """The engine's MaskAdd for a ragged batch: the even-numbered sequences (the first included)
    have their last quarter padded; (1 - mask) * the dtype's lowest value."""
    keep = torch.ones(B, S)
    keep[0::2, S - S // 4:] = 0
    return ((1 - keep) * torch.finfo(dtype).min).view(B, 1, 1, S).to(device, dtype)


def standard(p, mixing, z, rec):
    qkv = p.view(z.B, z.S, 3, z.H, z.dk).permute(2, 0, 3, 1, 4)
    o = attend(qkv[0], qkv[1], qkv[2], z.mask, 1.0 / math.sqrt(z.dk), rec)
    return o.transpose(1, 2).reshape(z.B * z.S, z.D)


def parts(p, mixing, z):
    """Each head's queries q~ m_i [B, H, S, R], the shared keys [B, 1, S, R], values [B, H, S, dk],
    the content bias [B, H, S] (plus the padding mask, as the engine adds it)."""
    p3 = p.view(z.B, z.S, -1)
    R, D, H = z.R, z.D, z.H
    q = p3[..., :R].unsqueeze(1) * mixing.view(1, H, 1, R)
    k = p3[..., R:2 * R].unsqueeze(1)
    v = p3[..., 2 * R:2 * R + D].view(z.B, z.S, H, z.dk).transpose(1, 2)
    b = p3[..., 2 * R + D:2 * R + D + H].transpose(1, 2)
    if z.mask is not None:
        b = b + z.mask.view(z.B, 1, z.S)
    return q, k, v, b


def context(o, z):
    return o.transpose(1, 2).reshape(z.B * z.S, z.D)


def way_bias(p, mixing, z, rec):
    q, k, v, b = parts(p, mixing, z)
    o = attend(q, k.expand(z.B, z.H, z.S, z.R), v, b.unsqueeze(2).contiguous(), 1.0, rec)
    return context(o, z)


def qk_column(p, mixing, z, rec, padded):
    q, k, v, b = parts(p, mixing, z)
    B, H, S, R = z.B, z.H, z.S, z.R
    q2 = q.new_zeros(B, H, S, R + 8)
    q2[..., :R] = q
    q2[..., R] = 1
    k2 = q.new_zeros(B, H, S, R + 8)
    k2[..., :R] = k
    k2[..., R] = b
    if padded:
        v2 = v.new_zeros(B, H, S, R + 8)
        v2[..., :z.dk] = v
        v = v2
    o = attend(q2, k2, v, None, 1.0, rec)
    return context(o[..., :z.dk], z)


def v_fold(p, mixing, z, rec, padded):
    q, k, v, b = parts(p, mixing, z)
    B, H, S, R, dk = z.B, z.H, z.S, z.R, z.dk
    bf = b.float()
    w = torch.exp(bf - bf.amax(-1, keepdim=True)).to(v.dtype)  # [B, H, S]
    v2 = v.new_zeros(B, H, S, max(R, dk + 8) if padded else dk + 8)
    v2[..., :dk] = v * w.unsqueeze(-1)
    v2[..., dk] = w
    o = attend(q, k.expand(B, H, S, R), v2, None, 1.0, rec)
    return context(o[..., :dk] / o[..., dk:dk + 1], z)


WAYS = [("bias", way_bias),
        ("qk-column", lambda p, m, z, r: qk_column(p, m, z, r, False)),
        ("qk-column-padded", lambda p, m, z, r: qk_column(p, m, z, r, True)),
        ("v-fold", lambda p, m, z, r: v_fold(p, m, z, r, False)),
        ("v-fold-padded", lambda p, m, z, r: v_fold(p, m, z, r, True))]


def reference(p, mixing, z):
    """The first sequence's context in float64, head by head from the formula."""
    R, D, dk = z.R, z.D, z.dk
    x = p.view(z.B, z.S, -1)[0].double().cpu()
    m = mixing.double().cpu() if R else None
    out = torch.empty(z.S, D, dtype=torch.float64)
    pad = z.mask[0].view(1, z.S).double().cpu() if z.mask is not None else 0
    for i in range(z.H):
        if R:
            s = (x[:, :R] * m[i]) @ x[:, R:2 * R].t() + x[:, 2 * R + D + i].unsqueeze(0)
            v = x[:, 2 * R + i * dk:2 * R + (i + 1) * dk]
        else:
            s = x[:, i * dk:(i + 1) * dk] @ x[:, D + i * dk:D + (i + 1) * dk].t() / math.sqrt(dk)
            v = x[:, 2 * D + i * dk:2 * D + (i + 1) * dk]
        out[:, i * dk:(i + 1) * dk] = torch.softmax(s + pad, -1) @ v
    return out


def timed(f, device, reps):
    """Microseconds per call: median over 5 groups of reps calls (after 2 warm-up calls)."""
    f()
    f()
    groups = []
    for _ in range(5):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                f()
            end.record()
            end.synchronize()
            groups.append(1e3 * start.elapsed_time(end) / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            groups.append(1e6 * (time.perf_counter() - t0) / reps)
    return statistics.median(groups)


def measure(name, fn, p, mixing, z, device, reps, ref):
    """Rows (way, backend, us, err) for every backend that takes the way; auto first."""
    rows = []
    rec = [None]
    with torch.inference_mode():
        out = fn(p, mixing, z, rec)
        err = (out[:z.S].double().cpu() - ref).abs().max().item()
        rows.append((name, f"auto ({rec[0]})", timed(lambda: fn(p, mixing, z, None), device, reps), err))
        if SDPA is None:
            return rows
        # Forced math (explicit products, what the engine runs without SDPA) for its two ways alone.
        for backend in BACKENDS if name in ("standard", "bias") else BACKENDS[:-1]:
            ctx = backend_context(backend)
            if ctx is None:
                rows.append((name, backend, None, None))
                continue
            try:
                with ctx:
                    out = fn(p, mixing, z, None)
                    err = (out[:z.S].double().cpu() - ref).abs().max().item()
                    us = timed(lambda: fn(p, mixing, z, None), device, reps)
                rows.append((name, backend, us, err))
            except RuntimeError:
                rows.append((name, backend, None, None))
    return rows


def check(tol, rows, where, failures):
    """Adds to failures a line for every way at `where` whose error exceeds tol."""
    failures += [f"{name} ({backend}) at {where} is {err:.2e} from the reference (bound {tol:g})"
                 for name, backend, us, err in rows if us is not None and not err <= tol]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--batches", type=ints, default=[1, 8, 32, 128])
    ap.add_argument("--seqs", type=ints, default=[128, 512])
    ap.add_argument("--ranks", type=ints, default=[384, 192])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--dk", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--bias_std", type=float, default=2.0)
    ap.add_argument("--masked", action="store_true")
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype or ("float16" if device.type == "cuda" else "float32"))
    if any(r <= 0 or r % 8 for r in a.ranks):
        sys.exit("attention_variants: --ranks must be positive multiples of 8 (the kernels' alignment)")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    print(f"torch {torch.__version__}, {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, {str(dtype).replace('torch.', '')}, "
          f"{a.heads} heads of {a.dk}, content bias std {a.bias_std}, {a.reps} calls a group"
          f"{'' if SDPA else '; no scaled_dot_product_attention: explicit products'}")
    gen = torch.Generator().manual_seed(1)
    worst, failures = 0.0, []
    for B in a.batches:
        for S in a.seqs:
            for masked in [False, True] if a.masked else [False]:
                mask = padding_mask(B, S, device, dtype) if masked else None
                where = f"{B} x {S}{', padded' if masked else ''}"
                z = Shapes(B, S, a.heads, a.dk, 0, mask)
                # Projections of unit scale (the mixing has 1/sqrt(d_k) folded in, as the engine's).
                p = torch.randn(B * S, 3 * z.D, generator=gen).to(device, dtype)
                rows = measure("standard", standard, p, None, z, device, a.reps, reference(p, None, z))
                std_us = rows[0][2]
                print(f"\n{where}: standard {std_us:.1f} us (auto: {rows[0][1][6:-1]}), err {rows[0][3]:.1e}"
                      + "".join(f"; {b} {us:.1f} us" if us is not None else f"; {b} -" for _, b, us, _ in rows[1:]))
                check(tol, rows, f"{where}, standard", failures)
                worst = max([worst] + [r[3] for r in rows if r[2] is not None])
                for R in a.ranks:
                    z = Shapes(B, S, a.heads, a.dk, R, mask)
                    p = torch.randn(B * S, z.W, generator=gen)
                    p[:, 2 * R + z.D:2 * R + z.D + a.heads] *= a.bias_std
                    mixing = torch.randn(a.heads, R, generator=gen) / math.sqrt(R)
                    p, mixing = p.to(device, dtype), mixing.to(device, dtype)
                    ref = reference(p, mixing, z)
                    rows = []
                    for name, fn in WAYS:
                        rows += measure(name, fn, p, mixing, z, device, a.reps, ref)
                    print(f"  D~ = {R}: {'way':17s} {'backend':18s} {'us':>9s} {'std / way':>9s} {'err':>8s}")
                    for name, backend, us, err in rows:
                        if us is None:
                            print(f"  {'':8s} {name:17s} {backend:18s} {'-':>9s}")
                            continue
                        print(f"  {'':8s} {name:17s} {backend:18s} {us:9.1f} {std_us / us:9.2f} {err:8.1e}")
                        worst = max(worst, err)
                    timed_rows = [r for r in rows if r[2] is not None]
                    engine = timed_rows[0]
                    best = min(timed_rows, key=lambda r: r[2])
                    print(f"attention: {where}, D~ = {R}: the engine's way (bias, {engine[1]}) {engine[2]:.1f} us, "
                          f"the fastest ({best[0]}, {best[1]}) {best[2]:.1f} us ({engine[2] / best[2]:.2f}x), "
                          f"standard {std_us:.1f} us; errors {engine[3]:.1e} / {best[3]:.1e}")
                    check(tol, rows, f"{where}, D~ = {R}", failures)
                sys.stdout.flush()
    for line in failures:
        print(f"attention_variants: {line}", file=sys.stderr)
    if not failures:
        print(f"\nevery way within {tol:g} of the reference (largest error {worst:.1e})")
    elif a.check:
        sys.exit(1)


if __name__ == "__main__":
    main()
