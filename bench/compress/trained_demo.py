#!/usr/bin/env python3
"""Compression of a trained model: the demo (server/model/demo/, 4 layers x 8 heads, D_k = 256) at
D~ = D_k/2, /4, /8, /16 with `collabserve-model compress`, each compressed model evaluated on the
committed test split (tests/data/demo/test.jsonl, which neither training nor calibration saw) with
`collabserve-model evaluate --reference` the original, once with plain CP (weight-space error; the
probes are the calibration texts) and once activation-aware (`--calibration`: fitted on 80% of the
calibration texts, fidelity probes the other 20%). Prints one markdown table: Q/K and total
parameters, test accuracy, top-1 agreement and mean KL against the original, seconds.

Then, for each --targets value `--target_agreement A --calibration` and each --max_kls value
`--max_kl K --calibration` (per-layer ranks searched on the held-out calibration texts) and, to show
what the search buys, the best uniform whitened rank at no more Q/K parameters than the target's
allocation and the next rank up.

usage: bench/compress/trained_demo.py [--build build] [--ranks 128,64,32,16] [--model DIR]
         [--data FILE] [--targets 0.99] [--max_kls 1e-3,3e-3] [--extra_flags "--max_iters 100"]
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def run_json(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--model", default=os.path.join(ROOT, "server", "model", "demo"))
    ap.add_argument("--data", default=os.path.join(ROOT, "tests", "data", "demo", "test.jsonl"))
    ap.add_argument("--probe", default=os.path.join(ROOT, "tests", "data", "demo", "calibration.txt"))
    ap.add_argument("--ranks", default="128,64,32,16")
    ap.add_argument("--modes", default="plain,whitened", help="plain, whitened or both")
    ap.add_argument("--targets", default="0.99", help="--target_agreement values (comma-separated; empty: none)")
    ap.add_argument("--max_kls", default="1e-3,3e-3", help="--max_kl values (comma-separated; empty: none)")
    ap.add_argument("--extra_flags", default="")
    ap.add_argument("--json", default="", help="also write the rows here")
    a = ap.parse_args()
    tool = os.path.join(a.build, "bin", "collabserve-model")
    base = run_json([tool, "inspect", "--model", a.model])
    D_k = base["heads"] * base["head_size"]
    ev = run_json([tool, "evaluate", "--model", a.model, "--data", a.data])
    rows = [{"rank": D_k, "mode": "", "act_error": None, "calibration_seconds": 0.0, "label": f"original ({D_k})", "qk": base["parameters"]["attention_qk"],
             "total": base["parameters"]["total"], "accuracy": ev["accuracy"], "agreement": 1.0,
             "mean_kl": 0.0, "max_dlogit": 0.0, "seconds": 0.0, "error": 0.0}]
    def compress_row(tmp, name, label, mode, flags):
        out = os.path.join(tmp, name)
        rep = run_json([tool, "compress", "--model", a.model, "--out", out] + flags + shlex.split(a.extra_flags))
        info = run_json([tool, "inspect", "--model", out])
        ev = run_json([tool, "evaluate", "--model", out, "--data", a.data, "--reference", a.model])
        layers = rep.get("layers", [])
        return {"rank": info.get("collaborative_ranks", []), "mode": mode, "label": label,
                "qk": info["parameters"]["attention_qk"], "total": info["parameters"]["total"],
                "accuracy": ev["accuracy"], "agreement": ev["top1_agreement"],
                "mean_kl": ev["mean_kl"], "max_dlogit": ev["max_abs_logit_diff"],
                "seconds": rep.get("seconds", 0.0),
                "calibration_seconds": rep.get("whitening", {}).get("seconds", 0.0),
                "ranks": [l["rank"] for l in layers],
                "search": rep.get("search"),
                "error": sum(l["relative_error"] for l in layers) / max(1, len(layers)),
                "act_error": (sum(l.get("activation_error", 0) for l in layers) / max(1, len(layers))
                              if mode != "plain" else None)}

    def qk_at(rank):  # the collaborative Q/K parameters of the whole model at a uniform rank
        D, H = D_k, base["heads"]
        return base["layers"] * (2 * D * rank + H * rank + H * D)

    with tempfile.TemporaryDirectory() as tmp:
        for r in [int(x) for x in a.ranks.split(",") if x]:
            for mode in a.modes.split(","):
                extra = ["--probe", a.probe] if mode == "plain" else ["--calibration", a.probe]
                label = f"D_k/{D_k // r}" if D_k % r == 0 else str(r)
                rows.append(compress_row(tmp, f"r{r}-{mode}", label, mode, ["--rank", str(r)] + extra))
        targets = [("target_agreement", t, f"target {t}") for t in a.targets.split(",") if t]
        targets += [("max_kl", k, f"max KL {k}") for k in a.max_kls.split(",") if k]
        for flag, value, label in targets:
            row = compress_row(tmp, f"t{flag}{value}", label, "target",
                               [f"--{flag}", value, "--calibration", a.probe])
            rows.append(row)
            # The best uniform rank at no more Q/K parameters than the target's allocation, and the
            # next one up, both whitened: what the search has to beat.
            r_eq = max(r for r in range(1, D_k + 1) if qk_at(r) <= row["qk"])
            for r in (r_eq, r_eq + 1):
                rows.append(compress_row(tmp, f"u{flag}{value}-{r}", f"uniform {r}", "whitened",
                                         ["--rank", str(r), "--calibration", a.probe]))
    n = ev["examples"]
    print(f"Trained demo model ({base['layers']} layers, {base['heads']} heads, D_k = {D_k}), "
          f"test split of {n} descriptions, CP-ALS (`compress --rank R`, defaults otherwise)\n")
    # The time a target search costs against one fixed-rank whitened compression of the same run.
    fixed = [x for x in rows if x["mode"] == "whitened" and x["label"].startswith("D_k/")]
    fixed_s = sorted(x["seconds"] for x in fixed)[len(fixed) // 2] if fixed else 0.0
    print("| D~ | CP | per-layer ranks | Q/K params | total params | test accuracy | top-1 agreement | mean KL | "
          "max abs d-logit | mean layer error (weights / activations) | compress s (calibration s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        act = f" / {x['act_error']:.3f}" if x["act_error"] is not None else ""
        cal = f" ({x['calibration_seconds']:.1f})" if x["mode"] in ("whitened", "target") else ""
        ratio = f", {x['seconds'] / fixed_s:.2f}x fixed" if x["mode"] == "target" and fixed_s else ""
        ranks = ",".join(str(r) for r in x.get("ranks", [])) or "-"
        print(f"| {x['label']} | {x['mode']} | {ranks} | {x['qk']:,} ({rows[0]['qk'] / x['qk']:.2f}x fewer) | {x['total']:,} | "
              f"{100 * x['accuracy']:.1f}% | {100 * x['agreement']:.2f}% | {x['mean_kl']:.2e} | "
              f"{x['max_dlogit']:.2f} | {x['error']:.3f}{act} | {x['seconds']:.1f}{cal}{ratio} |")
    for x in rows:
        s = x.get("search")
        if s:
            print(f"\n{x['label']}: {s['target']} on {s['texts']} held-out calibration texts; grid {s['grid']}; "
                  f"KL exponents {[round(p, 2) for p in s['kl_exponent']]} (ranks {s['sensitivity_ranks']}); "
                  f"{s['decompositions']} decompositions in {s['decompose_seconds']:.1f} s, sensitivities "
                  f"{s['sensitivity_seconds']:.1f} s, {len(s['trials'])} trials of {s['candidates']} candidates, "
                  f"search {s['seconds']:.1f} s; trials (ranks: held-out agreement): "
                  + "; ".join(f"{t['ranks']}: {100 * t['fidelity']['top1_agreement']:.1f}%" for t in s["trials"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
