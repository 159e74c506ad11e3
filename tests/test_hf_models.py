"""transformers models through recipes/train.py, offline: tiny Llama and GPT-2 models built from configs with a
byte-level BPE tokenizer trained by `tokenizers` on this Python's standard library (scripts/make_tiny_hf.py),
saved to a temporary folder once per session. The runs take tens of steps on a small local text file."""
import importlib.util
import json
import os
import socket
import sysconfig
from pathlib import Path

import pytest
import torch

from helpers import REPO, assert_one_line_error, run_in_process, snapshot
from mixprec.tracking.jsonl import read_records

spec = importlib.util.spec_from_file_location("make_tiny_hf", REPO / "scripts" / "make_tiny_hf.py")
make_tiny_hf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_tiny_hf)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """{'llama_bf16', 'gpt2', 'bert': {'model', 'config', 'tokenizer'} folders (bert: and 'csv', a keyword
    task), 'text': a .txt file of stdlib source}."""
    root = tmp_path_factory.mktemp("tiny_hf")
    out = {"llama_bf16": make_tiny_hf.make(root / "llama_bf16", "llama", "bfloat16"),
           "gpt2": make_tiny_hf.make(root / "gpt2", "gpt2", "float32"),
           "bert": make_tiny_hf.make_classifier(root / "bert")}
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / name).read_text() for name in ("textwrap.py", "shlex.py", "fnmatch.py"))
    out["text"] = root / "corpus.txt"
    out["text"].write_text(text)
    return out


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1 and every socket connection refused in this process: any reach for the network fails."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def refuse(self, *args, **kwargs):
        raise OSError(f"test: network access attempted to {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: refuse(None, *a))


def common(tiny, out):
    return ["--dataset", "text", "--train_file", tiny["text"], "--block_size", 32, "--batch_size", 8,
            "--max_steps", 12, "--eval_steps", 12, "--log_every", 6, "--sample_tokens", 8, "--warmup_steps", 2,
            "--lr", 3e-3, "--output_dir", out]


def parsed(args):
    """The settings of a run as parsing makes them (the transformers flags resolved)."""
    from mixprec import config

    return config.parse_config([str(a) for a in args])


def export_val_loss(args, folder: Path, dtype: torch.dtype) -> float:
    """The validation loss of the exported model, loaded with AutoModelForCausalLM, on the run's own validation
    blocks (the same data pipeline), computed in fp32 as the recipe's evaluation does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    assert next(model.parameters()).dtype == dtype  # transformers 5 loads the stored dtype
    return val_loss(args, model)


def val_loss(args, model) -> float:
    """The validation loss of a transformers (or peft) model on the run's own validation blocks (the same data
    pipeline), in fp32 as the recipe's evaluation computes it."""
    from mixprec import data
    from mixprec.evaluation import loss_fn

    model = model.float().eval()
    val = data.build(parsed(args)).validation
    with torch.no_grad():
        losses = [loss_fn(model(input_ids=row["inputs"][None].long()).logits, row["labels"][None].long()).item()
                  for row in val]
    return sum(losses) / len(losses)


@pytest.mark.slow
def test_a_bf16_checkpoint_trains_in_fp32_and_exports_in_bf16(tiny, offline, tmp_path, capsys):
    args = ["--model_name_or_path", tiny["llama_bf16"]["model"], *common(tiny, tmp_path / "run"),
            "--mixed_precision", "bf16", "--fp32_modules", "hf.model.norm,hf.lm_head"]
    run = run_in_process(args, capsys)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "stored bfloat16, trained float32 (upcast from bfloat16 at load" in run.stdout
    assert "fp32 modules" in run.stdout  # the model's own module names, matched
    cfg = json.loads(json.dumps(__import__("yaml").safe_load((tmp_path / "run" / "config.yaml").read_text())))
    assert cfg["effective"]["hf_weights"]["stored_dtype"] == "bfloat16"
    assert cfg["effective"]["hf_weights"]["trained_dtype"] == "float32"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    export = summary["hf_export"]
    assert export["status"] == "saved" and export["dtype"] == "bfloat16"
    folder = Path(export["path"])
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in folder.iterdir()}
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    umask = os.umask(0o022)
    os.umask(umask)
    assert {p.stat().st_mode & 0o777 for p in folder.iterdir()} == {0o666 & ~umask}  # safetensors' too
    assert "(range audit: all 21 tensors fit, no value overflows or flushes to zero)" in run.stdout  # said
    # bf16 weights: 8 bits of mantissa, a relative error up to 2^-9 per weight; the loss moved by 8.5e-5 nats
    # when measured (of about 6), so 2e-3 is a bound that a wrong model or wrong data would exceed by far
    loss = export_val_loss(args, folder, torch.bfloat16)
    assert abs(loss - summary["val_loss"]) < 2e-3, (loss, summary["val_loss"])


