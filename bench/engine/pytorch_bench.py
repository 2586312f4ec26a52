#!/usr/bin/python3
"""PyTorch eager baseline for bench/engine (and the ONNX export for the ONNX Runtime baseline).

usage: pytorch_bench.py --model DIR --out FILE.tsv [--batches 1,8,32] [--seqs 16,128,512]
                        [--threads 2] [--budget_s 4] [--min_runs 3] [--max_runs 50]
                        [--warmup_batch 8] [--export_onnx FILE.onnx]
                        [--device cpu|cuda[:N]] [--dtype float32|float16|bfloat16] [--sdpa]
                        [--op_profile PASSES] [--gpu_kernels PASSES]

Loads DIR with bert_module (checked against tests/reference/bert_reference.py first: logits within
1e-4), then for each grid point runs one warm-up forward and timed forwards under
torch.inference_mode until --budget_s is spent (at least --min_runs, at most --max_runs), and writes
"batch<TAB>seq<TAB>median seq/s<TAB>runs<TAB>median CPU ms per sequence" lines. The timing policy
and inputs equal engine_bench's. On CUDA every timed forward ends with torch.cuda.synchronize()
(as engine_bench's copy of the logits to the CPU does), TF32 is off for float32, and --sdpa uses
torch's fused attention.

--op_profile PASSES: instead of the TSV (--out is then not needed), for each grid point PASSES
forwards timed, then PASSES more under torch.autograd.profiler: the top-level operators by host
time, as engine_bench --op_profile prints them, and the time spent waiting in the synchronisation.
--gpu_kernels PASSES (CUDA): the same, but the kernels the device ran in PASSES passes, recorded by
torch.profiler, as engine_bench --gpu_kernels prints them.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bert_module  # noqa: E402


def median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def ints(s):
    return [int(x) for x in s.split(",")]


def print_top(what, more, rows, n, width, other):
    """A profile's table: rows (name, calls, us, *more values) over n passes, most time first; the
    first 15 with calls and us a pass, us a call and the rest of their values, then one line for
    the others."""
    print(f"  {what:{width}s} {'calls':>8s} {'us a pass':>10s} {'us a call':>9s}" + "".join(f" {m:>11s}" for m in more))
    rows = sorted(rows, key=lambda r: -r[2])
    for name, calls, us, *values in rows[:15]:
        print(f"  {name[:width]:{width}s} {calls / n:8.1f} {us / n:10.1f} {us / calls:9.2f}"
              + "".join(f" {v:11.1f}" for v in values))
    if len(rows) > 15:
        rest = rows[15:]
        print(f"  {other:{width}s} {sum(r[1] for r in rest) / n:8.1f} {sum(r[2] for r in rest) / n:10.1f}")
    sys.stdout.flush()


def warm_and_time(model, inputs, passes, sync):
    """The profiles' baseline: one warm-up forward on the full shape, then `passes` timed; seconds."""
    model(*inputs)
    sync()
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        model(*inputs)
        sync()
        times.append(time.perf_counter() - t0)
    return times


def op_profile(model, inputs, passes, sync, label, b, s):
    """engine_bench --op_profile's table for PyTorch: top-level operator calls by host time."""
    plain, observed, waits = warm_and_time(model, inputs, passes, sync), [], []
    with torch.autograd.profiler.profile() as prof:
        for _ in range(passes):
            t0 = time.perf_counter()
            model(*inputs)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            observed.append(t2 - t0)
            waits.append(t2 - t1)
    ops, nested = {}, 0
    for e in prof.function_events:
        if e.cpu_parent is not None:
            nested += 1
            continue
        calls, us, longest = ops.get(e.name, (0, 0.0, 0.0))
        ops[e.name] = (calls + 1, us + e.cpu_time_total, max(longest, e.cpu_time_total))
    n = float(passes)
    total_us = sum(v[1] for v in ops.values())
    print(f"\nop profile: {label}, {b} x {s}, {passes} passes: {1e3 * median(plain):.3f} ms a pass (median; "
          f"{1e3 * median(observed):.3f} ms observed), of which {1e-3 * total_us / n:.3f} ms in "
          f"{sum(v[0] for v in ops.values()) / n:.1f} top-level operator calls ({nested / n:.1f} nested in "
          f"them); waiting in the synchronisation: {1e3 * median(waits):.3f} ms")
    print_top("operator", ["longest us"], [(k, *v) for k, v in ops.items()], n, 40, "(the other operators)")


