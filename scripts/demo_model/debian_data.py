"""The demo model's data: Debian's package descriptions, joined with their long English texts.

Each binary package record of the archive's `Packages` index has a one-line summary, a `Section`
chosen by its maintainers and a `Description-md5`; the long description is in the `Translation-en`
index under the same name and md5. This module fetches both into a private apt lists directory
(the system's apt state is left as it is), joins them, and builds:

- the pretraining corpus: every distinct description (summary + long text), minus the texts of the
  validation and test splits, so the model never reads a held-out text, even without its label;
- the task: the section of application packages (LABELS), with packages that are not about what
  software does left out (-dev, -doc, -dbg, -data, -common, lib*), texts deduplicated, and the split
  made by source package (a hash of the source name), so no source is in two splits.

Python standard library only; run with any python3.
"""
import glob
import gzip
import hashlib
import lzma
import os
import re
import subprocess

# The task's labels, in id order (config.json's id2label).
LABELS = ["games", "sound", "graphics", "science", "math", "net", "mail", "editors", "database",
          "web", "video", "text", "admin", "electronics"]

EXCLUDED_SUFFIXES = ("-dev", "-doc", "-dbg", "-data", "-common")
EXCLUDED_PREFIXES = ("lib",)

# Split by source: sha1(source) % 100 below TRAIN_PERCENT is train, below TRAIN+VALID is validation.
TRAIN_PERCENT = 80
VALID_PERCENT = 10


def fetch_lists(lists_dir, log=print):
    """apt-get update with English translations into `lists_dir` (a private directory). Returns the
    (Packages files, Translation-en files) found there. Raises RuntimeError naming what is missing."""
    os.makedirs(os.path.join(lists_dir, "partial"), exist_ok=True)
    cmd = ["apt-get", "update", "-qq", "-o", "Acquire::Languages=en",
           "-o", f"Dir::State::Lists={os.path.abspath(lists_dir)}",
           "-o", "Acquire::GzipIndexes=false"]
    log("data: " + " ".join(cmd))
    subprocess.run(cmd, check=True)
    return find_lists(lists_dir)


def find_lists(lists_dir):
    packages = sorted(f for f in glob.glob(os.path.join(lists_dir, "*_binary-*_Packages*"))
                      if not f.endswith(".diff_Index"))
    translations = sorted(glob.glob(os.path.join(lists_dir, "*_i18n_Translation-en*")))
    if not packages:
        raise RuntimeError(f"no Packages index in {lists_dir}")
    if not translations:
        raise RuntimeError(f"no Translation-en index in {lists_dir}: apt fetched no English "
                           "descriptions (Acquire::Languages)")
    return packages, translations


def read_text(path):
    if path.endswith(".gz"):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    if path.endswith(".xz"):
        with lzma.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    if path.endswith(".lz4"):
        return subprocess.run(["lz4cat", path], check=True, capture_output=True).stdout.decode()
    with open(path, encoding="utf-8") as f:
        return f.read()


def parse_deb822(text):
    """Records of a Debian control-style file: a list of dicts, continuation lines joined with '\n'."""
    records = []
    for block in text.split("\n\n"):
        rec, key = {}, None
        for line in block.split("\n"):
            if not line:
                continue
            if line[0] in " \t":
                if key is not None:
                    rec[key] += "\n" + line
                continue
            key, _, value = line.partition(":")
            rec[key] = value.strip()
        if rec:
            records.append(rec)
    return records


def clean_description(desc):
    """A Description / Description-en field as one line of text: the summary, then the long
    description's paragraphs (' .' lines separate them), whitespace collapsed."""
    lines = desc.split("\n")
    summary = lines[0].strip()
    body = []
    for line in lines[1:]:
        s = line.strip()
        body.append("" if s == "." else s)
    long_text = " ".join(p for p in body if p)
    text = summary
    if long_text:
        text += (" " if summary.endswith((".", ":", "!", "?")) else ". ") + long_text
    return re.sub(r"\s+", " ", text).strip()


def source_name(pkg):
    src = pkg.get("Source", pkg["Package"]).split(" ")[0]
    return src.strip()


def split_of(source):
    h = int(hashlib.sha1(source.encode()).hexdigest(), 16) % 100
    if h < TRAIN_PERCENT:
        return "train"
    if h < TRAIN_PERCENT + VALID_PERCENT:
        return "validation"
    return "test"


def is_application(name):
    return not (name.endswith(EXCLUDED_SUFFIXES) or name.startswith(EXCLUDED_PREFIXES))


def join_descriptions(packages, translations):
    """One record per binary package name: {name, source, section, text}. The long text comes from
    the translation with the same name and Description-md5; without one the summary alone."""
    long_desc = {}
    for t in translations:
        if "Package" in t and "Description-en" in t:
            long_desc[(t["Package"], t.get("Description-md5", ""))] = t["Description-en"]
    out, seen = [], set()
    for p in packages:
        name = p.get("Package")
        if not name or name in seen or "Description" not in p and "Description-md5" not in p:
            continue
        seen.add(name)
        desc = long_desc.get((name, p.get("Description-md5", "")), p.get("Description", ""))
        text = clean_description(desc)
        if not text:
            continue
        section = p.get("Section", "").split("/")[-1]
        out.append({"name": name, "source": source_name(p), "section": section, "text": text})
    return out


def build_dataset(records, labels=LABELS):
    """(corpus texts, {split: [{"text", "label", "source", "name"}]}) from join_descriptions' records.

    Labelled texts are deduplicated: a text seen under two labels is dropped, a text seen in several
    sources keeps the first source in sorted order, so one text is in one split only."""
    label_set = set(labels)
    by_text = {}
    for r in sorted(records, key=lambda r: (r["source"], r["name"])):
        if r["section"] not in label_set or not is_application(r["name"]):
            continue
        key = r["text"].lower()
        prev = by_text.get(key)
        if prev is None:
            by_text[key] = dict(r)
        elif prev["section"] != r["section"]:
            prev["conflict"] = True
    splits = {"train": [], "validation": [], "test": []}
    for r in sorted(by_text.values(), key=lambda r: (r["source"], r["name"])):
        if r.get("conflict"):
            continue
        splits[split_of(r["source"])].append(
            {"text": r["text"], "label": r["section"], "source": r["source"], "name": r["name"]})
    held_out = {e["text"].lower() for s in ("validation", "test") for e in splits[s]}
    corpus, seen = [], set()
    for r in sorted(records, key=lambda r: r["name"]):
        key = r["text"].lower()
        if key in seen or key in held_out:
            continue
        seen.add(key)
        corpus.append(r["text"])
    return corpus, splits


def load(lists_dir, fetch=True, log=print):
    packages, translations = fetch_lists(lists_dir, log) if fetch else find_lists(lists_dir)
    P = [r for f in packages for r in parse_deb822(read_text(f))]
    T = [r for f in translations for r in parse_deb822(read_text(f))]
    log(f"data: {len(P)} package records, {len(T)} English descriptions")
    return join_descriptions(P, T)
