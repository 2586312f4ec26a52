"""BERT for training the demo model: BertForMaskedLM and BertForSequenceClassification with Hugging
Face's module names, so that state_dict() keys are the checkpoint's tensor names with no mapping
table (bert.embeddings.word_embeddings.weight, bert.encoder.layer.0.attention.self.query.weight, ...).
Post-LayerNorm, erf GELU, additive mask, as modeling_bert.py. Debian's python3-torch (1.13).

`uniform_attention=True` replaces every head's softmax by a uniform average over the non-padding
keys: the check that the trained model's answers depend on its attention.
"""
import math

import torch
from torch import nn
import torch.nn.functional as F


class BertEmbeddings(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.word_embeddings = nn.Embedding(c["vocab_size"], c["hidden_size"], padding_idx=0)
        self.position_embeddings = nn.Embedding(c["max_position_embeddings"], c["hidden_size"])
        self.token_type_embeddings = nn.Embedding(c["type_vocab_size"], c["hidden_size"])
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])
        self.dropout = nn.Dropout(c["hidden_dropout_prob"])

    def forward(self, input_ids, token_type_ids):
        pos = torch.arange(input_ids.size(1), device=input_ids.device)[None, :]
        e = self.word_embeddings(input_ids) + self.position_embeddings(pos) + \
            self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(e))


class BertSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        D = c["hidden_size"]
        self.H = c["num_attention_heads"]
        self.dk = D // self.H
        self.query, self.key, self.value = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.dropout = nn.Dropout(c["attention_probs_dropout_prob"])

    def heads(self, x):
        return x.view(x.size(0), x.size(1), self.H, self.dk).transpose(1, 2)

    def forward(self, h, ext_mask, key_mask, uniform):
        v = self.heads(self.value(h))
        if uniform:
            w = key_mask[:, None, None, :].to(v.dtype)
            probs = (w / w.sum(-1, keepdim=True)).expand(-1, self.H, h.size(1), -1)
        else:
            q, k = self.heads(self.query(h)), self.heads(self.key(h))
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.dk) + ext_mask
            probs = self.dropout(torch.softmax(scores.float(), dim=-1).to(v.dtype))
        ctx = torch.matmul(probs, v).transpose(1, 2).contiguous()
        return ctx.view(h.size(0), h.size(1), -1)


class BertSelfOutput(nn.Module):
    def __init__(self, c, d_in):
        super().__init__()
        self.dense = nn.Linear(d_in, c["hidden_size"])
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])
        self.dropout = nn.Dropout(c["hidden_dropout_prob"])

    def forward(self, x, residual):
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self = BertSelfAttention(c)
        self.output = BertSelfOutput(c, c["hidden_size"])

    def forward(self, h, ext_mask, key_mask, uniform):
        return self.output(self.self(h, ext_mask, key_mask, uniform), h)


class BertIntermediate(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["intermediate_size"])

    def forward(self, x):
        return F.gelu(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attention = BertAttention(c)
        self.intermediate = BertIntermediate(c)
        self.output = BertSelfOutput(c, c["intermediate_size"])  # HF's BertOutput: same layout

    def forward(self, h, ext_mask, key_mask, uniform):
        a = self.attention(h, ext_mask, key_mask, uniform)
        return self.output(self.intermediate(a), a)


class BertEncoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(c) for _ in range(c["num_hidden_layers"]))

    def forward(self, h, ext_mask, key_mask, uniform):
        for layer in self.layer:
            h = layer(h, ext_mask, key_mask, uniform)
        return h


class BertPooler(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["hidden_size"])

    def forward(self, h):
        return torch.tanh(self.dense(h[:, 0]))


class BertModel(nn.Module):
    def __init__(self, c, pooler=True):
        super().__init__()
        self.embeddings = BertEmbeddings(c)
        self.encoder = BertEncoder(c)
        self.pooler = BertPooler(c) if pooler else None

    def forward(self, input_ids, token_type_ids, attention_mask, uniform=False):
        h = self.embeddings(input_ids, token_type_ids)
        ext = (1.0 - attention_mask[:, None, None, :].to(h.dtype)) * -10000.0
        return self.encoder(h, ext, attention_mask, uniform)


def init_weights(module, std=0.02):
    """modeling_bert's _init_weights: normal(0, 0.02) weights, zero biases, unit LayerNorms."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.weight.data.normal_(0.0, std)
            m.bias.data.zero_()
        elif isinstance(m, nn.Embedding):
            m.weight.data.normal_(0.0, std)
            if m.padding_idx is not None:
                m.weight.data[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            m.weight.data.fill_(1.0)
            m.bias.data.zero_()


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["hidden_size"])
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])

    def forward(self, x):
        return self.LayerNorm(F.gelu(self.dense(x)).float())


class BertLMPredictionHead(nn.Module):
    def __init__(self, c, word_embeddings):
        super().__init__()
        self.transform = BertPredictionHeadTransform(c)
        self.word_embeddings = [word_embeddings]  # tied decoder (a list: not a second parameter)
        self.bias = nn.Parameter(torch.zeros(c["vocab_size"]))

    def forward(self, x):
        return F.linear(self.transform(x), self.word_embeddings[0].weight, self.bias)


class BertOnlyMLMHead(nn.Module):
    def __init__(self, c, word_embeddings):
        super().__init__()
        self.predictions = BertLMPredictionHead(c, word_embeddings)


class BertForMaskedLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.bert = BertModel(c, pooler=False)
        self.cls = BertOnlyMLMHead(c, self.bert.embeddings.word_embeddings)
        init_weights(self)

    def forward(self, input_ids, token_type_ids, attention_mask, masked_positions):
        """Logits at the masked positions only ([n_masked, vocab]): the decoder is 3/4 of a small
        model's FLOPs if it runs on every token."""
        h = self.bert(input_ids, token_type_ids, attention_mask)
        return self.cls.predictions(h.reshape(-1, h.size(-1))[masked_positions])


class BertForSequenceClassification(nn.Module):
    def __init__(self, c, num_labels):
        super().__init__()
        self.bert = BertModel(c)
        self.dropout = nn.Dropout(c["hidden_dropout_prob"])
        self.classifier = nn.Linear(c["hidden_size"], num_labels)
        init_weights(self)

    def forward(self, input_ids, token_type_ids, attention_mask, uniform=False):
        h = self.bert(input_ids, token_type_ids, attention_mask, uniform)
        return self.classifier(self.dropout(self.bert.pooler(h)))
