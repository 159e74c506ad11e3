"""Generated damage to a transformers model's folder, and generated classification files (Hypothesis): byte-level damage to config.json, the tokenizer's
files, generation_config.json and the safetensors file (its header most of all), files deleted or emptied, and
config.json values drawn from each key's type and beyond it (wrong architectures, sizes that do not fit, negative
or huge ones). Each draw damages the model folder of one finished transformers run (a tiny Llama, bf16, 2 steps),
then runs `recipes/train.py`'s main in this process against a copy of that run, with --overwrite_output_dir and
with --resume_from_checkpoint latest.

The property, for every draw and both ways: exit 0 with finite losses; or exit 2 with one line, and every file of
the run folder and of the model's folder as it was; or a documented exit of a run that went bad (3, 74, 75) with
one line and a good checkpoint. Never a traceback. The same for classification files drawn by
tests/test_classification_files.py (damaged CSV and JSON-lines files, odd labels) against a finished BERT
classifier run, the data file included in what must stay unchanged. The quick tier runs a fixed-seed sample
(derandomized), the slow tier many more.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings as hsettings, strategies as st

from helpers import REPO, main_in_process, run_in_process, snapshot
from test_generated_input import DOCUMENTED_BAD_RUN, losses_finite, sandbox  # noqa: F401  (fixture)
from test_classification_files import csv_files, jsonl_files
from test_hf_models import tiny  # noqa: F401  (fixture)

QUICK, SLOW = 8, 60  # draws per tier
FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors")
CONFIG_KEYS = ("model_type", "architectures", "hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "num_hidden_layers", "vocab_size", "max_position_embeddings", "head_dim",
               "rms_norm_eps", "rope_theta", "dtype", "tie_word_embeddings")
MODES = {"overwrite": ["--overwrite_output_dir"], "resume": ["--resume_from_checkpoint", "latest"]}


def run_args(model: Path, text: Path, out: Path | None) -> list:
    return ["--model_name_or_path", model, "--dataset", "text", "--train_file", text, "--block_size", 16,
            "--batch_size", 4, "--max_steps", 2, "--eval_steps", 2, "--log_every", 1, "--sample_tokens", 0,
            "--warmup_steps", 1, "--mixed_precision", "bf16", "--dataset_args", "max_val_samples=8",
            "--output_dir", out]


@pytest.fixture(scope="module")
def finished_hf(tiny, tmp_path_factory):  # noqa: F811
    """{"model": the folder the run read (damaged and restored by each draw), "pristine": a copy of it,
    "run": the finished run, "text": its data}."""
    root = tmp_path_factory.mktemp("finished_hf")
    shutil.copytree(tiny["llama_bf16"]["model"], root / "pristine")
    shutil.copytree(root / "pristine", root / "model")
    finish(run_args(root / "model", tiny["text"], root / "run"))
    return {"model": root / "model", "pristine": root / "pristine", "run": root / "run", "text": tiny["text"]}


def finish(args: list) -> None:
    """A run of recipes/train.py's main in this process (a module's fixture has no capsys), offline."""
    offline = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        main_in_process(args)
    finally:
        if offline is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = offline


def header_end(raw: bytes) -> int:
    return 8 + struct.unpack("<Q", raw[:8])[0] if len(raw) >= 8 else len(raw)


config_values = st.one_of(st.none(), st.booleans(), st.integers(-3, 10), st.integers(-2**40, 2**40),
                          st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                          st.sampled_from(["bert", "gpt2", "t5", "no_such_model", "LlamaForCausalLM",
                                           "BertForMaskedLM"]),
                          st.lists(st.sampled_from(["LlamaForCausalLM", "BertModel", "x"]), max_size=2),
                          st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@st.composite
def damages(draw):
    """(what was done, in words; a function that does it to a model folder)."""
    name = draw(st.sampled_from(FILES))
    kind = draw(st.sampled_from(["truncate", "overwrite", "delete", "empty", "value"] if name == "config.json"
                                else ["truncate", "overwrite", "delete", "empty"]))
    seed = draw(st.integers(0, 2**32 - 1))
    key, value = draw(st.sampled_from(CONFIG_KEYS)), draw(config_values)
    count = draw(st.integers(1, 16))
    in_header = draw(st.booleans())

    def do(folder: Path):
        path = folder / name
        if kind == "delete":
            path.unlink()
            return
        if kind == "empty":
            path.write_bytes(b"")
            return
        if kind == "value":
            config = json.loads(path.read_text())
            config[key] = value
            path.write_text(json.dumps(config))
            return
        raw = bytearray(path.read_bytes())
        span = header_end(bytes(raw)) if name.endswith(".safetensors") and in_header else len(raw)
        rng = random.Random(seed)
        if kind == "truncate":
            del raw[rng.randrange(min(span, len(raw))):]
        else:
            for _ in range(count):
                raw[rng.randrange(min(span, len(raw)))] = rng.randrange(256)
        path.write_bytes(bytes(raw))

    words = f"{kind} {name}" + (f" {key}={value!r}" if kind == "value" else "")
    return words + (" (header)" if in_header and name.endswith(".safetensors") else ""), do


def check(finished: dict, args: list, words: str, capsys, monkeypatch, watch: list[Path]) -> None:
    """The property, for `args` against a copy of the finished run, both ways; the files under `watch` (the
    model's folder, the data) are never written."""
    for mode, extra in MODES.items():
        work = Path(tempfile.mkdtemp(prefix="model-draw-"))
        try:
            out = work / "run"
            shutil.copytree(finished["run"], out, symlinks=True)
            (work / "cwd").mkdir()
            monkeypatch.chdir(work / "cwd")
            before = (snapshot(out), [snapshot(p) if p.is_dir() else p.read_bytes() for p in watch])
            run = run_in_process([*args, "--output_dir", out, *extra], capsys)
            said = f"{mode}, {words}: exit {run.returncode}\n{run.stderr[-1500:]}"
            if os.environ.get("MIXPREC_SHOW_DRAWS"):
                print(f"DRAW {said.splitlines()[0]} | {(run.stderr.strip().splitlines() or [''])[-1][:150]}",
                      file=sys.__stderr__)
            assert "Traceback" not in run.stdout + run.stderr, said
            assert [snapshot(p) if p.is_dir() else p.read_bytes() for p in watch] == before[1], said
            if run.returncode == 0:
                assert not (out / "metrics.jsonl").is_file() or losses_finite(out), said
                continue
            lines = [line for line in run.stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("error: "), said
            if run.returncode == 2:
                assert snapshot(out) == before[0], said
                assert not any((work / "cwd").iterdir()), said
            else:
                from mixprec.run_folder.checkpointing import find

                assert run.returncode in DOCUMENTED_BAD_RUN, said
                assert find(out / "checkpoints")[0] is not None, said
        finally:
            monkeypatch.chdir(REPO)
            shutil.rmtree(work, ignore_errors=True)


def damaged_model_check(finished_hf, damage, capsys, monkeypatch) -> None:
    words, do = damage
    model = finished_hf["model"]
    try:
        do(model)
        args = run_args(model, finished_hf["text"], None)[:-2]  # --output_dir comes from check
        check(finished_hf, args, words, capsys, monkeypatch, watch=[model])
    finally:
        shutil.rmtree(model, ignore_errors=True)
        shutil.copytree(finished_hf["pristine"], model)


def tier(slow: bool):
    return hsettings(max_examples=SLOW if slow else QUICK, derandomize=True, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])


@given(damage=damages())
@tier(slow=False)
def test_a_damaged_model_folder_is_one_line_or_a_good_run(finished_hf, sandbox, capsys, monkeypatch,  # noqa: F811
                                                          damage):
    damaged_model_check(finished_hf, damage, capsys, monkeypatch)


@pytest.mark.slow
@given(damage=damages())
@tier(slow=True)
def test_a_damaged_model_folder_is_one_line_or_a_good_run_many(finished_hf, sandbox, capsys,  # noqa: F811
                                                               monkeypatch, damage):
    damaged_model_check(finished_hf, damage, capsys, monkeypatch)


def test_the_draws_reach_every_file_and_kind():
    """The strategy itself: every file, every kind of damage and the safetensors header are drawn."""
    seen = set()

    @given(damage=damages())
    @hsettings(max_examples=300, derandomize=True, database=None)
    def collect(damage):
        seen.add(" ".join(damage[0].split()[:2]))

    collect()
    assert {f"{k} {f}" for f in FILES for k in ("truncate", "overwrite", "delete", "empty")} <= seen
    assert "value config.json" in seen


# --- drawn classification files against a finished classifier run --------------------------------------------------

def classifier_args(model: Path, data: Path) -> list:
    return ["--model_name_or_path", model, "--dataset", "text_classification", "--train_file", data,
            "--block_size", 16, "--batch_size", 4, "--max_steps", 2, "--eval_steps", 2, "--log_every", 1,
            "--warmup_steps", 1, "--mixed_precision", "bf16"]


@pytest.fixture(scope="module")
def finished_classifier(tiny, tmp_path_factory):  # noqa: F811
    """{"model": the BERT folder, "data": the data.csv the run read (each draw replaces it, then puts it back),
    "pristine": its content, "run": the finished run}."""
    root = tmp_path_factory.mktemp("finished_classifier")
    shutil.copytree(tiny["bert"]["model"], root / "model")
    (root / "data").mkdir()
    shutil.copy(tiny["bert"]["csv"], root / "data" / "data.csv")
    finish([*classifier_args(root / "model", root / "data" / "data.csv"), "--output_dir", root / "run"])
    return {"model": root / "model", "data": root / "data" / "data.csv",
            "pristine": (root / "data" / "data.csv").read_bytes(), "run": root / "run"}


def drawn_file_check(finished_classifier, drawn, capsys, monkeypatch) -> None:
    name, content, _ = drawn
    data = finished_classifier["data"].with_name(name)  # data.csv: the run's own file, changed; or a data.jsonl
    try:
        data.write_bytes(content)
        check(finished_classifier, classifier_args(finished_classifier["model"], data), f"{name} {content[:80]!r}",
              capsys, monkeypatch, watch=[finished_classifier["model"], data])
    finally:
        finished_classifier["data"].write_bytes(finished_classifier["pristine"])
        finished_classifier["data"].with_name("data.jsonl").unlink(missing_ok=True)


@given(drawn=st.one_of(csv_files(), jsonl_files()))
@hsettings(max_examples=2, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck),
           phases=[Phase.explicit, Phase.generate])
def test_a_drawn_classification_file_is_one_line_or_a_good_run(finished_classifier, sandbox, capsys,  # noqa: F811
                                                               monkeypatch, drawn):
    drawn_file_check(finished_classifier, drawn, capsys, monkeypatch)


@pytest.mark.slow
@given(drawn=st.one_of(csv_files(), jsonl_files()))
@hsettings(max_examples=40, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck),
           phases=[Phase.explicit, Phase.generate])
def test_a_drawn_classification_file_is_one_line_or_a_good_run_many(finished_classifier, sandbox, capsys,  # noqa: F811
                                                                    monkeypatch, drawn):
    drawn_file_check(finished_classifier, drawn, capsys, monkeypatch)
