"""Text classification as transformers' run_glue.py does it (`--dataset text_classification`,
mixprec/data/class_labels.py, mixprec/models/hf.py's hf_classifier): class names mapped to numbers (sorted), the
head's size from the data or --num_labels (a checkpoint's head of another size replaced, said), decoder-only
classifiers (the pad token id in the config; a tokenizer without one pads with EOS), --validation_file, and the
export's label2id/id2label and from_pretrained round trip. Tiny models from scripts/make_tiny_hf.py
(tests/test_hf_models.py's `tiny` fixture), nothing downloaded."""
from __future__ import annotations

import csv
import json
import random

import pytest
import torch
import yaml

from helpers import assert_one_line_error, run_in_process, snapshot
from test_hf_models import offline, parsed, tiny  # noqa: F401 (fixtures)

NAMES = ("pos", "neutral", "neg")  # sorted: neg 0, neutral 1, pos 2
KEYWORDS = {"pos": "urgent", "neutral": "meeting", "neg": None}
WORDS = "the report is ready for review today please check the numbers".split()


def rows(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """A three-class keyword task with class names: 'pos' rows hold "urgent", 'neutral' rows "meeting"."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        name, words = NAMES[i % 3], rng.choices(WORDS, k=rng.randint(4, 9))
        if KEYWORDS[name]:
            words.insert(rng.randrange(len(words) + 1), KEYWORDS[name])
        out.append((" ".join(words), name))
    return out


def write_csv(path, table) -> str:
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([("text", "label"), *table])
    return str(path)


def args_for(model, train, *extra):
    return ["--model_name_or_path", model, "--dataset", "text_classification", "--train_file", train,
            "--block_size", 16, *extra]


def llama_with_pad(tmp, tiny):
    """The tiny Llama with a tokenizer that has a pad token (its EOS) and a config without one: a classifier's
    batches used to fail inside transformers ('Cannot handle batch sizes > 1 if no padding token is defined')."""
    import shutil

    from transformers import AutoTokenizer

    folder = tmp / "llama_pad"
    shutil.copytree(tiny["llama_bf16"]["model"], folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.pad_token = tok.eos_token
    tok.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text()).get("pad_token_id") is None
    return folder


def test_class_names_are_sorted_and_numbered_as_run_glue_does(tiny, offline, tmp_path):
    from mixprec import data, models

    train = write_csv(tmp_path / "words.csv", rows(30))
    bundle = data.build(parsed(args_for(tiny["bert"]["model"], train, "--output_dir", tmp_path / "run")))
    assert bundle.info["label_names"] == ["neg", "neutral", "pos"] and bundle.info["num_classes"] == 3
    texts = [name for _, name in rows(30)]
    labels = [int(y) for part in (bundle.train, bundle.validation) for y in part["labels"]]
    assert labels == [sorted(NAMES).index(name) for name in texts]
    assert bundle.info["validation_from"] == "the last 20% of --train_file's rows"
    model = models.build("hf_classifier", bundle.info, parsed(args_for(tiny["bert"]["model"], train)).model_args)
    assert model.hf.config.id2label == {0: "neg", 1: "neutral", 2: "pos"}
    assert model.hf.config.label2id == {"neg": 0, "neutral": 1, "pos": 2}
    assert model.hf.classifier.out_features == 3  # the checkpoint's 2-class head replaced, and said
    assert model.weights()["head"] == "replaced: the checkpoint's has 2 outputs, this run 3"
    assert "classifier.bias, classifier.weight (replaced: the checkpoint's has 2 outputs, this run 3)" in \
        model.describe()


def test_a_llama_whose_tokenizer_pads_and_config_does_not_classifies_batches(tiny, offline, tmp_path):
    from mixprec import data, models

    folder = llama_with_pad(tmp_path, tiny)
    cfg = parsed(args_for(folder, write_csv(tmp_path / "words.csv", rows(30))))
    bundle = data.build(cfg)
    model = models.build(cfg.model, bundle.info, cfg.model_args)
    assert model.hf.config.pad_token_id == bundle.info["pad_token_id"] == 0
    logits = model(bundle.train[:4]["inputs"])
    assert logits.shape == (4, 3) and "pad_from_eos" not in bundle.info


@pytest.mark.parametrize("extra, names, words", [
    ([], 3, None),  # inferred: the classes found
    (["--num_labels", 5], 5, None),  # given: larger heads are fine (LABEL_3, LABEL_4 unused)
    (["--num_labels", 2], None, ["--num_labels 2 is fewer than the 3 classes", "'neg', 'neutral', 'pos'",
                                 "--num_labels 3 or more"]),
    (["--num_labels", 1], None, ["--num_labels 1", "regression head", "give 2 or more"]),
])
def test_num_labels_inferred_or_given(extra, names, words, tiny, offline, tmp_path):
    from mixprec import data
    from mixprec.errors import UsageError

    args = args_for(tiny["bert"]["model"], write_csv(tmp_path / "words.csv", rows(30)), *extra)
    if words is not None:
        with pytest.raises(UsageError) as refused:
            data.build(parsed(args))
        assert all(word in str(refused.value) for word in words), str(refused.value)
        return
    info = data.build(parsed(args)).info
    assert info["num_classes"] == names
    assert list(info["id2label"].values()) == ["neg", "neutral", "pos", *(f"LABEL_{i}" for i in range(3, names))]


def test_num_labels_with_another_dataset_is_one_line(tmp_path, capsys):
    run = run_in_process(["--num_labels", 3, "--max_steps", 1, "--output_dir", tmp_path / "run"], capsys)
    assert_one_line_error(run, "--num_labels 3", "--dataset text_classification", "not of --dataset synthetic")
    assert not (tmp_path / "run").exists()


def test_a_validation_file_gives_the_validation_rows(tiny, offline, tmp_path):
    from mixprec import data
    from mixprec.training.prepared import validation_line

    train, valid = write_csv(tmp_path / "t.csv", rows(30)), write_csv(tmp_path / "v.csv", rows(7, seed=1))
    bundle = data.build(parsed(args_for(tiny["bert"]["model"], train, "--validation_file", valid)))
    assert (len(bundle.train), len(bundle.validation)) == (30, 7)
    assert [int(y) for y in bundle.validation["labels"]] == [sorted(NAMES).index(n) for _, n in rows(7, seed=1)]
    assert validation_line(bundle).startswith(f"--validation_file '{valid}': 7 rows, ")


VALIDATION_BAD = {  # name: (validation file's content, words of the one line)
    "a name no training row has": ("text,label\na b,pos\nc d,sarcastic\n",
                                   ["--validation_file", "the label 'sarcastic' (first on line 3)",
                                    "not among the training rows' labels ('neg', 'neutral', 'pos')"]),
    "a row without a label": ("text,label\na b,pos\nc d,\n", ["--validation_file", "column 'label' is empty on line 3"]),
    "numbers where training has names": ("text,label\na b,0\nc d,1\n",
                                         ["--validation_file", "holds class numbers", "class names"]),
    "a row with a field more": ("text,label\na b,pos,x\n", ["--validation_file", "line 2 has 3 fields"]),
}


@pytest.mark.parametrize("name", sorted(VALIDATION_BAD))
def test_a_bad_validation_file_is_one_line_naming_it(name, tiny, offline, tmp_path, capsys):
    content, words = VALIDATION_BAD[name]
    (tmp_path / "v.csv").write_text(content)
    train = write_csv(tmp_path / "t.csv", rows(30))
    before = snapshot(tmp_path)
    run = run_in_process([*args_for(tiny["bert"]["model"], train, "--validation_file", tmp_path / "v.csv"),
                          "--max_steps", 1, "--output_dir", tmp_path / "run"], capsys)
    assert_one_line_error(run, f"'{tmp_path / 'v.csv'}'", *words)
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()


def test_a_validation_name_only_in_the_last_rows_is_one_line(tiny, offline, tmp_path):
    from mixprec import data
    from mixprec.errors import UsageError

    train = write_csv(tmp_path / "t.csv", rows(30) + [("x y", "sarcastic")])
    with pytest.raises(UsageError, match=r"the label 'sarcastic' \(row 6 of the validation rows, the last 20% of "
                                         r"--train_file's rows\) is not among the training rows' labels"):
        data.build(parsed(args_for(tiny["bert"]["model"], train)))


def trained_and_exported_logits(args, run, texts):
    """The run's trained model (model.safetensors in the model the recipe builds) on the run's validation rows,
    and its export loaded with AutoModelForSequenceClassification on the same texts tokenized by the export's
    tokenizer, padded to the longest (not to the block): (logits, logits, the export's config)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from mixprec import data, models
    from mixprec.run_folder.run_loading import load_weights

    cfg = parsed(args)
    bundle = data.build(cfg)
    model = models.build(cfg.model, bundle.info, cfg.model_args)
    load_weights(model, run / "model.safetensors", cfg)
    export = AutoModelForSequenceClassification.from_pretrained(run / "hf_model").eval()
    tok = AutoTokenizer.from_pretrained(run / "hf_model")
    enc = tok(texts, padding=True, truncation=True, max_length=16, return_tensors="pt")
    with torch.no_grad():
        return model.eval()(bundle.validation[:len(texts)]["inputs"]), export(**enc).logits, export.config


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_class_names_end_to_end_and_the_export_classifies_the_same(arch, tiny, offline, tmp_path, capsys):
    """A BERT whose 2-class head is replaced by a 3-class one, and a Llama (a causal LM checkpoint: a new head,
    a tokenizer without a pad token: EOS pads), trained on class names with a --validation_file; the export's
    config.json maps the names, and from_pretrained gives the trained model's logits."""
    model = tiny["bert"]["model"] if arch == "bert" else tiny["llama_bf16"]["model"]
    valid_rows = rows(12, seed=1)
    train, valid = write_csv(tmp_path / "t.csv", rows(60)), write_csv(tmp_path / "v.csv", valid_rows)
    args = args_for(model, train, "--validation_file", valid)
    run = run_in_process([*args, "--batch_size", 8, "--max_steps", 6, "--eval_steps", 6, "--lr", 3e-3,
                          "--mixed_precision", "no", "--save_dtype", "fp32", "--output_dir", tmp_path / "run"], capsys)
    assert run.returncode == 0, run.stderr[-3000:]
    banner = run.stdout
    assert "3 classes (neg, neutral, pos: class names, sorted)" in banner
    assert f"validation     --validation_file '{valid}': 12 rows, " in banner
    head = {"bert": "new head classifier.bias, classifier.weight (replaced: the checkpoint's has 2 outputs, this run 3)",
            "llama": "new head score.weight (not in the checkpoint)"}[arch]
    assert head in banner
    assert ("its EOS '<|endoftext|>' pads (id 0)" in banner) == (arch == "llama")
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["effective"]["hf_weights"]
    assert recorded["id2label"] == {0: "neg", 1: "neutral", 2: "pos"} and recorded["num_labels"] == 3
    trained, exported, config = trained_and_exported_logits(args, tmp_path / "run", [t for t, _ in valid_rows[:5]])
    assert config.label2id == {"neg": 0, "neutral": 1, "pos": 2} and config.pad_token_id == 0
    assert torch.allclose(trained, exported, atol=1e-5), (trained - exported).abs().max()


@pytest.mark.slow
def test_a_resume_keeps_the_mapping_and_a_changed_file_is_refused(tiny, offline, tmp_path, capsys):
    """The mapping comes from --train_file's rows, which the resume contract fingerprints: the resume maps the
    same names to the same numbers; a file changed since (another order of the same rows) is refused."""
    train = write_csv(tmp_path / "t.csv", rows(40))
    args = [*args_for(tiny["bert"]["model"], train), "--batch_size", 8, "--eval_steps", 4,
            "--output_dir", tmp_path / "run"]
    assert run_in_process([*args, "--max_steps", 4], capsys).returncode == 0
    first = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["effective"]["hf_weights"]["id2label"]
    resumed = run_in_process([*args, "--max_steps", 8, "--resume_from_checkpoint", "latest"], capsys)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    again = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["effective"]["hf_weights"]["id2label"]
    assert first == again == {0: "neg", 1: "neutral", 2: "pos"}
    write_csv(tmp_path / "t.csv", list(reversed(rows(40))))
    before = snapshot(tmp_path / "run")
    refused = run_in_process([*args, "--max_steps", 12, "--resume_from_checkpoint", "latest"], capsys)
    assert_one_line_error(refused, "train_file cannot change within a run")
    assert snapshot(tmp_path / "run") == before


def test_class_numbers_keep_the_checkpoints_names_or_take_a_class_labels(tiny, offline, tmp_path):
    """Integer labels: id2label is the checkpoint's where its head is kept, transformers' LABEL_i where it is
    replaced, and a --dataset_name's ClassLabel names (GLUE's) where the data has them."""
    import shutil

    from datasets import ClassLabel, Dataset, Features, Value

    from mixprec import data, models

    folder = tmp_path / "named_bert"
    shutil.copytree(tiny["bert"]["model"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(id2label={"0": "calm", "1": "urgent"}, label2id={"calm": 0, "urgent": 1})
    (folder / "config.json").write_text(json.dumps(config))

    def id2label(args):
        cfg = parsed(args)
        bundle = data.build(cfg)
        return models.build(cfg.model, bundle.info, cfg.model_args).hf.config.id2label

    two = tmp_path / "two.csv"
    two.write_text("text,label\n" + "".join(f"row {i},{i % 2}\n" for i in range(20)))
    three = tmp_path / "three.csv"
    three.write_text("text,label\n" + "".join(f"row {i},{i % 3}\n" for i in range(30)))
    assert id2label(args_for(folder, two)) == {0: "calm", 1: "urgent"}
    assert id2label(args_for(folder, three)) == {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}
    glue = tmp_path / "glue"
    features = Features({"sentence1": Value("string"), "sentence2": Value("string"),
                         "label": ClassLabel(names=["not_equivalent", "equivalent"])})
    for split, n in (("train", 20), ("validation", 6)):
        Dataset.from_dict({"sentence1": [f"a {i}" for i in range(n)], "sentence2": [f"b {i}" for i in range(n)],
                           "label": [i % 2 for i in range(n)]}, features=features).to_parquet(
            glue / f"{split}.parquet")
    args = ["--model_name_or_path", folder, "--dataset", "text_classification", "--dataset_name", glue,
            "--block_size", 16]
    assert id2label(args) == {0: "not_equivalent", 1: "equivalent"}
    assert data.build(parsed(args)).info["validation_from"] == "the dataset's validation split"


def test_a_fine_tuned_checkpoints_own_class_names_keep_their_numbers(tiny, offline, tmp_path):
    """A checkpoint whose config.json names its classes (POS, NEUTRAL, NEG: not sorted) fine-tuned on rows named
    pos/neutral/neg keeps its numbering, as run_glue.py does (names compared without case): its head's outputs
    stay the classes they were trained for, the head is kept, and the banner says where the numbers come from."""
    from transformers import AutoModelForSequenceClassification

    from mixprec import data, models

    folder = tmp_path / "sentiment"
    hf = AutoModelForSequenceClassification.from_pretrained(
        tiny["bert"]["model"], num_labels=3, id2label={0: "POS", 1: "NEUTRAL", 2: "NEG"},
        label2id={"POS": 0, "NEUTRAL": 1, "NEG": 2}, ignore_mismatched_sizes=True)
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (tiny["bert"]["model"] / name).exists():
            (folder / name).write_bytes((tiny["bert"]["model"] / name).read_bytes())
    train = write_csv(tmp_path / "words.csv", rows(30))
    args = args_for(folder, train, "--output_dir", tmp_path / "run")
    bundle = data.build(parsed(args))
    assert bundle.info["label_names"] == ["pos", "neutral", "neg"]
    labels = [int(y) for part in (bundle.train, bundle.validation) for y in part["labels"]]
    assert labels == [["pos", "neutral", "neg"].index(name) for _, name in rows(30)]
    model = models.build("hf_classifier", bundle.info, parsed(args).model_args)
    assert "head" not in model.weights() and not model.fresh_head  # the trained head kept
    assert model.hf.config.id2label == {0: "pos", 1: "neutral", 2: "neg"}
    assert "3 classes (pos, neutral, neg: the checkpoint's id2label)" in model.describe()
    # names that are not the checkpoint's: sorted, as before
    other = write_csv(tmp_path / "other.csv", [(text, {"pos": "good", "neutral": "meh", "neg": "bad"}[name])
                                               for text, name in rows(30)])
    assert data.build(parsed(args_for(folder, other))).info["label_names"] == ["bad", "good", "meh"]
