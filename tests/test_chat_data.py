"""Chat and prompt/completion data (`--dataset chat`, mixprec/data/chat.py and chat_render.py), offline, on a tiny
Llama built from a config (scripts/make_tiny_hf.py) whose tokenizer is given a small ChatML-style template here.
Data-level tests build the data the way a run does (`data.build` on parsed flags) and check every token's label;
bad input goes through recipes/train.py's main: one line, exit 2, no run folder. The end-to-end runs are slow."""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from helpers import REPO, assert_one_line_error, run_in_process, run_recipe, snapshot
from test_hf_models import make_tiny_hf, offline  # noqa: F401 (a fixture)

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TAGGED = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}"
          "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ message['content'] }}"
          "<|im_end|>{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# the last message gets a mark the earlier renderings lack: messages[:i + 1] is not a prefix of the whole
UNSTABLE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
            "{% if loop.last %} (end){% endif %}<|im_end|>\n{% endfor %}")
WORDS = "red green blue cat dog sun moon tree".split()
BLOCK = 128  # the tiny Llama's positions
EOT = "<|im_end|>\n"  # what the template writes after an assistant's content, up to the next turn


def with_template(src: Path, dst: Path, template: str | None) -> Path:
    from transformers import AutoTokenizer

    shutil.copytree(src, dst)
    if template is not None:
        tok = AutoTokenizer.from_pretrained(dst)
        tok.chat_template = template
        tok.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{'model': a tiny fp32 Llama whose tokenizer has CHATML, 'tagged': the same with TAGGED, 'unstable': with
    UNSTABLE, 'plain': without a template (all --model_name_or_path folders)}."""
    root = tmp_path_factory.mktemp("chat_tiny")
    made = make_tiny_hf.make(root / "llama", "llama", "float32")
    return {name: with_template(made["model"], root / name, template)
            for name, template in (("model", CHATML), ("tagged", TAGGED), ("unstable", UNSTABLE), ("plain", None))}


def conversation(i: int, turns: int = 1, system: bool = False) -> dict:
    """A learnable exchange: the assistant repeats the user's words backwards."""
    messages = [{"role": "system", "content": "Reverse."}] if system else []
    for t in range(turns):
        words = [WORDS[(i * 3 + t + k) % len(WORDS)] for k in range(3)]
        messages += [{"role": "user", "content": " ".join(words)},
                     {"role": "assistant", "content": " ".join(reversed(words))}]
    return {"messages": messages}


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def chat_args(model: Path, train: Path, *more) -> list[str]:
    return [str(a) for a in ("--model_name_or_path", model, "--dataset", "chat", "--train_file", train,
                             "--block_size", BLOCK, *more)]


def built(args):
    from mixprec import config, data

    return data.build(config.parse_config([str(a) for a in args]))


def targets(bundle, row: int) -> str:
    labels = bundle.train[row]["labels"]
    return bundle.decode(labels[labels != -100])


def check_rows(bundle, ids_of) -> None:
    """Every row: inputs are the sequence's ids[:-1] and labels ids[1:] (-100 off target), padded to the block
    with the pad id (here EOS) and -100; `ids_of(row)` gives (ids, 1 where the token is a target)."""
    block = bundle.info["block_size"]
    for n, row in enumerate(bundle.train):
        ids, target = ids_of(n)
        inputs, labels = row["inputs"].tolist(), row["labels"].tolist()
        assert len(inputs) == len(labels) == block
        k = len(ids) - 1
        assert inputs[:k] == ids[:-1] and set(inputs[k:]) <= {0}  # pad: EOS (id 0) here
        assert labels[:k] == [i if t else -100 for i, t in zip(ids[1:], target[1:])] and set(labels[k:]) <= {-100}


