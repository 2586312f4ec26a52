#!/usr/bin/python3
"""Writes the fuzz seed corpora under tests/fuzz/corpus/<target>/: small real files (a safetensors
file, torch.save zips of tiny state dicts, Hugging Face configs) and the nasty cases the unit tests
use. Deterministic; rerun after changing it and commit the output. Needs Debian's python3 with torch
(call /usr/bin/python3 explicitly). Every file stays under 20 KB.

    /usr/bin/python3 tests/fuzz/make_corpus.py [target...]
"""
import collections
import io
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(HERE, "corpus")


def put(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    assert len(data) < 20_000, (target, name, len(data))
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---- safetensors ----

def safetensors(header, data=b"", raw_header=None):
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def real_safetensors():
    tensors = [("w.F32", "F32", [2, 3], struct.pack("<6f", *[0.5 * i for i in range(6)])),
               ("w.F16", "F16", [4], struct.pack("<4e", 1, -2, 0.5, 65504)),
               ("w.BF16", "BF16", [2], b"\x80\x3f\x00\xc0"),
               ("w.I64", "I64", [], struct.pack("<q", -7)),
               ("w.I32", "I32", [1, 2], struct.pack("<2i", 3, -4)),
               ("w.I16", "I16", [2], struct.pack("<2h", 5, -6)),
               ("w.I8", "I8", [3], b"\x01\xff\x7f"),
               ("w.U8", "U8", [2, 2], b"\x00\x01\xfe\xff"),
               ("w.BOOL", "BOOL", [3], b"\x01\x00\x01"),
               ("w.F64", "F64", [1], struct.pack("<d", 3.25)),
               ("empty", "F32", [0, 4], b"")]
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, dtype, shape, payload in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def gen_safetensors():
    put("safetensors", "real_all_dtypes.safetensors", real_safetensors())
    f32 = lambda shape, off: {"dtype": "F32", "shape": shape, "data_offsets": off}
    cases = {
        "empty_header.safetensors": safetensors({}),
        "metadata_only.safetensors": safetensors({"__metadata__": {"a": "b", "": ""}}),
        "huge_header_length.safetensors": b"\xff" * 8 + b"{}",
        "truncated_header.safetensors": struct.pack("<Q", 500) + b'{"a": {"dtype"',
        "non_json.safetensors": safetensors(None, raw_header=b'{"a": nope}'),
        "not_object.safetensors": safetensors([1, 2, 3]),
        "entry_wrong_type.safetensors": safetensors({"w": 3}),
        "nested_shape.safetensors": safetensors({"w": f32([[[[1]]]], [0, 4])}, b"\0" * 4),
        "float_dim.safetensors": safetensors(None, b"\0" * 4, raw_header=b'{"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}}'),
        "unknown_field.safetensors": safetensors({"w": dict(f32([], [0, 4]), x=1)}, b"\0" * 4),
        "missing_offsets.safetensors": safetensors({"w": {"dtype": "F32", "shape": []}}, b"\0" * 4),
        "one_offset.safetensors": safetensors({"w": f32([], [0])}, b"\0" * 4),
        "metadata_not_string.safetensors": safetensors({"__metadata__": {"k": 1}}),
        "empty_name.safetensors": safetensors({"": f32([], [0, 4])}, b"\0" * 4),
        "duplicate_name.safetensors": safetensors(None, b"\0" * 8, raw_header=b'{"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[],"data_offsets":[4,8]}}'),
        "overlap.safetensors": safetensors({"a": f32([2], [0, 8]), "b": f32([2], [4, 12])}, b"\0" * 12),
        "out_of_range.safetensors": safetensors({"a": f32([25], [0, 100])}, b"\0" * 8),
        "reversed.safetensors": safetensors({"a": f32([2], [8, 0])}, b"\0" * 8),
        "negative_offset.safetensors": safetensors({"a": f32([2], [-8, 0])}, b"\0" * 8),
        "negative_dim.safetensors": safetensors({"a": f32([-1, 2], [0, 8])}, b"\0" * 8),
        "overflow_dims.safetensors": safetensors({"a": f32([1 << 40, 1 << 40], [0, 8])}, b"\0" * 8),
        "u64_dim.safetensors": safetensors({"a": f32([2**64 - 1], [0, 8])}, b"\0" * 8),
        "rank17.safetensors": safetensors({"a": f32([1] * 17, [0, 4])}, b"\0" * 4),
        "dtype_shape_mismatch.safetensors": safetensors({"x": f32([3], [10, 20])}, b"\0" * 20),
        "unknown_dtype.safetensors": safetensors({"x": {"dtype": "U16", "shape": [1], "data_offsets": [0, 2]}}, b"\0" * 2),
        "holes_and_empty.safetensors": safetensors({"e": f32([0, 5], [4, 4]), "a": {"dtype": "I8", "shape": [2], "data_offsets": [2, 4]}}, b"\0" * 8),
        "deep_nesting.safetensors": safetensors(None, raw_header=b"{" + b'"a":[' * 200 + b"]" * 200 + b"}"),
    }
    for name, data in cases.items():
        put("safetensors", name, data)


# ---- torch.save zips and their data.pkl ----

class Evil:
    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return (self.fn, (self.arg,))


def torch_bytes(obj, **kw):
    buf = io.BytesIO()
    torch.save(obj, buf, **kw)
    return buf.getvalue()


def data_pkl(zip_bytes):
    with zipfile.ZipFile(io.BytesIO(zip_bytes)) as z:
        name = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        return z.read(name)


def gen_torch_zip():
    torch.manual_seed(0)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    sd = collections.OrderedDict([
        ("bert.embeddings.word_embeddings.weight", torch.randn(8, 4)),
        ("bert.encoder.layer.0.attention.self.query.weight", base),
        ("bert.encoder.layer.0.attention.self.query.weight_t", base.t()),    # shared storage, strided
        ("bert.encoder.layer.0.attention.self.query.row", base[1]),          # storage offset
        ("classifier.bias", torch.zeros(2, dtype=torch.float16)),
        ("bf16", torch.ones(3, dtype=torch.bfloat16)),
        ("position_ids", torch.arange(6).unsqueeze(0)),
        ("mask", torch.tensor([True, False])),
        ("i8", torch.tensor([-1, 2], dtype=torch.int8)),
        ("u8", torch.tensor([255], dtype=torch.uint8)),
        ("f64", torch.tensor(2.5, dtype=torch.float64)),
        ("expanded", torch.ones(1, 3).expand(4, 3)),
        ("empty", torch.zeros(0, 3)),
    ])
    sd._metadata = collections.OrderedDict([("", {"version": 1}), ("bert", {"version": 1})])
    param = collections.OrderedDict([("p", torch.nn.Parameter(torch.ones(2, 2)))])
    files = {
        "tiny_state_dict": torch_bytes(sd),
        "parameters": torch_bytes(param),
        "nested_state_dict": torch_bytes({"state_dict": collections.OrderedDict([("w", torch.ones(2))])}),
        "plain_dict": torch_bytes({"w": torch.ones(2), "b": torch.zeros(1, dtype=torch.int32)}),
        "not_a_dict": torch_bytes([torch.ones(1)]),
        "non_tensor_value": torch_bytes({"w": 3}),
        "os_system": torch_bytes({"w": Evil(os.system, "touch /tmp/collabserve-fuzz-pwned")}),
        "eval": torch_bytes({"w": Evil(eval, "1+1")}),
        "protocol4": torch_bytes(collections.OrderedDict([("w", torch.ones(2, 3))]), pickle_protocol=4),
    }
    for name, data in files.items():
        put("torch_zip", name + ".bin", data)
        put("torch_zip", name + ".pkl", data_pkl(data))
    for name in sorted(os.listdir(os.path.join(REPO, "tests/data/model_io"))):
        data = open(os.path.join(REPO, "tests/data/model_io", name), "rb").read()
        put("torch_zip", "data_" + name, data)
    # Hand-made pickles: globals outside the allow-list, memo and stack abuse, recursion.
    pk = {
        "global_os_system.pkl": b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00lsq\x00\x85R.",
        "stack_global_eval.pkl": b"\x80\x04\x8c\x08builtins\x8c\x04eval\x93\x8c\x031+1\x85R.",
        "subprocess.pkl": b"\x80\x02csubprocess\nPopen\n]q\x00X\x02\x00\x00\x00ls\x85R.",
        "huge_memo_get.pkl": b"\x80\x02}j\xff\xff\xff\x7f.",
        "huge_memo_put.pkl": b"\x80\x02}r\xff\xff\xff\x7f.",
        "unset_memo.pkl": b"\x80\x02}h\x05.",
        "deep_lists.pkl": b"\x80\x02" + b"]" * 100 + b"a" * 99 + b".",
        "self_reference.pkl": b"\x80\x02}q\x00X\x01\x00\x00\x00ah\x00s.",
        "unterminated.pkl": b"\x80\x02}q\x00X\x01\x00\x00\x00a",
        "pop_empty.pkl": b"\x80\x020.",
        "mark_abuse.pkl": b"\x80\x02" + b"(" * 2000 + b"}.",
        "build_on_dict.pkl": b"\x80\x02}}b.",
        "inst_opcode.pkl": b"\x80\x02(ios\nsystem\nX\x02\x00\x00\x00ls.",
        "obj_opcode.pkl": b"\x80\x02(cos\nsystem\nX\x02\x00\x00\x00lso.",
        "newobj.pkl": b"\x80\x02ccollections\nOrderedDict\n)\x81.",
        "persid_text.pkl": b"\x80\x02}X\x01\x00\x00\x00wP0\nsu.",
    }
    for name, data in pk.items():
        put("torch_zip", name, data)


# ---- config.json ----

BERT_BASE = {
    "architectures": ["BertForSequenceClassification"], "attention_probs_dropout_prob": 0.1,
    "classifier_dropout": None, "gradient_checkpointing": False, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "hidden_size": 768, "id2label": {"0": "NEGATIVE", "1": "POSITIVE"},
    "initializer_range": 0.02, "intermediate_size": 3072, "label2id": {"NEGATIVE": 0, "POSITIVE": 1},
    "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert",
    "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 0,
    "position_embedding_type": "absolute", "problem_type": "single_label_classification",
    "torch_dtype": "float32", "transformers_version": "4.35.2", "type_vocab_size": 2,
    "use_cache": True, "vocab_size": 30522,
}


def gen_config():
    put("config_json", "bert_base.json", json.dumps(BERT_BASE, indent=2))
    tiny = dict(BERT_BASE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=37, vocab_size=99, hidden_act="gelu_new")
    put("config_json", "tiny.json", json.dumps(tiny))
    collab = dict(tiny, collaborative={"format_version": 1, "ranks": [8, 0], "source": "tiny",
                                       "algorithm": "cp-als", "errors": [0.1, 0.0]})
    put("config_json", "collaborative.json", json.dumps(collab))
    put("config_json", "multi_label.json", json.dumps(dict(tiny, problem_type="multi_label_classification",
                                                           id2label={str(i): f"L{i}" for i in range(5)})))
    put("config_json", "regression.json", json.dumps({"num_labels": 1, "problem_type": "regression"}))
    put("config_json", "minimal.json", "{}")
    nasty = {
        "not_json.json": "{\"vocab_size\": }",
        "array.json": "[1, 2]",
        "roberta.json": json.dumps({"model_type": "roberta"}),
        "decoder.json": json.dumps({"is_decoder": True}),
        "relative_pos.json": json.dumps({"position_embedding_type": "relative_key"}),
        "terabytes.json": json.dumps(dict(BERT_BASE, vocab_size=4194304, hidden_size=16384,
                                          num_attention_heads=16, intermediate_size=65536,
                                          num_hidden_layers=256)),
        "huge_int.json": "{\"hidden_size\": 18446744073709551615}",
        "negative.json": "{\"num_hidden_layers\": -1}",
        "float_size.json": "{\"hidden_size\": 768.5}",
        "heads_not_divisor.json": json.dumps({"hidden_size": 10, "num_attention_heads": 3}),
        "bad_id2label.json": json.dumps({"id2label": {"0": "a", "00": "b"}}),
        "id2label_gap.json": json.dumps({"id2label": {"0": "a", "2": "b"}}),
        "bad_eps.json": json.dumps({"layer_norm_eps": -1}),
        "bad_act.json": json.dumps({"hidden_act": ["gelu"]}),
        "ranks_mismatch.json": json.dumps({"num_hidden_layers": 2, "collaborative": {"ranks": [1]}}),
        "nested_act.json": "{\"hidden_act\": " + "[" * 300 + "]" * 300 + "}",
        "unicode_labels.json": json.dumps({"id2label": {"0": "négatif \u4e2d", "1": "\U0001F600"}}),
    }
    for name, text in nasty.items():
        put("config_json", name, text)


# ---- tokenizer_config.json ----

def gen_tokenizer_config():
    hf = {"clean_up_tokenization_spaces": True, "cls_token": "[CLS]", "do_basic_tokenize": True,
          "do_lower_case": True, "mask_token": "[MASK]", "model_max_length": 512, "never_split": None,
          "pad_token": "[PAD]", "sep_token": "[SEP]", "strip_accents": None,
          "tokenize_chinese_chars": True, "tokenizer_class": "BertTokenizer", "unk_token": "[UNK]"}
    put("tokenizer_config_json", "bert_base_uncased.json", json.dumps(hf, indent=2))
    added = lambda c: {"__type": "AddedToken", "content": c, "lstrip": False, "normalized": False,
                       "rstrip": False, "single_word": False}
    put("tokenizer_config_json", "added_tokens.json",
        json.dumps(dict(hf, unk_token=added("<unk>"), cls_token=added("<s>"), sep_token=added("</s>"),
                        pad_token=added("<pad>"), mask_token=added("<mask>"))))
    put("tokenizer_config_json", "no_limit.json", json.dumps(dict(hf, model_max_length=1e30, do_lower_case=False,
                                                                 strip_accents=True, split_special_tokens=True)))
    put("tokenizer_config_json", "empty.json", "{}")
    nasty = {
        "not_json.json": "{\"do_lower_case\": tru}",
        "not_object.json": "\"[CLS]\"",
        "wrong_type.json": json.dumps({"do_lower_case": "yes"}),
        "max_length_1.json": json.dumps({"model_max_length": 1}),
        "max_length_float.json": json.dumps({"model_max_length": 12.5}),
        "max_length_nan_like.json": "{\"model_max_length\": -1e400}",
        "unknown_token.json": json.dumps({"unk_token": "<nope>"}),
        "empty_token.json": json.dumps({"cls_token": ""}),
        "token_object_no_content.json": json.dumps({"sep_token": {"lstrip": True}}),
        "nested_value.json": "{\"do_lower_case\": " + "{\"a\":" * 300 + "1" + "}" * 300 + "}",
    }
    for name, text in nasty.items():
        put("tokenizer_config_json", name, text)


# ---- tokenizer input: flags, max_length, split, text (see tokenizer_fuzzer.cc) ----

def gen_tokenizer():
    texts = []
    with open(os.path.join(REPO, "tests/reference/tokenizer_corpus.jsonl"), encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i % 12 == 0:
                texts.append(json.loads(line)["text"].encode("utf-8"))
    texts += [
        "Héllo wörld, ÇA VA? naïve café".encode(), "中文字符和日本語のテキスト".encode(),
        "emoji 😀👍🏽 and ZWJ 👨‍👩‍👧".encode(), "a [SEP] b [CLS][MASK] [PAD][UNK]".encode(),
        b"x" * 300, ("supercalifragilistic" * 10).encode(), "\t\n\r\u00a0\u3000 spaces".encode(),
        "\u0300\u0301 combining only".encode(), "\x00\x01\x7f control".encode(),
        b"overlong \xc0\xaf", b"surrogate \xed\xa0\x80", b"truncated \xe2\x82", b"stray \x80\xbf",
        b"too big \xf4\x90\x80\x80", b"\xff\xfe bom-like", b"valid \xe2\x82\xac then \xf5",
    ]
    for i, text in enumerate(texts):
        flags = i % 16
        max_length = [0, 5, 16, 128, 2, 3][i % 6]
        put("tokenizer", f"text_{i:03d}", bytes([flags, max_length, (i * 37) % 256]) + text)


# ---- admin upload header (Admin.UploadModel's first message) ----

def upload_header(text, limit=3):
    """One seed for admin_upload_fuzzer: a byte picking --max_upload_bytes (3: 1 GiB, see the
    fuzzer's table), then the v1.UploadHeader written in protobuf text format, encoded by protoc."""
    out = subprocess.run(
        ["protoc", "--proto_path", os.path.join(REPO, "proto"), "--encode=collabserve.v1.UploadHeader",
         os.path.join(REPO, "proto", "collabserve", "v1", "admin.proto")],
        input=text.encode(), stdout=subprocess.PIPE, check=True).stdout
    return bytes([limit]) + out


def gen_admin_upload():
    sha = "0123456789abcdef" * 4
    def f(name, size=10, digest=sha):
        return f'files {{ name: "{name}" size: {size} sha256: "{digest}" }}\n'
    base = f("config.json", 600) + f("vocab.txt", 231508) + f("model.safetensors", 438000000)
    headers = {
        "valid_safetensors": 'model_name: "bert-sst2"\n' + base,
        "valid_bin_all_files": ('model_name: "m_1.v-2" version: 3 activate: true\n' + f("config.json")
                                + f("vocab.txt") + f("pytorch_model.bin") + f("tokenizer_config.json")
                                + f("special_tokens_map.json", 0)),
        "valid_compression": ('model_name: "m" compression { rank: 32 max_iters: 50 tol: 1e-5 } '
                              'min_agreement: 0.9 probes: "a probe"\n' + base),
        "valid_ratio": 'model_name: "m" compression { ratio: 2.5 }\n' + base,
        "valid_ranks": 'model_name: "m" compression { ranks { ranks: [0, 8, 16] } }\n' + base,
        "valid_max_error": 'model_name: "m" compression { max_error: 0.05 seed: 7 }\n' + base,
        "empty_name": 'model_name: ""\n' + base,
        "dot_name": 'model_name: ".hidden"\n' + base,
        "slash_name": 'model_name: "a/b"\n' + base,
        "long_name": f'model_name: "{"x" * 256}"\n' + base,
        "zero_version": 'model_name: "m" version: 0\n' + base,
        "negative_version": 'model_name: "m" version: -5\n' + base,
        "path_traversal": 'model_name: "m"\n' + base + f("../config.json"),
        "path_separator": 'model_name: "m"\n' + base + f("sub/vocab.txt"),
        "backslash": 'model_name: "m"\n' + base + f("sub\\\\vocab.txt"),
        "nul_in_name": 'model_name: "m"\n' + base + f("vocab.txt\\000x"),
        "unknown_file": 'model_name: "m"\n' + base + f("run.sh"),
        "duplicate_file": 'model_name: "m"\n' + base + f("vocab.txt"),
        "negative_size": 'model_name: "m"\n' + f("config.json", -1) + f("vocab.txt") + f("model.safetensors"),
        "huge_sizes": ('model_name: "m"\n' + f("config.json", 2**62) + f("vocab.txt", 2**62)
                       + f("model.safetensors", 2**63 - 1)),
        "over_limit": 'model_name: "m"\n' + f("config.json", 2**30) + f("vocab.txt", 1) + f("model.safetensors"),
        "short_sha": 'model_name: "m"\n' + f("config.json", 1, "abc") + f("vocab.txt") + f("model.safetensors"),
        "non_hex_sha": 'model_name: "m"\n' + f("config.json", 1, "g" * 64) + f("vocab.txt") + f("model.safetensors"),
        "upper_hex_sha": 'model_name: "m"\n' + f("config.json", 1, "ABCDEF0123456789" * 4) + f("vocab.txt") + f("model.safetensors"),
        "no_vocab": 'model_name: "m"\n' + f("config.json") + f("model.safetensors"),
        "no_config": 'model_name: "m"\n' + f("vocab.txt") + f("model.safetensors"),
        "no_weights": 'model_name: "m"\n' + f("config.json") + f("vocab.txt"),
        "two_weights": 'model_name: "m"\n' + base + f("pytorch_model.bin"),
        "no_files": 'model_name: "m"\n',
        "bad_compression": 'model_name: "m" compression { rank: -1 max_iters: -3 tol: -1 } min_agreement: 2\n' + base,
        "nan_agreement": 'model_name: "m" min_agreement: nan compression { ratio: nan }\n' + base,
    }
    for name, text in headers.items():
        put("admin_upload", name, upload_header(text))
    # The same valid header under the other limits of the fuzzer's table (0, 1, 1 MiB, max, -1,
    # min, 4 KiB).
    for limit in (0, 1, 2, 4, 5, 6, 7):
        put("admin_upload", f"valid_limit_{limit}", upload_header(headers["valid_bin_all_files"], limit))
    put("admin_upload", "not_a_proto", b"\x03\xff\xff\xff\xff")


GENERATORS = {"safetensors": lambda: gen_safetensors(), "torch_zip": lambda: gen_torch_zip(),
              "config_json": lambda: gen_config(), "tokenizer_config_json": lambda: gen_tokenizer_config(),
              "tokenizer": lambda: gen_tokenizer(), "admin_upload": gen_admin_upload}


if __name__ == "__main__":
    # No argument: every corpus; otherwise only the named ones (e.g. admin_upload).
    names = sys.argv[1:] or list(GENERATORS)
    for n in names:
        shutil.rmtree(os.path.join(OUT, n), ignore_errors=True)
        GENERATORS[n]()
    for t in sorted(os.listdir(OUT)):
        files = os.listdir(os.path.join(OUT, t))
        print(f"{t}: {len(files)} files, {sum(os.path.getsize(os.path.join(OUT, t, f)) for f in files)} bytes")