@pytest.mark.slow
def test_a_model_from_a_config_trains_and_exports_in_fp32(tiny, offline, tmp_path, capsys):
    args = ["--config_name", tiny["gpt2"]["config"], "--tokenizer_name", tiny["gpt2"]["tokenizer"],
            *common(tiny, tmp_path / "run"), "--mixed_precision", "bf16"]
    run = run_in_process(args, capsys)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "fresh weights from its config" in run.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["val_loss"] < summary["train_loss"] + 1 and summary["hf_export"]["dtype"] == "float32"
    loss = export_val_loss(args, Path(summary["hf_export"]["path"]), torch.float32)
    assert abs(loss - summary["val_loss"]) < 1e-5, (loss, summary["val_loss"])  # fp32: order of sums (4e-8 measured)


def test_the_range_audit_counts_overflow_flush_to_zero_and_non_finite_values():
    from mixprec.models.hf_export import _decide, audit

    layer = torch.nn.Linear(4, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1e6, -7e4, 1e-9, 1.0], [1e-43, 0.0, 2.0, 3.0]]))
        layer.bias.zero_()
    assert audit(layer, torch.float16) == {"weight": {"overflow": 2, "flush_to_zero": 2, "non_finite": 0}}
    # 1e-43: an fp32 subnormal, below bf16's
    assert audit(layer, torch.bfloat16) == {"weight": {"overflow": 0, "flush_to_zero": 1, "non_finite": 0}}
    assert _decide(layer.state_dict(), torch.bfloat16, {})["status"] == "audited"
    # bf16's largest value is 3.3895e38; from halfway to the next power (about 3.3961e38) it rounds to infinity:
    # refused in bf16, not in fp32
    assert audit({"w": torch.tensor([3.395e38])}, torch.bfloat16) == {}
    big = {"w": torch.tensor([3.4e38, 1.0])}
    assert audit(big, torch.bfloat16)["w"]["overflow"] == 1
    refused = _decide(big, torch.bfloat16, {})
    assert refused["status"] == "refused" and "exceed bfloat16's range (w)" in refused["reason"]
    assert "--save_dtype fp32" in refused["reason"]
    assert _decide(big, torch.float32, {})["status"] == "audited"
    # NaN or infinity: refused in every dtype, fp32 included
    for bad in (float("nan"), float("inf")):
        state = {"a": torch.tensor([1.0, bad]), "b": torch.ones(2)}
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            verdict = _decide(state, dtype, {})
            assert verdict["status"] == "refused" and verdict["audit"]["a"]["non_finite"] == 1, verdict
            assert "1 tensor(s) hold 1 NaN or infinite value(s) (a)" in verdict["reason"]


def test_an_fp16_export_that_would_overflow_is_refused_and_the_run_kept(tiny, tmp_path, capsys):
    from accelerate import Accelerator

    from mixprec import config
    from mixprec.models import hf

    cfg = config.parse_config(["--model_name_or_path", str(tiny["gpt2"]["model"]), "--dataset", "text",
                               "--save_dtype", "fp16"])
    model = hf.CausalLM(hf._load(str(tiny["gpt2"]["model"]), None)[0], 32, "tiny", "float32")
    with torch.no_grad():
        model.hf.lm_head.weight[0, 0] = 1e5
    from mixprec.models.hf_export import export

    result = export(Accelerator(cpu=True), model, cfg, tmp_path)["hf_export"]
    assert result["status"] == "refused" and not (tmp_path / "hf_model").exists()
    line = capsys.readouterr().out.strip()
    assert "lm_head.weight" in line and "--save_dtype bf16" in line and len(line.splitlines()) == 1