def test_conversations_train_on_the_assistants_tokens_only(tiny, offline, tmp_path):
    from transformers import AutoTokenizer

    rows = [conversation(i, turns=1 + i % 2, system=i % 4 == 0) for i in range(12)]
    data = jsonl(tmp_path / "chat.jsonl", rows)
    bundle = built([*chat_args(tiny["model"], data), "--validation_file", data])
    assert bundle.info["variable_targets"] and bundle.info["chat_format"] == "messages"
    assert bundle.info["validation_from"] == f"--validation_file '{data}'" and len(bundle.train) == 12
    assert (bundle.train["inputs"][:][:, -1] == 0).all()  # none cut: the whole conversation is in the block
    for n, row in enumerate(rows):  # the assistant's content and the end of its turn, nothing else
        said = [m["content"] + EOT for m in row["messages"] if m["role"] == "assistant"]
        assert targets(bundle, n) == "".join(said)
    tok = AutoTokenizer.from_pretrained(tiny["model"])

    def ids_of(n):  # the rendering, tokenized; targets: the tokens that start in an assistant's span of the text
        text = tok.apply_chat_template(rows[n]["messages"], tokenize=False)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        assert enc["input_ids"] == list(tok.apply_chat_template(rows[n]["messages"])["input_ids"])
        spans, at = [], 0
        for m in rows[n]["messages"]:
            start = text.index(m["content"], at)
            at = start + len(m["content"]) + len(EOT)
            spans += [(start, at)] if m["role"] == "assistant" else []
        return enc["input_ids"], [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]

    check_rows(bundle, ids_of)
    everything = built([*chat_args(tiny["model"], data), "--no-assistant_only_loss"])
    labels = everything.train["labels"]
    assert all(((row != -100).sum() == (row_in != 0).sum()) for row, row_in in zip(labels, everything.train["inputs"]))


def test_generation_tags_mark_the_assistants_tokens(tiny, offline, tmp_path):
    rows = [conversation(i, turns=2) for i in range(10)]
    bundle = built(chat_args(tiny["tagged"], jsonl(tmp_path / "chat.jsonl", rows), "--dataset_args",
                             "val_fraction=0.2"))
    assert bundle.info["validation_from"] == "a seeded 20% share of the training rows" and len(bundle.train) == 8
    said = {"".join(m["content"] + "<|im_end|>" for m in row["messages"] if m["role"] == "assistant") for row in rows}
    assert {targets(bundle, n) for n in range(8)} <= said  # inside the tags: the content and <|im_end|>


def test_prompt_completion_conversations_and_text(tiny, offline, tmp_path):
    convs = [{"prompt": [{"role": "user", "content": f"say {w}"}], "completion": [{"role": "assistant", "content": w}]}
             for w in WORDS]
    bundle = built(chat_args(tiny["model"], jsonl(tmp_path / "pc.jsonl", convs)))
    assert bundle.info["chat_format"] == "prompt_completion_messages"
    assert {targets(bundle, n) for n in range(len(bundle.train))} <= {w + EOT for w in WORDS}
    # plain text: prompt + completion + EOS (TRL adds it unless the completion ends with it), CSV and Parquet
    texts = [("The sky is", " blue."), ("Two and two make", " four<|endoftext|>"), ("A, \"quoted\"\nprompt:", " yes")]
    path = tmp_path / "pc.csv"
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([("prompt", "completion"), *texts * 4])
    bundle = built(chat_args(tiny["model"], path, "--validation_file", path))
    assert bundle.info["chat_format"] == "prompt_completion"
    expected = [c if c.endswith("<|endoftext|>") else c + "<|endoftext|>" for _, c in texts * 4]
    assert [targets(bundle, n) for n in range(len(bundle.train))] == expected
    from datasets import Dataset

    Dataset.from_dict({"prompt": [p for p, _ in texts], "completion": [c for _, c in texts]}).to_parquet(
        tmp_path / "pc.parquet")
    whole = built(chat_args(tiny["model"], tmp_path / "pc.parquet", "--validation_file", path,
                            "--no-completion_only_loss"))
    for n, (prompt, completion) in enumerate(texts):
        text = prompt + completion.removesuffix("<|endoftext|>") + "<|endoftext|>"
        assert whole.decode(whole.train[n]["inputs"][:1].tolist()) + targets(whole, n) == text


