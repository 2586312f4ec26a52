#!/usr/bin/python3
"""The demo model's training pipeline (scripts/demo_model/) on a tiny corpus, in seconds:

- the data: control-file parsing, description cleaning, the application filter, deduplication, and
  a split that never puts one source package in two splits (nor a held-out text in the corpus);
- the tokenization it trains with is the service's tokenizer: on the committed test split it equals
  Hugging Face's tokenizers (tests/reference/hf_tokenize.js) at the model's max length;
- the whole pipeline (--quick, on made-up records) writes a checkpoint that the C++ engine loads
  and evaluates to the training module's own logits (1e-4);
- the committed artefacts agree with each other: no test text is in the calibration file, labels
  are the checkpoint's id2label.

usage: pipeline_test.py --model-tool build/bin/collabserve-model
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "scripts", "demo_model"))
import debian_data  # noqa: E402

MODEL_TOOL = None
DEMO = os.path.join(ROOT, "server", "model", "demo")
DATA = os.path.join(ROOT, "tests", "data", "demo")

PACKAGES = """Package: foo-game
Source: foo
Section: games
Description-md5: 11111111111111111111111111111111
Description: a maze game

Package: libfoo1
Source: foo
Section: libs
Description-md5: 22222222222222222222222222222222
Description: library for foo

Package: foo-dev
Source: foo
Section: games
Description-md5: 33333333333333333333333333333333
Description: development files for foo

Package: bar
Section: sound
Description-md5: 44444444444444444444444444444444
Description: audio player

Package: bar-extra
Source: bar (1.2-3)
Section: contrib/sound
Description-md5: 44444444444444444444444444444444
Description: audio player
"""

TRANSLATIONS = """Package: foo-game
Description-md5: 11111111111111111111111111111111
Description-en: a maze game
 Find your way out of
 a twisty maze.
 .
 Multiplayer over the network.

Package: bar
Description-md5: 44444444444444444444444444444444
Description-en: audio player
 Plays music files.

Package: bar-extra
Description-md5: 44444444444444444444444444444444
Description-en: audio player
 Plays music files.
