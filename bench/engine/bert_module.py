"""BertForSequenceClassification as a plain torch.nn.Module, laid out like Hugging Face's
modeling_bert (separate query/key/value Linear layers, transpose_for_scores, additive mask from
finfo.min, erf GELU), loaded from a collabserve/HF checkpoint directory through the independent
reference in tests/reference/bert_reference.py. It is the "PyTorch eager" baseline of
bench/engine and the graph exported to ONNX for the ONNX Runtime baseline.

Standard (non-collaborative) checkpoints with hidden_act gelu only: that is what the bench uses.
`load(..., sdpa=True)` computes attention with torch's fused scaled_dot_product_attention
(torch >= 2.0) and no mask when nothing is padded, what Hugging Face's "sdpa" attention does: the
GPU baseline.
"""
import math
import os
import sys

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "reference"))
import bert_reference  # noqa: E402  (sets torch's thread count to 1: callers set their own after)


class SelfAttention(nn.Module):
    def __init__(self, D, H, sdpa=False):
        super().__init__()
        self.H, self.dk, self.sdpa = H, D // H, sdpa
        self.query, self.key, self.value = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def heads(self, x):
        return x.view(x.size(0), x.size(1), self.H, self.dk).permute(0, 2, 1, 3)

    def forward(self, h, ext_mask):
        q, k, v = self.heads(self.query(h)), self.heads(self.key(h)), self.heads(self.value(h))
        if self.sdpa:
            ctx = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=ext_mask)
            ctx = ctx.permute(0, 2, 1, 3).contiguous()
            return ctx.view(ctx.size(0), ctx.size(1), -1)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.dk) + ext_mask
        probs = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return ctx.view(ctx.size(0), ctx.size(1), -1)


class Layer(nn.Module):
    def __init__(self, D, H, F, eps, sdpa=False):
        super().__init__()
        self.self_attn = SelfAttention(D, H, sdpa)
        self.attn_out = nn.Linear(D, D)
        self.attn_ln = nn.LayerNorm(D, eps=eps)
        self.inter = nn.Linear(D, F)
        self.out = nn.Linear(F, D)
        self.out_ln = nn.LayerNorm(D, eps=eps)

    def forward(self, h, ext_mask):
        h = self.attn_ln(self.attn_out(self.self_attn(h, ext_mask)) + h)
        return self.out_ln(self.out(nn.functional.gelu(self.inter(h))) + h)


class BertClassifier(nn.Module):
    def __init__(self, cfg, sdpa=False):
        super().__init__()
        D, H, F = cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"]
        eps = cfg.get("layer_norm_eps", 1e-12)
        self.word = nn.Embedding(cfg["vocab_size"], D)
        self.pos = nn.Embedding(cfg["max_position_embeddings"], D)
        self.token_type = nn.Embedding(cfg.get("type_vocab_size", 2), D)
        self.emb_ln = nn.LayerNorm(D, eps=eps)
        self.sdpa = sdpa
        self.layers = nn.ModuleList(Layer(D, H, F, eps, sdpa) for _ in range(cfg["num_hidden_layers"]))
        self.pooler = nn.Linear(D, D)
        self.classifier = nn.Linear(D, len(cfg.get("id2label", {})) or cfg.get("num_labels", 2))

    def forward(self, input_ids, token_type_ids, attention_mask):
        pos = torch.arange(input_ids.size(1), dtype=torch.long, device=input_ids.device).unsqueeze(0)
        h = self.emb_ln(self.word(input_ids) + self.pos(pos) + self.token_type(token_type_ids))
        ext = (1.0 - attention_mask[:, None, None, :].to(h.dtype)) * torch.finfo(h.dtype).min
        if self.sdpa and bool((attention_mask == 1).all()):
            ext = None  # no padding: no mask, as Hugging Face's SDPA attention (flash attention may run)
        for layer in self.layers:
            h = layer(h, ext)
        return self.classifier(torch.tanh(self.pooler(h[:, 0])))


def load(model_dir, sdpa=False):
    """Returns (module in eval mode, the bert_reference.Reference it was loaded from)."""
    ref = bert_reference.Reference(model_dir)
    if any(ref.ranks) or ref.cfg.get("hidden_act", "gelu") != "gelu":
        raise SystemExit(f"{model_dir}: bert_module handles standard gelu checkpoints only")
    if sdpa and not hasattr(nn.functional, "scaled_dot_product_attention"):
        raise SystemExit(f"torch {torch.__version__} has no scaled_dot_product_attention (needs >= 2.0)")
    m = BertClassifier(ref.cfg, sdpa)
    w = ref.w
    e = "bert.embeddings"

    def lin(mod, name):
        mod.weight.copy_(w[name + ".weight"])
        mod.bias.copy_(w[name + ".bias"])

    with torch.no_grad():
        m.word.weight.copy_(w[e + ".word_embeddings.weight"])
        m.pos.weight.copy_(w[e + ".position_embeddings.weight"])
        m.token_type.weight.copy_(w[e + ".token_type_embeddings.weight"])
        lin(m.emb_ln, e + ".LayerNorm")
        for i, layer in enumerate(m.layers):
            p = f"bert.encoder.layer.{i}"
            lin(layer.self_attn.query, p + ".attention.self.query")
            lin(layer.self_attn.key, p + ".attention.self.key")
            lin(layer.self_attn.value, p + ".attention.self.value")
            lin(layer.attn_out, p + ".attention.output.dense")
            lin(layer.attn_ln, p + ".attention.output.LayerNorm")
            lin(layer.inter, p + ".intermediate.dense")
            lin(layer.out, p + ".output.dense")
            lin(layer.out_ln, p + ".output.LayerNorm")
        lin(m.pooler, "bert.pooler.dense")
        lin(m.classifier, "classifier")
    return m.eval(), ref


def make_inputs(batch, seq):
    """The bench's inputs, identical to engine_bench.cc's MakeInputs."""
    b = torch.arange(batch, dtype=torch.long)[:, None]
    s = torch.arange(seq, dtype=torch.long)[None, :]
    ids = 1000 + ((b * seq + s) * 7919) % 20000
    ids[:, 0] = 101
    ids[:, -1] = 102
    return ids, torch.zeros_like(ids), torch.ones_like(ids)