def test_long_rows_are_cut_to_the_block_and_rows_without_targets_dropped(tiny, offline, tmp_path, capsys):
    long = {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": " ".join(WORDS * 12)}]}
    late = {"messages": [{"role": "user", "content": " ".join(WORDS * 16)}, {"role": "assistant", "content": "ok"}]}
    rows = [conversation(i) for i in range(6)] + [long, late]
    data = jsonl(tmp_path / "chat.jsonl", rows)
    capsys.readouterr()
    bundle = built([*chat_args(tiny["model"], data), "--validation_file", jsonl(tmp_path / "v.jsonl", rows[:2])])
    assert len(bundle.train) == 7 and bundle.info["dropped_rows"] == {"train": 1, "validation": 0}
    assert "chat data, --block_size 128: train 1 of 8 rows dropped (no target token within the block), 1 cut to it" \
        in capsys.readouterr().out
    cut = bundle.train[6]
    assert (cut["inputs"] != 0).all() and cut["labels"][-1] != -100  # the block is full, its last token a target
    assert " ".join(WORDS * 12).startswith(targets(bundle, 6).strip())


def refused(tiny, capsys, tmp_path, args, *words, model="model") -> str:
    """recipes/train.py's main: one line naming `words`, exit 2, nothing written (no run folder)."""
    before = snapshot(tmp_path)
    out = tmp_path / "run"
    run = run_in_process(["--model_name_or_path", tiny[model], "--dataset", "chat", "--block_size", BLOCK,
                          "--max_steps", 1, "--batch_size", 2, "--output_dir", out, *args], capsys)
    line = assert_one_line_error(run, *words)
    assert snapshot(tmp_path) == before and not out.exists()
    return line


GOOD = json.dumps(conversation(0)) + "\n"
BAD_FILES = {  # name: (content, words in the line)
    "not_json.jsonl": (GOOD + "{oops\n", ["line 2 is not JSON"]),
    "not_object.jsonl": (GOOD + "[1, 2]\n", ["line 2 is a list, not a JSON object"]),
    "no_content.jsonl": (GOOD + json.dumps({"messages": [{"role": "user"}]}) + "\n",
                         ["line 2: message 1 of 'messages'", "a text 'content'"]),
    "empty_messages.jsonl": (GOOD + json.dumps({"messages": []}) + "\n", ["line 2: 'messages' is an empty list"]),
    "other_columns.jsonl": (json.dumps({"question": "q", "answer": "a"}) + "\n",
                            ["the columns 'question', 'answer'", "'messages'", "'prompt' and 'completion'"]),
    "mixed.jsonl": (json.dumps({"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}) + "\n",
                    ["line 1: 'completion' is a list, not text"]),
    "missing.jsonl": (GOOD + json.dumps({"text": "x"}) + "\n", ["line 2 has no 'messages'"]),
    "ragged.csv": ("prompt,completion\na,b\nc,d,e\n", ["line 3 has 3 fields, the header 2"]),
    "messages.csv": ("messages\nhi\n", ["a CSV holds plain 'prompt' and 'completion' text"]),
    "latin1.jsonl": (b'{"messages": "caf\xe9"}\n', ["line 1 is not UTF-8"]),
    "empty.jsonl": ("\n\n", ["is empty"]),
    "data.txt": (GOOD, ["must be .jsonl, .json, .parquet or .csv"]),
    "broken.parquet": (b"PAR1 not really", ["could not be read as Parquet"]),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_a_bad_file_is_one_line_and_writes_nothing(name, tiny, offline, tmp_path, capsys):
    content, words = BAD_FILES[name]
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    refused(tiny, capsys, tmp_path, ["--train_file", path], f"--train_file '{path}'", *words)


def test_refusals_of_templates_rows_and_settings(tiny, offline, tmp_path, capsys):
    data = jsonl(tmp_path / "chat.jsonl", [conversation(i, turns=2) for i in range(8)])
    refused(tiny, capsys, tmp_path, ["--train_file", data], "no chat template", "chat_template", model="plain")
    refused(tiny, capsys, tmp_path, ["--train_file", data], "not prefix-stable", "--no-assistant_only_loss",
            model="unstable")
    space = jsonl(tmp_path / "space.jsonl", [{"prompt": "The sky is ", "completion": "blue."}] * 4)
    refused(tiny, capsys, tmp_path, ["--train_file", space], "the tokens of the prompt are not the start",
            "--no-completion_only_loss")
    late = jsonl(tmp_path / "late.jsonl", [{"messages": [{"role": "user", "content": " ".join(WORDS * 16)},
                                                         {"role": "assistant", "content": "ok"}]}] * 4)
    refused(tiny, capsys, tmp_path, ["--train_file", late], "none of its", "target token within --block_size 128")
    refused(tiny, capsys, tmp_path, ["--train_file", data, "--validation_file", data, "--dataset_args",
                                     "val_fraction=0.2"], "val_fraction=0.2", "drop one of them")
    other = jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}])
    refused(tiny, capsys, tmp_path, ["--train_file", data, "--validation_file", other], "another format")


def test_a_dataset_folder_gives_its_validation_split_or_a_share(tiny, offline, tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    jsonl(folder / "train.jsonl", [conversation(i) for i in range(10)])
    jsonl(folder / "validation.jsonl", [conversation(i, turns=2) for i in range(3)])
    args = ["--model_name_or_path", tiny["model"], "--dataset", "chat", "--dataset_name", folder, "--block_size", BLOCK]
    bundle = built(args)
    assert bundle.info["validation_from"] == "the dataset's 'validation' split" and len(bundle.validation) == 3
    (folder / "validation.jsonl").unlink()
    bundle = built(args)
    assert bundle.info["validation_from"] == "a seeded 10% share of the training rows"
    assert (len(bundle.train), len(bundle.validation)) == (9, 1)
    jsonl(folder / "train.jsonl", [conversation(0), {"messages": [{"role": "user"}]}])
    from mixprec.errors import UsageError

    with pytest.raises(UsageError, match=r"\(train split\): row 2: message 1 of 'messages'"):
        built(args)


def e2e_args(tiny, tmp_path, *more) -> list:
    data = jsonl(tmp_path / "chat.jsonl", [conversation(i) for i in range(48)])
    return [*chat_args(tiny["model"], data, "--block_size", 96), "--batch_size", 8, "--max_steps", 8,
            "--eval_steps", 4, "--log_every", 2, "--lr", 3e-3, "--warmup_steps", 2, "--sample_tokens", 4, *more]


@pytest.mark.slow
@pytest.mark.parametrize("precision, peft", [("no", False), ("bf16", False), ("bf16", True)])
def test_a_chat_run_trains_full_or_lora_in_fp32_and_bf16(precision, peft, tiny, offline, tmp_path, capsys):
    val = jsonl(tmp_path / "val.jsonl", [conversation(i, system=True) for i in range(48, 54)])
    args = e2e_args(tiny, tmp_path, "--mixed_precision", precision, "--validation_file", val,
                    *(["--use_peft", "--lora_target_modules", "all-linear", "--lr", 1e-2] if peft else []),
                    "--output_dir", tmp_path / "run")
    run = run_in_process(args, capsys)
    assert run.returncode == 0, run.stderr[-3000:]
    bundle = built([*chat_args(tiny["model"], tmp_path / "chat.jsonl", "--block_size", 96), "--validation_file", val])
    tokens = int((bundle.validation[:]["labels"] != -100).sum())  # the assistant's, not the system's or user's
    assert 0 < tokens < int((bundle.validation[:]["inputs"] != 0).sum()) / 2  # most tokens are the prompt's
    assert f"validation     --validation_file '{val}': 6 rows, {tokens:,} tokens" in run.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert summary["steps"] == 8 and losses[-1] < losses[0], losses  # it learns
    assert summary["val_loss"] == summary["val_loss"] and ("lora_export" in summary) == peft


@pytest.mark.slow
def test_a_killed_chat_run_resumes_bitwise(tiny, offline, tmp_path):
    args = e2e_args(tiny, tmp_path, "--mixed_precision", "bf16", "--checkpointing_steps", 4,
                    "--gradient_accumulation_steps", 2)
    whole = run_recipe(*args, out=tmp_path / "whole", launcher="python")
    killed = run_recipe(*args, out=tmp_path / "killed", launcher="python", faults="kill_at_step=6", check=False)
    assert killed.returncode != 0 and not (tmp_path / "killed" / "summary.json").exists()
    resumed = run_recipe(*args, "--resume_from_checkpoint", "latest", out=tmp_path / "killed", launcher="python")
    assert "resumed from" in resumed.stdout and "at step 4" in resumed.stdout
    assert resumed.comparable() == whole.comparable()  # every logged loss, lr, grad norm and evaluation
    for key in ("steps", "train_loss", "val_loss", "val_accuracy"):
        assert resumed.summary()[key] == whole.summary()[key], key
    weights = [(run.out / "hf_model" / "model.safetensors").read_bytes() for run in (whole, resumed)]
    assert weights[0] == weights[1]


CONFIG = REPO / "recipes" / "configs" / "chat_tiny.yaml"


def test_the_committed_chat_config_builds_its_data(offline):
    from mixprec import config, data

    bundle = data.build(config.parse_config(["--config", str(CONFIG)]))
    assert (len(bundle.train), len(bundle.validation)) == (400, 40) and bundle.info["dropped_rows"] == {
        "train": 0, "validation": 0}
    row = json.loads((REPO / "recipes/configs/chat_tiny/validation.jsonl").read_text().splitlines()[0])
    said = "".join(m["content"] + EOT for m in row["messages"] if m["role"] == "assistant")
    labels = bundle.validation[0]["labels"]
    assert bundle.decode(labels[labels != -100]) == said
    assert sum(p.stat().st_size for p in (REPO / "recipes/configs/chat_tiny").rglob("*") if p.is_file()) < 300_000


@pytest.mark.slow
def test_the_committed_chat_config_trains(tmp_path):
    read = snapshot(REPO / "recipes" / "configs" / "chat_tiny")  # the config, tokenizer, train and validation files
    run = run_recipe("--config", CONFIG, "--max_steps", 6, "--eval_steps", 6, "--log_every", 3,
                     out=tmp_path / "run", launcher="python", env={"HF_HUB_OFFLINE": "1"})
    assert "validation     --validation_file 'recipes/configs/chat_tiny/validation.jsonl': 40 rows" in run.stdout
    assert run.summary()["steps"] == 6 and (tmp_path / "run" / "hf_model" / "chat_template.jinja").is_file()
    # the sample's prompt is the first validation conversation up to where its answer starts
    prompt = (tmp_path / "run" / "sample.txt").read_text().split("--- prompt ---\n")[1].split("--- generated ---")[0]
    assert prompt.endswith("<|im_start|>assistant\n\n") and prompt.count("<|im_start|>") == 2
    assert run.config()["derived"]["dropped_rows"] == {"train": 0, "validation": 0}
    assert snapshot(REPO / "recipes" / "configs" / "chat_tiny") == read  # every folder and file it read, unchanged


@pytest.mark.slow
@pytest.mark.parametrize("flags", [("--mixed_precision", "fp16"),
                                   ("--mixed_precision", "bf16", "--master_weights", "bf16", "--bf16_update",
                                    "stochastic")], ids=["fp16", "bf16-weights-stochastic"])
def test_the_committed_chat_config_trains_in_fp16_and_with_bf16_weights(flags, tmp_path):
    """The chat data in the other precisions: fp16 autocast with the GradScaler (real on a CPU), and bf16 weights
    updated by stochastic rounding; (DDP and DeepSpeed ZeRO-2: tests/test_token_weighting.py)."""
    run = run_recipe("--config", CONFIG, "--max_steps", 6, "--eval_steps", 6, "--log_every", 3, "--sample_tokens", 0,
                     *flags, out=tmp_path / "run", launcher="python", env={"HF_HUB_OFFLINE": "1"})
    summary = run.summary()
    assert summary["steps"] == 6 and summary["effective_precision"] == flags[1] and summary["val_loss"] < 6.5


def test_right_padding_changes_no_real_tokens_logits_without_an_attention_mask(tiny, offline):
    """The recipe's causal-LM adapter passes token ids only: with right padding under causal attention a real
    token never attends to a later position, so its logits equal those transformers gives with the attention
    mask (docs/hf-models.md, 'Truncation and padding')."""
    import torch
    from transformers import AutoModelForCausalLM

    from mixprec.models.hf import CausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny["model"], dtype=torch.float32).eval()
    ids = torch.randint(3, 100, (3, 20), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([20, 13, 5])
    real = torch.arange(20)[None] < lengths[:, None]
    ids = ids.masked_fill(~real, 0)  # right padding with the pad id
    with torch.no_grad():
        masked = hf(input_ids=ids, attention_mask=real.long()).logits
        ours = CausalLM(hf, 20, "test", "float32")(ids)
    assert torch.allclose(ours[real], masked[real], atol=1e-5, rtol=1e-5)