"""


def records(n_sources=300):
    """Made-up application packages: several binaries per source, shared descriptions, labels."""
    words = {"games": "game play level player puzzle arcade", "sound": "audio music sound player mixer",
             "net": "network server protocol client socket", "text": "text editor document format"}
    out = []
    for s in range(n_sources):
        label = sorted(words)[s % len(words)]
        src = f"src{s}"
        w = words[label].split()
        text = f"{w[s % len(w)]} tool number {s}. It handles {w[(s + 1) % len(w)]} and {w[(s + 2) % len(w)]} well."
        out.append({"name": f"{src}-bin", "source": src, "section": label, "text": text})
        out.append({"name": f"{src}-utils", "source": src, "section": label, "text": text})  # same text
        out.append({"name": f"lib{src}", "source": src, "section": "libs", "text": f"library {s}"})
    return out


class DataTest(unittest.TestCase):
    def test_parse_join_and_clean(self):
        P = debian_data.parse_deb822(PACKAGES)
        T = debian_data.parse_deb822(TRANSLATIONS)
        self.assertEqual(len(P), 5)
        recs = {r["name"]: r for r in debian_data.join_descriptions(P, T)}
        self.assertEqual(recs["foo-game"]["text"],
                         "a maze game. Find your way out of a twisty maze. Multiplayer over the network.")
        self.assertEqual(recs["foo-game"]["source"], "foo")
        self.assertEqual(recs["bar-extra"]["source"], "bar")       # "bar (1.2-3)"
        self.assertEqual(recs["bar-extra"]["section"], "sound")    # "contrib/sound"
        self.assertEqual(recs["libfoo1"]["text"], "library for foo")  # no translation: summary
        _, splits = debian_data.build_dataset(list(recs.values()))
        labelled = [e for v in splits.values() for e in v]
        names = sorted(e["name"] for e in labelled)
        # foo-dev and libfoo1 are left out; bar and bar-extra share one text: one example.
        self.assertEqual(names, ["bar", "foo-game"])

    def test_split_is_by_source_and_held_out_texts_stay_out_of_the_corpus(self):
        recs = records()
        corpus, splits = debian_data.build_dataset(recs)
        seen = {}
        for split, examples in splits.items():
            for e in examples:
                self.assertEqual(seen.setdefault(e["source"], split), split, e["source"])
        self.assertGreater(len(splits["test"]), 10)
        self.assertGreater(len(splits["validation"]), 10)
        texts = [e["text"] for v in splits.values() for e in v]
        self.assertEqual(len(texts), len(set(texts)))  # deduplicated
        held_out = {e["text"] for s in ("validation", "test") for e in splits[s]}
        self.assertFalse(held_out & set(corpus))
        self.assertTrue({e["text"] for e in splits["train"]} <= set(corpus))
        self.assertTrue(all(not e["name"].startswith("lib") for v in splits.values() for e in v))

    def test_a_text_under_two_labels_is_dropped(self):
        recs = [{"name": "a", "source": "a", "section": "games", "text": "Same text"},
                {"name": "b", "source": "b", "section": "sound", "text": "same TEXT"},
                {"name": "c", "source": "c", "section": "sound", "text": "other"}]
        _, splits = debian_data.build_dataset(recs)
        self.assertEqual([e["name"] for v in splits.values() for e in v], ["c"])

    def test_committed_artefacts_agree(self):
        with open(os.path.join(DEMO, "config.json")) as f:
            cfg = json.load(f)
        labels = [cfg["id2label"][str(i)] for i in range(len(cfg["id2label"]))]
        self.assertEqual(labels, debian_data.LABELS)
        with open(os.path.join(DATA, "test.jsonl")) as f:
            test = [json.loads(line) for line in f]
        with open(os.path.join(DATA, "calibration.txt")) as f:
            calib = set(line.rstrip("\n") for line in f)
        self.assertGreater(len(test), 100)
        self.assertTrue(all(e["label"] in labels for e in test))
        self.assertFalse({e["text"] for e in test} & calib)
        self.assertTrue(all(debian_data.split_of(e["source"]) == "test" for e in test))


class TokenizationTest(unittest.TestCase):
    def test_training_ids_equal_hugging_face_on_the_test_split(self):
        sys.path.insert(0, os.path.join(ROOT, "scripts", "demo_model"))
        import train_demo
        with open(os.path.join(DATA, "test.jsonl")) as f:
            texts = [json.loads(line)["text"] for line in f]
        L = train_demo.CONFIG["max_position_embeddings"]
        ours = train_demo.tokenize(MODEL_TOOL, DEMO, texts, L)
        payload = "".join(json.dumps({"text": t, "max_length": L}) + "\n" for t in texts)
        r = subprocess.run(["node", os.path.join(ROOT, "tests", "reference", "hf_tokenize.js"),
                            "--vocab", os.path.join(DEMO, "vocab.txt"), "--lowercase", "1"],
                           input=payload.encode(), capture_output=True, check=True)
        hf = [json.loads(line)["ids"] for line in r.stdout.decode().splitlines()]
        self.assertEqual(len(hf), len(texts))
        for t, a, b in zip(texts, ours, hf):
            self.assertEqual(a, b, t)
        self.assertTrue(any(len(a) == L for a in ours))  # truncation was exercised


class QuickPipelineTest(unittest.TestCase):
    def test_quick_run_writes_a_checkpoint_the_engine_evaluates_alike(self):
        import torch
        import bert_train
        import train_demo
        with tempfile.TemporaryDirectory() as tmp:
            rec_path = os.path.join(tmp, "records.jsonl")
            with open(rec_path, "w") as f:
                for r in records():
                    f.write(json.dumps(r) + "\n")
            model_dir, data_dir = os.path.join(tmp, "model"), os.path.join(tmp, "data")
            r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "demo_model", "train_demo.py"),
                                "--tokenizer_bin", MODEL_TOOL, "--model_out", model_dir, "--data_out", data_dir,
                                "--work", os.path.join(tmp, "work"), "--records", rec_path, "--quick",
                                "--threads", "1"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn("ETA", r.stdout)
            for name in ("config.json", "vocab.txt", "tokenizer_config.json", "model.safetensors"):
                self.assertTrue(os.path.exists(os.path.join(model_dir, name)), name)
            with open(os.path.join(data_dir, "training.json")) as f:
                report = json.load(f)
            self.assertIn("uniform_attention_agreement", report["test"])
            # The engine's logits for the test texts equal the training module's on the same
            # (float16) weights.
            with open(os.path.join(data_dir, "test.jsonl")) as f:
                texts = [json.loads(line)["text"] for line in f][:8]
            out = subprocess.run([MODEL_TOOL, "predict", "--model", model_dir],
                                 input="".join(json.dumps({"text": t}) + "\n" for t in texts),
                                 capture_output=True, text=True, check=True).stdout
            engine = torch.tensor([json.loads(line)["logits"] for line in out.splitlines()])
            sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
            import bert_reference
            weights = bert_reference.Reference(model_dir).w
            m = bert_train.BertForSequenceClassification(train_demo.CONFIG, len(debian_data.LABELS))
            m.load_state_dict({k: torch.as_tensor(v).float() for k, v in weights.items()})
            ids = train_demo.tokenize(MODEL_TOOL, model_dir, texts, 128)
            ref = train_demo.predict(m, ids)
            self.assertLess((engine - ref).abs().max().item(), 1e-4)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-tool", required=True)
    a, rest = ap.parse_known_args()
    MODEL_TOOL = os.path.abspath(a.model_tool)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
