#!/usr/bin/python3
"""Trains the demo model from Debian's package descriptions, end to end (`make demo-model`):

  data      apt's package and English description indexes (debian_data.py): corpus and splits
  tokenize  every text through the service's own tokenizer (`collabserve-model tokenize`)
  pretrain  masked-LM on the corpus (held-out texts excluded)
  finetune  BertForSequenceClassification on the train split, best validation epoch kept
  evaluate  on the float16 checkpoint as served: test accuracy, majority and naive Bayes baselines,
            and the same model with uniform attention (does the model use its attention?)
  export    config.json (id2label = the sections), vocab.txt, tokenizer_config.json,
            model.safetensors (float16), training.json; the test split and calibration text

Debian's python3-torch (1.13) with bf16 autocast. Python rather than LibTorch's C++ autograd: this is
a tool of the project, not the service, and the service's C++ engine is then checked against what it
produced (tests/demo). Seeds are fixed: the same data gives the same model. The data is the archive
as it is on the day you run it, so a rerun later may see slightly different packages.

usage: /usr/bin/python3 scripts/demo_model/train_demo.py --tokenizer_bin build/bin/collabserve-model \
         --model_out deploy/models/demo/1 --data_out tests/data/demo [--work DIR] [--lists_dir DIR]
         [--no_fetch] [--quick]
"""
import argparse
import collections
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bert_train as bt  # noqa: E402
import debian_data  # noqa: E402

ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
VOCAB = os.path.join(ROOT, "tests", "data", "bert-base-uncased-vocab.txt")
CLS, SEP, MASK, PAD = 101, 102, 103, 0
FIRST_WORD_ID = 999  # ids below are [PAD], [unused*], [UNK], [CLS], [SEP], [MASK]

CONFIG = {
    "architectures": ["BertForSequenceClassification"],
    "model_type": "bert",
    "vocab_size": 30522,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "intermediate_size": 1024,
    "hidden_act": "gelu",
    "max_position_embeddings": 128,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "initializer_range": 0.02,
    "pad_token_id": 0,
    "torch_dtype": "float16",
}

# Step counts, sized for the whole pipeline to take under an hour on 2 cores.
FULL = dict(pretrain_steps=3000, pretrain_batch=64, pretrain_lr=4e-4, finetune_epochs=4,
            finetune_batch=32, finetune_lr=1e-4, calibration_texts=1024)
QUICK = dict(pretrain_steps=6, pretrain_batch=8, pretrain_lr=5e-4, finetune_epochs=1,
             finetune_batch=8, finetune_lr=1e-4, calibration_texts=16)
SEED = 20261201


def fmt_time(s):
    s = int(max(0, s))
    return f"{s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """One progress line per step batch: stage, step, loss, rate, elapsed, and the ETA of the whole
    pipeline (the remaining steps of every stage at the rate measured so far)."""

    def __init__(self, plan):
        self.plan = dict(plan)  # stage -> steps
        self.done = collections.Counter()
        self.start = time.time()
        self.step_seconds = {}
        self.stage_start = {}

    def begin(self, stage):
        self.stage_start[stage] = time.time()

    def step(self, stage, n=1, **info):
        self.done[stage] += n
        t = time.time() - self.stage_start[stage]
        self.step_seconds[stage] = t / self.done[stage]
        # A stage not started yet: its steps cost what a pretraining step costs per sequence.
        rate = self.step_seconds.get("pretrain", self.step_seconds[stage])
        left = sum((self.plan[s] - self.done[s]) * self.step_seconds.get(s, rate)
                   for s in self.plan)
        extra = " ".join(f"{k} {v}" for k, v in info.items())
        print(f"[{stage}] {self.done[stage]}/{self.plan[stage]} {extra} | "
              f"{1.0 / self.step_seconds[stage]:.2f} steps/s | elapsed {fmt_time(time.time() - self.start)}"
              f" | ETA {fmt_time(left)}", flush=True)


def tokenize(bin_path, tok_dir, texts, max_length):
    """input_ids of each text from the service's tokenizer (truncated to max_length)."""
    payload = "".join(json.dumps({"text": t}) + "\n" for t in texts)
    r = subprocess.run([bin_path, "tokenize", "--model", tok_dir, "--max_length", str(max_length)],
                       input=payload.encode(), capture_output=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"tokenize failed: {r.stderr.decode()[-2000:]}")
    out = [json.loads(line)["input_ids"] for line in r.stdout.decode().splitlines()]
    if len(out) != len(texts):
        raise SystemExit(f"tokenize returned {len(out)} encodings for {len(texts)} texts")
    return out


