#!/usr/bin/python3
"""An independent reference for BertForSequenceClassification (eval mode, fp32), written from
Hugging Face transformers' modeling_bert.py with Debian's python3-torch (transformers itself cannot
be installed here). It also evaluates collaborative layers from the formula in the paper, so that the
C++ engine is checked against code that shares nothing with it.

usage: bert_reference.py MODEL_DIR < inputs.jsonl > logits.jsonl
  input lines: {"input_ids": [[...], ...], "token_type_ids": [[...], ...]}  (one padded-or-not batch;
  sequences of different lengths are padded here and masked like HF's attention_mask)
  output lines: {"logits": [[...], ...]}
"""
import json
import math
import os
import struct
import sys

import numpy as np
import torch

torch.set_grad_enabled(False)
torch.set_num_threads(1)


def load_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        raw = data[base + b:base + e]
        shape = info["shape"]
        dt = info["dtype"]
        if dt == "F32":
            arr = np.frombuffer(raw, dtype="<f4").astype(np.float32)
        elif dt == "F16":
            arr = np.frombuffer(raw, dtype="<f2").astype(np.float32)
        elif dt == "BF16":
            arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif dt == "F64":
            arr = np.frombuffer(raw, dtype="<f8").astype(np.float32)
        else:
            raise ValueError(f"{name}: dtype {dt}")
        out[name] = torch.from_numpy(arr.reshape(shape).copy())
    return out


def load_weights(model_dir):
    st = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(st):
        sd = load_safetensors(st)
    else:
        sd = torch.load(os.path.join(model_dir, "pytorch_model.bin"), map_location="cpu")
    fixed = {}
    for k, v in sd.items():
        if k.startswith(("embeddings.", "encoder.", "pooler.")):
            k = "bert." + k
        k = k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        fixed[k] = v.float()
    return fixed


ACT = {
    "gelu": lambda x: torch.nn.functional.gelu(x),
    "relu": torch.relu,
    # NewGELUActivation in transformers' activations.py
    "gelu_new": lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))),
    "gelu_pytorch_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
}


class Reference:
    def __init__(self, model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            self.cfg = json.load(f)
        self.w = load_weights(model_dir)
        self.H = self.cfg["num_attention_heads"]
        self.D = self.cfg["hidden_size"]
        self.dk = self.D // self.H
        self.eps = self.cfg.get("layer_norm_eps", 1e-12)
        self.act = ACT[self.cfg.get("hidden_act", "gelu")]
        collab = self.cfg.get("collaborative")
        self.ranks = collab["ranks"] if collab else [0] * self.cfg["num_hidden_layers"]

    def lin(self, x, name):
        return x @ self.w[name + ".weight"].T + self.w[name + ".bias"]

    def ln(self, x, name):
        return torch.nn.functional.layer_norm(x, (self.D,), self.w[name + ".weight"], self.w[name + ".bias"], self.eps)

    def self_attention(self, i, h, ext_mask):
        p = f"bert.encoder.layer.{i}.attention.self"
        B, S, _ = h.shape
        heads = lambda t: t.view(B, S, self.H, self.dk).permute(0, 2, 1, 3)
        v = heads(self.lin(h, p + ".value"))
        if self.ranks[i] == 0:
            q = heads(self.lin(h, p + ".query"))
            k = heads(self.lin(h, p + ".key"))
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.dk)
        else:
            # score_i = (X W~Q) diag(m_i) (Y W~K)^T + 1 v_i^T Y^T ; 1/sqrt(dk) already folded in.
            xq = h @ self.w[p + ".collab_query.weight"].T   # [B, S, R]
            yk = h @ self.w[p + ".collab_key.weight"].T     # [B, S, R]
            m = self.w[p + ".mixing"]                        # [H, R]
            vb = self.w[p + ".content_bias"]                 # [H, D]
            scores = torch.einsum("bnr,hr,bmr->bhnm", xq, m, yk)
            scores = scores + torch.einsum("hd,bmd->bhm", vb, h)[:, :, None, :]
        scores = scores + ext_mask
        probs = torch.softmax(scores, dim=-1)
        ctx = (probs @ v).permute(0, 2, 1, 3).reshape(B, S, self.D)
        return ctx

    def forward(self, input_ids, token_type_ids, attention_mask):
        B, S = input_ids.shape
        pos = torch.arange(S).unsqueeze(0)
        e = "bert.embeddings"
        h = (self.w[e + ".word_embeddings.weight"][input_ids]
             + self.w[e + ".position_embeddings.weight"][pos]
             + self.w[e + ".token_type_embeddings.weight"][token_type_ids])
        h = self.ln(h, e + ".LayerNorm")
        ext = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"bert.encoder.layer.{i}"
            ctx = self.self_attention(i, h, ext)
            h = self.ln(self.lin(ctx, p + ".attention.output.dense") + h, p + ".attention.output.LayerNorm")
            inter = self.act(self.lin(h, p + ".intermediate.dense"))
            h = self.ln(self.lin(inter, p + ".output.dense") + h, p + ".output.LayerNorm")
        pooled = torch.tanh(self.lin(h[:, 0], "bert.pooler.dense"))
        return self.lin(pooled, "classifier")


def main():
    ref = Reference(sys.argv[1])
    pad = ref.cfg.get("pad_token_id", 0)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        ids = req["input_ids"]
        tts = req.get("token_type_ids") or [[0] * len(x) for x in ids]
        S = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), S), pad, dtype=torch.long)
        types = torch.zeros((len(ids), S), dtype=torch.long)
        mask = torch.zeros((len(ids), S), dtype=torch.long)
        for b, (x, t) in enumerate(zip(ids, tts)):
            input_ids[b, :len(x)] = torch.tensor(x)
            types[b, :len(t)] = torch.tensor(t)
            mask[b, :len(x)] = 1
        logits = ref.forward(input_ids, types, mask)
        print(json.dumps({"logits": logits.tolist()}), flush=True)


if __name__ == "__main__":
    main()
