#!/usr/bin/python3
"""Fixtures and cross-checks for server/model/io (run with /usr/bin/python3, which has torch).

  make_torch_checkpoints.py generate OUTDIR
      Writes the tiny torch.save files tests/data/model_io/ holds (committed; rerun to refresh):
        hf_style.bin  an OrderedDict with a _metadata attribute, as Hugging Face save_pretrained
                      saves it, with every dtype, two tensors viewing one storage, a transposed
                      (non-contiguous) tensor, a 0-dim tensor and an empty tensor.
        nested.bin    {"state_dict": OrderedDict(...)}, as training loops often save.
        zip64.bin     hf_style.bin's entries re-zipped by Python's zipfile with ZIP64 local headers.
        legacy.bin    the pre-1.6 (non-zip) torch.save format, which the reader refuses.
        hostile.bin   a real torch.save zip whose data.pkl calls os.system through __reduce__
                      (pickled here, NEVER loaded: the reader must refuse it).
      Values are the formulas in tests/model_io/torch_zip_test.cc; keep the two in step.

  make_torch_checkpoints.py check-ours FILE...
      torch.load()s each FILE written by our WriteTorchZip (also with weights_only=True where this
      torch has it) and checks it against the formula of ExpectedOurs(); exits 1 on any difference.
"""
import collections
import os
import sys
import zipfile

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def formula(numel, dtype_name):
    """Element k of every tensor our C++ test writes (same formula as FillFormula in the test)."""
    k = torch.arange(numel, dtype=torch.float64)
    if dtype_name in ("F64", "F32", "F16", "BF16"):
        return ((k - 3) * 0.25).to(DTYPES[dtype_name])
    if dtype_name == "U8":
        return (k.to(torch.int64) % 256).to(torch.uint8)
    if dtype_name == "BOOL":
        return (k.to(torch.int64) % 3) == 0
    return (k.to(torch.int64) - 3).to(DTYPES[dtype_name])


def hf_style_state_dict():
    sd = collections.OrderedDict()
    sd["bert.embeddings.word_embeddings.weight"] = torch.arange(12, dtype=torch.float32).reshape(3, 4) * 0.5
    sd["f64"] = torch.arange(5, dtype=torch.float64) / 4
    sd["f16"] = torch.arange(6, dtype=torch.float16).reshape(2, 3) - 2
    sd["bf16"] = torch.arange(4, dtype=torch.bfloat16) * 2
    sd["i64"] = (torch.arange(-3, 3, dtype=torch.int64)) * 1000000000000
    sd["i32"] = torch.arange(-4, 4, dtype=torch.int32) * 100000
    sd["i16"] = torch.arange(-4, 4, dtype=torch.int16) * 1000
    sd["i8"] = torch.arange(-4, 4, dtype=torch.int8)
    sd["u8"] = torch.arange(250, 256, dtype=torch.uint8)
    sd["bool"] = torch.tensor([True, False, True])
    base = torch.arange(10, dtype=torch.float32)
    sd["shared.a"] = base[2:6]          # offset 2 into a 10-element storage
    sd["shared.b"] = base.view(2, 5)    # the same storage, whole
    sd["transposed"] = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # strides (1, 3)
    sd["scalar"] = torch.tensor(3.5)
    sd["empty"] = torch.zeros(0, 3)
    metadata = collections.OrderedDict()
    metadata[""] = {"version": 1}
    metadata["bert"] = {"version": 1}
    metadata["bert.embeddings"] = {"version": 1}
    metadata["bert.embeddings.word_embeddings"] = {"version": 1}
    sd._metadata = metadata
    return sd


class _RunsAShellCommand:
    """Pickles as os.system("echo pwned"): the classic malicious checkpoint. Never unpickle it."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def generate(outdir):
    os.makedirs(outdir, exist_ok=True)
    torch.save(hf_style_state_dict(), os.path.join(outdir, "hf_style.bin"))
    nested = collections.OrderedDict(a=torch.arange(3, dtype=torch.float32))
    torch.save({"state_dict": nested}, os.path.join(outdir, "nested.bin"))
    with zipfile.ZipFile(os.path.join(outdir, "hf_style.bin")) as src, \
            zipfile.ZipFile(os.path.join(outdir, "zip64.bin"), "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            with dst.open(info.filename, "w", force_zip64=True) as f:
                f.write(src.read(info.filename))
    evil = collections.OrderedDict(w=torch.ones(2))
    evil["payload"] = _RunsAShellCommand()
    torch.save(evil, os.path.join(outdir, "hostile.bin"))
    torch.save(collections.OrderedDict(a=torch.ones(2)), os.path.join(outdir, "legacy.bin"),
               _use_new_zipfile_serialization=False)


def check_ours(paths):
    bad = 0
    for path in paths:
        loads = [("torch.load", lambda: torch.load(path))]
        try:
            torch.load(path, weights_only=True)
            loads.append(("torch.load(weights_only=True)", lambda: torch.load(path, weights_only=True)))
        except TypeError:
            pass  # this torch has no weights_only
        for how, load in loads:
            sd = load()
            if type(sd) is not collections.OrderedDict:
                print(f"{path}: {how}: got {type(sd).__name__}, not OrderedDict"); bad += 1; continue
            meta = getattr(sd, "_metadata", None)
            if meta is None or meta.get("") != {"version": 1}:
                print(f"{path}: {how}: _metadata missing or wrong: {meta!r}"); bad += 1
            for name, t in sd.items():
                dtype_name = name.rsplit(".", 1)[-1]
                if dtype_name not in DTYPES:
                    print(f"{path}: unexpected tensor {name}"); bad += 1; continue
                if t.dtype != DTYPES[dtype_name]:
                    print(f"{path}: {name}: dtype {t.dtype}"); bad += 1; continue
                want = formula(t.numel(), dtype_name).reshape(t.shape)
                if not torch.equal(t, want):
                    print(f"{path}: {how}: {name}: values differ:\n{t}\nwant\n{want}"); bad += 1
            print(f"{path}: {how}: {len(sd)} tensors checked")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "generate":
        generate(sys.argv[2])
    elif len(sys.argv) >= 3 and sys.argv[1] == "check-ours":
        sys.exit(check_ours(sys.argv[2:]))
    else:
        print(__doc__)
        sys.exit(2)