def gpu_kernels(model, inputs, passes, sync, label, b, s):
    """engine_bench --gpu_kernels's table for PyTorch: the device's kernels and copies by device time."""
    from torch.profiler import ProfilerActivity, profile
    plain = warm_and_time(model, inputs, passes, sync)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(passes):
            model(*inputs)
        sync()
    kernels, spans = {}, []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start, end = e.time_range.start, e.time_range.end  # us
        calls, us = kernels.get(e.name, (0, 0.0))
        kernels[e.name] = (calls + 1, us + (end - start))
        spans.append((start, end))
    busy, open_start, open_end = 0.0, None, None
    for start, end in sorted(spans):
        if open_end is None or start > open_end:
            if open_end is not None:
                busy += open_end - open_start
            open_start, open_end = start, end
        else:
            open_end = max(open_end, end)
    if open_end is not None:
        busy += open_end - open_start
    n = float(passes)
    print(f"\ngpu kernels: {label}, {b} x {s}, {passes} passes: {1e3 * median(plain):.3f} ms a pass (median, "
          f"unrecorded); {sum(v[0] for v in kernels.values()) / n:.1f} kernels and copies a pass, "
          f"{1e-3 * sum(v[1] for v in kernels.values()) / n:.3f} ms of device time (busy {1e-3 * busy / n:.3f} ms)")
    print_top("kernel", [], [(k, *v) for k, v in kernels.items()], n, 64, "(the other kernels)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out")
    ap.add_argument("--batches", type=ints, default=[1, 8, 32])
    ap.add_argument("--seqs", type=ints, default=[16, 128, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget_s", type=float, default=4.0)
    ap.add_argument("--min_runs", type=int, default=3)
    ap.add_argument("--max_runs", type=int, default=50)
    ap.add_argument("--warmup_batch", type=int, default=8)
    ap.add_argument("--export_onnx")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--sdpa", action="store_true")
    ap.add_argument("--op_profile", type=int, default=0)
    ap.add_argument("--gpu_kernels", type=int, default=0)
    a = ap.parse_args()
    if not a.out and not a.op_profile and not a.gpu_kernels:
        ap.error("--out is required (except with --op_profile or --gpu_kernels)")
    if a.gpu_kernels and not a.device.startswith("cuda"):
        ap.error("--gpu_kernels records a GPU's kernels: it needs --device cuda")

    model, ref = bert_module.load(a.model, sdpa=a.sdpa)
    torch.set_num_threads(a.threads)
    with torch.inference_mode():
        ids, types, mask = bert_module.make_inputs(2, 24)
        mask[1, 20:] = 0
        got, want = model(ids, types, mask), ref.forward(ids, types, mask)
        err = (got - want).abs().max().item()
        if err > 1e-4:
            raise SystemExit(f"bert_module disagrees with bert_reference by {err}")

    if a.export_onnx:
        ids, types, mask = bert_module.make_inputs(2, 16)
        axes = {0: "batch", 1: "sequence"}
        torch.onnx.export(model, (ids, types, mask), a.export_onnx, opset_version=14,
                          input_names=["input_ids", "token_type_ids", "attention_mask"],
                          output_names=["logits"],
                          dynamic_axes={"input_ids": axes, "token_type_ids": axes,
                                        "attention_mask": axes, "logits": {0: "batch"}})
        print(f"pytorch_bench: exported {a.export_onnx}", file=sys.stderr)

    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model = model.to(device=device, dtype=dtype)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    print(f"pytorch_bench: torch {torch.__version__}, get_num_threads()={torch.get_num_threads()}, "
          f"{device} {a.dtype}{', sdpa' if a.sdpa else ''}", file=sys.stderr)
    if a.op_profile or a.gpu_kernels:
        label = f"PyTorch eager {a.dtype}{' sdpa' if a.sdpa else ''}"
        with torch.inference_mode():
            for b in a.batches:
                for s in a.seqs:
                    inputs = [t.to(device) for t in bert_module.make_inputs(b, s)]
                    if a.op_profile:
                        op_profile(model, inputs, a.op_profile, sync, label, b, s)
                    if a.gpu_kernels:
                        gpu_kernels(model, inputs, a.gpu_kernels, sync, label, b, s)
        return
    with open(a.out, "w") as out, torch.inference_mode():
        out.write("# batch\tseq\tpytorch_seq_per_s\truns\tcpu_ms_per_seq\n")
        for b in a.batches:
            for s in a.seqs:
                ids, types, mask = (t.to(device) for t in bert_module.make_inputs(b, s))
                w = min(b, a.warmup_batch) if not cuda else b  # a GPU warms up on the full shape
                model(ids[:w], types[:w], mask[:w])  # warm-up
                sync()
                times, cpu = [], []
                while len(times) < a.max_runs and (len(times) < a.min_runs or sum(times) < a.budget_s):
                    t0, c0 = time.perf_counter(), time.process_time()
                    model(ids, types, mask)
                    sync()
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
                n, med, cpu_med = len(times), median(times), median(cpu)
                out.write(f"{b}\t{s}\t{b / med:.4f}\t{n}\t{1e3 * cpu_med / b:.3f}\n")
                out.flush()
                print(f"pytorch_bench: {b} x {s}: {b / med:.2f} seq/s ({n} runs)", file=sys.stderr)


if __name__ == "__main__":
    main()