def csv_file(tmp: Path, text: str) -> Path:
    path = tmp / "data.csv"
    path.write_text(text)
    return path


def classify(tiny, csv=None):
    return ["--model_name_or_path", tiny["bert"]["model"], "--dataset", "text_classification", "--train_file",
            csv or tiny["bert"]["csv"], "--block_size", 16]


@pytest.mark.slow
def test_a_bert_classifier_learns_the_keyword_task_and_its_export_reproduces_it(tiny, offline, tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification

    from mixprec import config, data
    from mixprec.evaluation import loss_fn

    args = [*classify(tiny), "--batch_size", 16, "--lr", 3e-3, "--warmup_steps", 5, "--max_steps", 60,
            "--eval_steps", 60, "--mixed_precision", "bf16", "--output_dir", tmp_path / "run"]
    run = run_in_process(args, capsys)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["val_accuracy"] > 0.9  # chance is 0.5 (measured: 1.0 after 60 steps)
    model = AutoModelForSequenceClassification.from_pretrained(summary["hf_export"]["path"]).eval()
    val = data.build(parsed(args)).validation
    with torch.no_grad():
        rows = val[:]
        ids = rows["inputs"].long()
        logits = model(input_ids=ids, attention_mask=(ids != 0).long()).logits
    assert abs(loss_fn(logits, rows["labels"]).item() - summary["val_loss"]) < 1e-5  # fp32 export


@pytest.mark.slow
def test_a_classifier_trains_on_a_dataset_that_load_dataset_reads_with_its_own_validation_split(tiny, offline,
                                                                                               tmp_path, capsys):
    """--dataset_name with --dataset text_classification: the Hub's code path (datasets.load_dataset), on a local
    folder shaped like GLUE MRPC (train.csv and validation.csv with sentence1, sentence2, label)."""
    import csv

    from mixprec import data

    rows = list(csv.DictReader(tiny["bert"]["csv"].open()))
    mrpc = tmp_path / "mrpc"
    mrpc.mkdir()
    for name, part in (("train", rows[:480]), ("validation", rows[480:])):
        with (mrpc / f"{name}.csv").open("w", newline="") as f:
            csv.writer(f).writerows([("sentence1", "sentence2", "label"),
                                     *[(r["text"], "a second sentence", r["label"]) for r in part]])
    args = ["--model_name_or_path", tiny["bert"]["model"], "--dataset", "text_classification", "--dataset_name",
            mrpc, "--block_size", 24, "--batch_size", 16, "--lr", 3e-3, "--warmup_steps", 5, "--max_steps", 60,
            "--eval_steps", 60, "--output_dir", tmp_path / "run"]
    bundle = data.build(parsed(args))
    assert (len(bundle.train), len(bundle.validation)) == (480, len(rows) - 480)  # the dataset's own split
    run = run_in_process(args, capsys)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["val_accuracy"] > 0.9  # chance 0.5
    other = tmp_path / "other"
    other.mkdir()
    (other / "train.csv").write_text("question,answer\n" + "why,because\n" * 20)
    bad = ["--model_name_or_path", tiny["bert"]["model"], "--dataset", "text_classification", "--dataset_name",
           other, "--output_dir", tmp_path / "bad"]
    assert_one_line_error(run_in_process(bad, capsys), "has no 'text' column", "question, answer",
                          "text_column=")
    assert not (tmp_path / "bad").exists()
    both = [*bad, "--train_file", tiny["bert"]["csv"]]
    assert_one_line_error(run_in_process(both, capsys), "--dataset_name", "--train_file", "give one")


def test_a_pair_column_named_alone_is_kept_and_every_split_is_checked(tiny, offline, tmp_path):
    """--dataset_args text_pair_column=... without text_column: the text column is found by its usual name and
    the named pair column is used; a validation split without a named column is refused naming the split."""
    from mixprec import data
    from mixprec.errors import UsageError

    folder = tmp_path / "pairs"
    folder.mkdir()
    rows = "".join(f"the report {i},other words {i},{i % 2}\n" for i in range(20))
    (folder / "train.csv").write_text("text,second,label\n" + rows)
    (folder / "validation.csv").write_text("text,second,label\n" + "".join(rows.splitlines(True)[:5]))
    args = ["--model_name_or_path", tiny["bert"]["model"], "--dataset", "text_classification", "--dataset_name",
            folder, "--dataset_args", "text_pair_column=second", "--block_size", 16, "--output_dir", tmp_path / "r"]
    first = data.build(parsed(args)).train[0]["inputs"].tolist()
    sep = 3  # make_tiny_hf.word_tokenizer's separator: two of them, a sentence pair
    assert first.count(sep) == 2
    (folder / "validation.csv").write_text("text,label\n" + "".join(f"words {i},{i % 2}\n" for i in range(5)))
    with pytest.raises(UsageError, match=r"\(validation split\): column .second. is empty in 5 of 5 rows"):
        data.build(parsed(args))


def no_pad(tmp: Path, tiny) -> Path:
    """The tiny BERT's word-level tokenizer saved without its pad token (it has no EOS token either)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["bert"]["tokenizer"])
    tok.pad_token = None
    tok.save_pretrained(tmp / "no_pad")
    return tmp / "no_pad"


def huge_config(tmp: Path, tiny) -> Path:
    """The tiny Llama's config.json with hidden size 65536 and 64 layers: 3.3e12 parameters (52 TB to train)."""
    config = json.loads((tiny["llama_bf16"]["config"] / "config.json").read_text())
    config.update(hidden_size=65536, intermediate_size=4 * 65536, num_hidden_layers=64, num_attention_heads=64)
    (tmp / "huge").mkdir()
    (tmp / "huge" / "config.json").write_text(json.dumps(config))
    return tmp / "huge"


BAD = {
    "a config beyond memory": (lambda t, tiny: ["--config_name", huge_config(t, tiny), "--tokenizer_name",
                                                tiny["llama_bf16"]["tokenizer"]],
                               ["--config_name", "3,307,", "parameters by its config.json", "TB", "memory"]),
    "missing path": (lambda t, tiny: ["--model_name_or_path", t / "nope"], ["nope", "not found"]),
    "no config.json": (lambda t, tiny: ["--model_name_or_path", tiny["gpt2"]["tokenizer"]], ["no config.json"]),
    "Hub id offline": (lambda t, tiny: ["--model_name_or_path", "someone/tiny-model"],
                       ["someone/tiny-model", "HF_HUB_OFFLINE"]),
    "block beyond positions": (lambda t, tiny: ["--model_name_or_path", tiny["gpt2"]["model"], "--block_size", 4096],
                               ["--block_size 4096", "128 positions"]),
    "config without tokenizer": (lambda t, tiny: ["--config_name", tiny["gpt2"]["config"]], ["--tokenizer_name"]),
    "tokenizer without model": (lambda t, tiny: ["--tokenizer_name", tiny["gpt2"]["tokenizer"]],
                                ["--model_name_or_path"]),
    "tokenizer without pad and EOS tokens": (lambda t, tiny: [*classify(tiny), "--tokenizer_name", no_pad(t, tiny)],
                                             ["neither a pad token nor an EOS token"]),
    "labels beyond --num_labels": (lambda t, tiny: [*classify(tiny, csv_file(t, "text,label\n" + "a b,5\nc d,0\n" * 10)),
                                                    "--num_labels", 2],
                                   ["--num_labels 2 is fewer than", "up to 5 (on line 2) take 6 outputs",
                                    "--num_labels 6 or more"]),
    "text column of numbers": (lambda t, tiny: classify(tiny, csv_file(t, "text,label\n" + "3,1\n4,0\n" * 10)),
                               ["column 'text' is not text"]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_is_one_line_and_writes_nothing(name, tiny, offline, tmp_path, capsys):
    make, words = BAD[name]
    made = make(tmp_path, tiny)
    before = snapshot(tmp_path)
    data = [] if "--dataset" in made else ["--dataset", "text", "--train_file", tiny["text"]]
    assert_one_line_error(run_in_process([*made, *data, "--output_dir", tmp_path / "run"], capsys), *words)
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_recipe_config_trains_the_model_the_script_makes(tiny, offline, tmp_path, capsys):
    """recipes/configs/hf_llama_tiny.yaml, with its model folder (runs/tiny_hf/model) replaced by the session's
    bf16 Llama and its data by the small text file, for 4 steps."""
    args = ["--config", REPO / "recipes" / "configs" / "hf_llama_tiny.yaml", "--model_name_or_path",
            tiny["llama_bf16"]["model"], "--dataset", "text", "--train_file", tiny["text"], "--max_steps", 4,
            "--sample_tokens", 0, "--output_dir", tmp_path / "run"]
    run = run_in_process(args, capsys)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "hf weights" in run.stdout and "stored bfloat16, trained float32" in run.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["hf_export"]["dtype"] == "bfloat16"


@pytest.mark.slow
def test_ddp_on_two_processes_killed_and_resumed_matches_an_uninterrupted_run(tiny, tmp_path):
    """2 CPU processes (DDP over gloo), bf16 autocast with fp32 master weights: a run killed with SIGKILL at step
    7 and resumed from its step-4 checkpoint logs exactly what an uninterrupted run logs, and exports the same."""
    from helpers import CONFIGS, free_port, run_recipe

    args = ["--model_name_or_path", tiny["llama_bf16"]["model"], "--dataset", "text", "--train_file", tiny["text"],
            "--block_size", 32, "--batch_size", 4, "--max_steps", 8, "--checkpointing_steps", 4, "--eval_steps", 4,
            "--log_every", 2, "--sample_tokens", 0, "--mixed_precision", "bf16"]
    env = {"HF_HUB_OFFLINE": "1"}

    def launch(*extra, out, **kw):
        return run_recipe(*args, *extra, out=out, config=CONFIGS / "multi_cpu.yaml", env=env, timeout=600,
                          launch_args=("--num_processes", 2, "--main_process_port", free_port()), **kw)

    whole = launch(out=tmp_path / "whole")
    killed = launch(out=tmp_path / "killed", faults="kill_at_step=7", check=False)
    assert killed.returncode != 0 and not (tmp_path / "killed" / "summary.json").exists()
    assert (tmp_path / "killed" / "checkpoints" / "latest").read_text() == "step_0000004"
    resumed = launch("--resume_from_checkpoint", "latest", out=tmp_path / "killed")
    assert "resumed from" in resumed.stdout and resumed.summary()["world_size"] == 2
    assert resumed.comparable() == whole.comparable()
    for key in ("steps", "train_loss", "val_loss"):
        assert resumed.summary()[key] == whole.summary()[key], key
    weights = [(run.out / "hf_model" / "model.safetensors").read_bytes() for run in (whole, resumed)]
    assert weights[0] == weights[1]  # the bf16 export, bit for bit


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_under_deepspeed_zero_the_fp32_export_holds_the_fp32_master_weights(stage, tiny, tmp_path):
    """2 CPU processes, DeepSpeed ZeRO-1/2/3 with bf16: the model inside the engine holds bf16 copies, the fp32
    master weights live (sharded) in DeepSpeed's optimizer; an fp32 export holds the masters, bit for bit as
    DeepSpeed's own zero_to_fp32 rebuilds them from the run's last checkpoint."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    from helpers import CONFIGS, free_port, run_recipe

    config = tmp_path / "zero.yaml"  # ZeRO-1 has no config of its own in accelerate_configs
    config.write_text((CONFIGS / "deepspeed_zero2.yaml").read_text().replace("zero_stage: 2", f"zero_stage: {stage}"))
    run = run_recipe("--model_name_or_path", tiny["llama_bf16"]["model"], "--dataset", "text", "--train_file",
                     tiny["text"], "--block_size", 32, "--batch_size", 4, "--max_steps", 6, "--checkpointing_steps",
                     6, "--eval_steps", 6, "--sample_tokens", 0, "--mixed_precision", "bf16", "--save_dtype", "fp32",
                     out=tmp_path / "run", config=config, env={"HF_HUB_OFFLINE": "1"}, timeout=600,
                     launch_args=("--num_processes", 2, "--main_process_port", free_port()))
    assert f"DeepSpeed ZeRO-{stage}" in run.stdout
    masters = get_fp32_state_dict_from_zero_checkpoint(str(run.out / "checkpoints" / "step_0000006"),
                                                       tag="pytorch_model")
    masters = {k.removeprefix("hf."): v for k, v in masters.items()}
    exported = load_file(run.out / "hf_model" / "model.safetensors")
    assert {t.dtype for t in exported.values()} == {torch.float32}
    assert sorted(exported) == sorted(masters)
    assert [k for k in exported if not torch.equal(exported[k], masters[k])] == []
    # the bf16 copies would have lost the low bits: the masters are not all bf16 values
    assert any(not torch.equal(t, t.bfloat16().float()) for t in masters.values())


@pytest.mark.slow
def test_the_classifier_recipe_config_trains_the_model_the_script_makes(tiny, offline, tmp_path, capsys):
    """recipes/configs/hf_bert_classifier.yaml with its folders (runs/tiny_bert) replaced by the session's."""
    args = ["--config", REPO / "recipes" / "configs" / "hf_bert_classifier.yaml", "--model_name_or_path",
            tiny["bert"]["model"], "--train_file", tiny["bert"]["csv"], "--output_dir", tmp_path / "run"]
    run = run_in_process(args, capsys)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["val_accuracy"] > 0.9


def test_sentence_pairs_are_tokenized_as_pairs(tiny, offline, tmp_path):
    """A `text_pair` column (GLUE MRPC's layout): each row is [CLS] text [SEP] pair [SEP], padded."""
    from mixprec import data

    rows = "".join(f"the report {i},the numbers {i},{i % 2}\n" for i in range(20))
    cfg = parsed([*classify(tiny, csv_file(tmp_path, "text,text_pair,label\n" + rows)), "--output_dir", tmp_path])
    first = data.build(cfg).train[0]["inputs"].tolist()
    sep, pad = 3, 0  # make_tiny_hf.word_tokenizer's special tokens
    assert first.count(sep) == 2 and first[-1] == pad and len(first) == 16


@pytest.mark.slow
def test_the_label_probe_on_a_bert_classifier(tiny, offline, tmp_path, capsys):
    """The label probe (docs/health.md) on the tiny BERT with 4000 rows, fp32: the keyword task is silent at step 1;
    the same rows with their labels shuffled are labels_unrelated at step 1; labels that are an XOR of two words
    ('urgent', 'friday') are said unrelated too, the limit docs/health.md states (such a run can still learn them:
    measured there, not here, where escaping the plateau depends on the CPU's rounding), and the event's text
    names that case and --label_probe_samples 0."""
    import random

    rows = make_tiny_hf.keyword_rows(4000, seed=1)
    labels = [label for _, label in rows]
    random.Random(0).shuffle(labels)
    rng, words, xor = random.Random(5), [w for w in make_tiny_hf.WORDS if w != "friday"], []
    for _ in range(4000):
        text, a, b = rng.choices(words, k=rng.randint(4, 12)), rng.random() < 0.5, rng.random() < 0.5
        for word in ("urgent",) * a + ("friday",) * b:
            text.insert(rng.randrange(len(text) + 1), word)
        xor.append((" ".join(text), int(a != b)))
    write = make_tiny_hf.write_rows
    files = {"keyword": write(tmp_path / "keyword.csv", rows),
             "shuffled": write(tmp_path / "shuffled.csv", [(t, y) for (t, _), y in zip(rows, labels)]),
             "xor": write(tmp_path / "xor.csv", xor)}
    base = ["--config", REPO / "recipes" / "configs" / "hf_bert_classifier.yaml", "--model_name_or_path",
            tiny["bert"]["model"], "--mixed_precision", "no", "--seed", 1]
    events = {}
    for name in files:
        out = tmp_path / name
        run = run_in_process([*base, "--train_file", files[name], "--max_steps", 1, "--output_dir", out], capsys)
        assert run.returncode == 0, run.stderr[-3000:]
        events[name] = [(r["step"], r["event"]) for r in read_records(out / "metrics.jsonl") if "event" in r]
        if name == "xor":
            assert "an XOR of two features" in run.stdout and "--label_probe_samples 0" in run.stdout
    assert not any(event == "labels_unrelated" for _, event in events["keyword"]), events
    assert (1, "labels_unrelated") in events["shuffled"] and (1, "labels_unrelated") in events["xor"], events
