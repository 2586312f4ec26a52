// ONNX Runtime (CPU execution provider, onnxruntime-node) baseline for bench/engine: the model
// exported by pytorch_bench.py --export_onnx, the same inputs and timing policy as engine_bench.
//
// usage: node ort_bench.mjs --model FILE.onnx --out FILE.tsv [--batches 1,8,32] [--seqs 16,128,512]
//                           [--threads 2] [--budget_s 4] [--min_runs 3] [--max_runs 50]
//                           [--warmup_batch 8]
import fs from 'node:fs';
import { performance } from 'node:perf_hooks';
import ort from 'onnxruntime-node';

function parseArgs(argv) {
  const a = { batches: [1, 8, 32], seqs: [16, 128, 512], threads: 2, budget_s: 4, min_runs: 3, max_runs: 50, warmup_batch: 8 };
  for (let i = 0; i < argv.length; i += 2) {
    const name = argv[i].replace(/^--/, '');
    const v = argv[i + 1];
    if (v === undefined) throw new Error(`ort_bench: --${name} needs a value`);
    if (name === 'model' || name === 'out') a[name] = v;
    else if (name === 'batches' || name === 'seqs') a[name] = v.split(',').map(Number);
    else if (name in a) a[name] = Number(v);
    else throw new Error(`ort_bench: unknown flag --${name}`);
  }
  if (!a.model || !a.out) throw new Error('ort_bench: --model and --out are required');
  return a;
}

function median(v) {
  const s = [...v].sort((x, y) => x - y), n = s.length;
  return n % 2 ? s[(n - 1) / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

// Identical to engine_bench.cc's MakeInputs.
function makeInputs(batch, seq) {
  const n = batch * seq;
  const ids = new BigInt64Array(n), types = new BigInt64Array(n), mask = new BigInt64Array(n);
  for (let b = 0; b < batch; b++) {
    for (let s = 0; s < seq; s++) {
      let id = 1000 + ((b * seq + s) * 7919) % 20000;
      if (s === 0) id = 101;
      if (s === seq - 1) id = 102;
      ids[b * seq + s] = BigInt(id);
      mask[b * seq + s] = 1n;
    }
  }
  const dims = [batch, seq];
  return {
    input_ids: new ort.Tensor('int64', ids, dims),
    token_type_ids: new ort.Tensor('int64', types, dims),
    attention_mask: new ort.Tensor('int64', mask, dims),
  };
}

const a = parseArgs(process.argv.slice(2));
const session = await ort.InferenceSession.create(a.model, {
  executionProviders: ['cpu'],
  intraOpNumThreads: a.threads,
  interOpNumThreads: 1,
  executionMode: 'sequential',
  graphOptimizationLevel: 'all',
});
console.error(`ort_bench: onnxruntime-node ${ort.env.versions?.common ?? '?'}, intraOpNumThreads=${a.threads}`);
const lines = ['# batch\tseq\tort_seq_per_s\truns\tcpu_ms_per_seq'];
for (const b of a.batches) {
  for (const s of a.seqs) {
    const feeds = makeInputs(b, s);
    await session.run(makeInputs(Math.min(b, a.warmup_batch), s));  // warm-up
    const times = [], cpu = [];
    let spent = 0;
    while (times.length < a.max_runs && (times.length < a.min_runs || spent < a.budget_s)) {
      const t0 = performance.now(), c0 = process.cpuUsage();
      await session.run(feeds);
      const dt = (performance.now() - t0) / 1000, dc = process.cpuUsage(c0);
      times.push(dt);
      cpu.push((dc.user + dc.system) / 1e6);
      spent += dt;
    }
    const n = times.length, med = median(times);
    lines.push(`${b}\t${s}\t${(b / med).toFixed(4)}\t${n}\t${(1e3 * median(cpu) / b).toFixed(3)}`);
    fs.writeFileSync(a.out, lines.join('\n') + '\n');
    console.error(`ort_bench: ${b} x ${s}: ${(b / med).toFixed(2)} seq/s (${n} runs)`);
  }
}