def pad(seqs):
    n = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


def length_batches(lengths, batch, rng):
    """Batches of similar length (little padding), in random order."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches = [order[i:i + batch] for i in range(0, len(order), batch)]
    rng.shuffle(batches)
    return batches


def mask_tokens(ids, attn, gen):
    """BERT's masking: 15% of the word tokens; of those 80% [MASK], 10% a random word, 10% kept.
    Returns (inputs, flat masked positions, their labels)."""
    word = (ids >= FIRST_WORD_ID) & (attn == 1)
    chosen = (torch.rand(ids.shape, generator=gen) < 0.15) & word
    if not chosen.any():
        chosen = word & (torch.cumsum(word.long(), 1) == 1)
    labels = ids[chosen]
    r = torch.rand(ids.shape, generator=gen)
    inputs = ids.clone()
    inputs[chosen & (r < 0.8)] = MASK
    rand_pos = chosen & (r >= 0.8) & (r < 0.9)
    inputs[rand_pos] = torch.randint(FIRST_WORD_ID, CONFIG["vocab_size"], ids.shape, generator=gen)[rand_pos]
    return inputs, chosen.view(-1).nonzero().squeeze(1), labels


def lr_at(step, total, peak, warmup_frac=0.06):
    warm = max(1, int(total * warmup_frac))
    if step < warm:
        return peak * (step + 1) / warm
    return peak * max(0.0, (total - step) / max(1, total - warm))


def make_optimizer(model, lr):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if n.endswith("bias") or "LayerNorm" in n else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98))


def pretrain(corpus_ids, p, progress, log):
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    gen = torch.Generator().manual_seed(SEED)
    cfg = dict(CONFIG, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = bt.BertForMaskedLM(cfg)
    opt = make_optimizer(model, p["pretrain_lr"])
    lengths = [len(s) for s in corpus_ids]
    batches, step, losses = [], 0, []
    progress.begin("pretrain")
    model.train()
    while step < p["pretrain_steps"]:
        if not batches:
            batches = length_batches(lengths, p["pretrain_batch"], rng)
        idx = batches.pop()
        ids, attn = pad([corpus_ids[i] for i in idx])
        inputs, pos, labels = mask_tokens(ids, attn, gen)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, p["pretrain_steps"], p["pretrain_lr"])
        with torch.cpu.amp.autocast(dtype=torch.bfloat16):
            logits = model(inputs, torch.zeros_like(inputs), attn, pos)
        # In bfloat16: the [masked, vocab] logits are the step's largest tensor, and casting them
        # to float32 and back cost as much as the encoder's products (half the step here).
        loss = F.cross_entropy(logits, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % 25 == 0 or step == p["pretrain_steps"]:
            progress.step("pretrain", 25 if step % 25 == 0 else step % 25,
                          loss=f"{sum(losses[-25:]) / len(losses[-25:]):.3f}")
    log(f"pretrain: {step} steps, final MLM loss {sum(losses[-100:]) / len(losses[-100:]):.3f}")
    return model, losses


@torch.no_grad()
def predict(model, seqs, batch=64, uniform=False):
    model.eval()
    out = []
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    logits = [None] * len(seqs)
    for k in range(0, len(order), batch):
        idx = order[k:k + batch]
        ids, attn = pad([seqs[i] for i in idx])
        lo = model(ids, torch.zeros_like(ids), attn, uniform=uniform).float()
        for j, i in enumerate(idx):
            logits[i] = lo[j]
    out = torch.stack(logits)
    return out


def finetune(mlm, train, valid, p, progress, log):
    torch.manual_seed(SEED + 1)
    rng = random.Random(SEED + 1)
    model = bt.BertForSequenceClassification(CONFIG, len(debian_data.LABELS))
    missing = model.load_state_dict(mlm.state_dict(), strict=False)
    log(f"finetune: from the pretrained encoder; new: {', '.join(missing.missing_keys)}")
    opt = make_optimizer(model, p["finetune_lr"])
    steps_per_epoch = math.ceil(len(train[0]) / p["finetune_batch"])
    total = steps_per_epoch * p["finetune_epochs"]
    lengths = [len(s) for s in train[0]]
    labels = torch.tensor(train[1])
    best, best_state, step = -1.0, None, 0
    progress.begin("finetune")
    for epoch in range(p["finetune_epochs"]):
        model.train()
        for idx in length_batches(lengths, p["finetune_batch"], rng):
            ids, attn = pad([train[0][i] for i in idx])
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total, p["finetune_lr"], 0.1)
            with torch.cpu.amp.autocast(dtype=torch.bfloat16):
                logits = model(ids, torch.zeros_like(ids), attn)
            loss = F.cross_entropy(logits.float(), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 25 == 0:
                progress.step("finetune", 25, epoch=epoch + 1, loss=f"{loss.item():.3f}")
        acc = (predict(model, valid[0]).argmax(1) == torch.tensor(valid[1])).float().mean().item()
        log(f"finetune: epoch {epoch + 1} validation accuracy {acc:.4f}")
        if acc > best:
            best, best_state = acc, {k: v.clone() for k, v in model.state_dict().items()}
    progress.step("finetune", total - progress.done["finetune"])
    model.load_state_dict(best_state)
    return model, best


def naive_bayes(train_seqs, train_labels, test_seqs, n_labels, alpha):
    """Multinomial naive Bayes on the word-piece ids (special tokens left out)."""
    V = CONFIG["vocab_size"]
    counts = torch.full((n_labels, V), alpha, dtype=torch.float64)
    prior = torch.zeros(n_labels, dtype=torch.float64)
    for s, y in zip(train_seqs, train_labels):
        t = torch.tensor([i for i in s if i >= FIRST_WORD_ID], dtype=torch.long)
        counts[y].index_add_(0, t, torch.ones(len(t), dtype=torch.float64))
        prior[y] += 1
    logp = (counts / counts.sum(1, keepdim=True)).log()
    logprior = (prior / prior.sum()).log()
    preds = []
    for s in test_seqs:
        t = torch.tensor([i for i in s if i >= FIRST_WORD_ID], dtype=torch.long)
        preds.append(int((logprior + logp[:, t].sum(1)).argmax()))
    return preds


def write_safetensors(path, tensors, dtype=torch.float16):
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to(dtype).contiguous()
        raw = t.numpy().tobytes() if dtype != torch.bfloat16 else t.view(torch.int16).numpy().tobytes()
        header[name] = {"dtype": {torch.float16: "F16", torch.float32: "F32"}[dtype],
                        "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def write_tokenizer_files(d):
    os.makedirs(d, exist_ok=True)
    shutil.copyfile(VOCAB, os.path.join(d, "vocab.txt"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "BertTokenizer", "do_lower_case": True,
                   "model_max_length": CONFIG["max_position_embeddings"]}, f, indent=2)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer_bin", required=True, help="collabserve-model (its tokenize command)")
    ap.add_argument("--model_out", required=True, help="checkpoint directory to write")
    ap.add_argument("--data_out", required=True, help="directory for test.jsonl and calibration.txt")
    ap.add_argument("--work", default="/tmp/collabserve-demo-model", help="scratch directory")
    ap.add_argument("--lists_dir", default=None, help="apt lists directory (default: WORK/lists)")
    ap.add_argument("--no_fetch", action="store_true", help="use the lists already in --lists_dir")
    ap.add_argument("--quick", action="store_true", help="a few steps on a few hundred texts (tests)")
    ap.add_argument("--records", default=None, help="JSON lines of records instead of apt (tests)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every CPU)")
    a = ap.parse_args()
    t0 = time.time()
    torch.set_num_threads(a.threads or os.cpu_count() or 1)
    p = QUICK if a.quick else FULL
    os.makedirs(a.work, exist_ok=True)
    report = {"config": p, "seed": SEED, "threads": torch.get_num_threads()}

    def log(msg):
        print(msg, flush=True)

    # data
    if a.records:
        with open(a.records) as f:
            records = [json.loads(line) for line in f if line.strip()]
    else:
        lists = a.lists_dir or os.path.join(a.work, "lists")
        records = debian_data.load(lists, fetch=not a.no_fetch, log=log)
    corpus, splits = debian_data.build_dataset(records)
    if a.quick:
        corpus = corpus[:400]
        splits = {k: v[:{"train": 160}.get(k, 40)] for k, v in splits.items()}
    log(f"data: {len(records)} packages, corpus {len(corpus)} texts; "
        + ", ".join(f"{k} {len(v)}" for k, v in splits.items()))
    report["data"] = {"packages": len(records), "corpus_texts": len(corpus),
                      **{f"{k}_examples": len(v) for k, v in splits.items()}}

    # tokenize, through the service's tokenizer
    tok_dir = os.path.join(a.work, "tokenizer")
    write_tokenizer_files(tok_dir)
    L = CONFIG["max_position_embeddings"]
    corpus_ids = tokenize(a.tokenizer_bin, tok_dir, corpus, L)
    label_id = {name: i for i, name in enumerate(debian_data.LABELS)}
    data = {}
    for k, v in splits.items():
        data[k] = (tokenize(a.tokenizer_bin, tok_dir, [e["text"] for e in v], L) if v else [],
                   [label_id[e["label"]] for e in v])
    report["data"]["corpus_tokens"] = sum(len(s) for s in corpus_ids)
    report["data"]["truncated_corpus_texts"] = sum(len(s) == L for s in corpus_ids)
    log(f"tokenize: {report['data']['corpus_tokens']} corpus tokens, "
        f"{report['data']['truncated_corpus_texts']} texts cut at {L}")

    ft_steps = math.ceil(len(data["train"][0]) / p["finetune_batch"]) * p["finetune_epochs"]
    progress = Progress({"pretrain": p["pretrain_steps"], "finetune": ft_steps})
    t = time.time()
    mlm, losses = pretrain(corpus_ids, p, progress, log)
    report["pretrain"] = {"steps": p["pretrain_steps"], "seconds": round(time.time() - t, 1),
                          "first_loss": round(sum(losses[:25]) / len(losses[:25]), 3),
                          "final_loss": round(sum(losses[-100:]) / len(losses[-100:]), 3)}
    t = time.time()
    model, best_valid = finetune(mlm, data["train"], data["validation"], p, progress, log)
    report["finetune"] = {"epochs": p["finetune_epochs"], "steps": ft_steps,
                          "seconds": round(time.time() - t, 1), "best_validation_accuracy": round(best_valid, 4)}

    # export float16, then evaluate what is served: the float16 weights read back as float32
    os.makedirs(a.model_out, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items()}
    write_safetensors(os.path.join(a.model_out, "model.safetensors"), state)
    served = bt.BertForSequenceClassification(CONFIG, len(debian_data.LABELS))
    served.load_state_dict({k: v.half().float() for k, v in state.items()})
    test_seqs, test_y = data["test"]
    y = torch.tensor(test_y)
    logits = predict(served, test_seqs)
    uniform = predict(served, test_seqs, uniform=True)
    pred = logits.argmax(1)
    majority = collections.Counter(data["train"][1]).most_common(1)[0][0]
    valid_nb = {alpha: sum(int(a_ == b) for a_, b in zip(
        naive_bayes(data["train"][0], data["train"][1], data["validation"][0], len(label_id), alpha),
        data["validation"][1])) for alpha in (0.1, 0.3, 1.0)}
    alpha = max(valid_nb, key=valid_nb.get)
    nb = torch.tensor(naive_bayes(data["train"][0], data["train"][1], test_seqs, len(label_id), alpha))
    report["test"] = {
        "examples": len(test_y),
        "accuracy": round((pred == y).float().mean().item(), 4),
        "majority_class": debian_data.LABELS[majority],
        "majority_accuracy": round((y == majority).float().mean().item(), 4),
        "naive_bayes_alpha": alpha,
        "naive_bayes_accuracy": round((nb == y).float().mean().item(), 4),
        "uniform_attention_accuracy": round((uniform.argmax(1) == y).float().mean().item(), 4),
        "uniform_attention_agreement": round((uniform.argmax(1) == pred).float().mean().item(), 4),
    }
    log("test: " + json.dumps(report["test"]))

    cfg = dict(CONFIG, id2label={str(i): n for i, n in enumerate(debian_data.LABELS)},
               label2id={n: i for i, n in enumerate(debian_data.LABELS)})
    with open(os.path.join(a.model_out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    write_tokenizer_files(a.model_out)

    os.makedirs(a.data_out, exist_ok=True)
    with open(os.path.join(a.data_out, "test.jsonl"), "w") as f:
        for e, lo in zip(splits["test"], logits):
            f.write(json.dumps({"text": e["text"], "label": e["label"], "source": e["source"],
                                "name": e["name"]}) + "\n")
    rng = random.Random(SEED + 2)
    calib = [e["text"] for e in splits["train"]]
    rng.shuffle(calib)
    with open(os.path.join(a.data_out, "calibration.txt"), "w") as f:
        for t_ in calib[:p["calibration_texts"]]:
            f.write(t_ + "\n")
    report["seconds"] = round(time.time() - t0, 1)
    with open(os.path.join(a.data_out, "training.json"), "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    log(f"done in {fmt_time(time.time() - t0)}: {a.model_out}, {a.data_out}")


if __name__ == "__main__":
    main()
