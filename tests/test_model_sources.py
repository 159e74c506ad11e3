"""The folders a transformers run reads (the model, its config, its tokenizer, the data) are the user's data:
never written, never taken for a run folder, never swapped silently between a run and its resume
(mixprec/run_folder/sources.py, mixprec/run_folder/rundir.py); the export writes the tokenizer the run used and marks its folder as
the recipe's (mixprec/models/hf_export.py). Every refusal is one line, exit code 2, and every file of the run
folder and of the model's folders hashed before and after."""
import shutil
from pathlib import Path

import pytest

from helpers import assert_one_line_error, run_in_process, snapshot
from test_hf_models import offline, tiny  # noqa: F401  (fixtures)


def copied(tiny, tmp: Path, name: str = "model") -> Path:  # noqa: F811
    """A copy of the session's tiny bf16 Llama folder (its model and tokenizer), which a test may change."""
    dest = tmp / name
    shutil.copytree(tiny["llama_bf16"]["model"], dest)
    return dest


def args(tiny, model: Path, out: Path, *more) -> list:  # noqa: F811
    return ["--model_name_or_path", model, "--dataset", "text", "--train_file", tiny["text"], "--block_size", 16,
            "--batch_size", 4, "--max_steps", 2, "--eval_steps", 2, "--log_every", 1, "--sample_tokens", 0,
            "--warmup_steps", 1, "--mixed_precision", "bf16", "--output_dir", out, *more]


def refused(run_args, capsys, *words, watch: list[Path]):
    """The run is one line naming `words`, exit code 2, and every file under `watch` is unchanged."""
    before = [snapshot(p) for p in watch]
    line = assert_one_line_error(run_in_process(run_args, capsys), *words)
    assert [snapshot(p) for p in watch] == before
    return line


@pytest.mark.parametrize("where", ["model itself", "inside the model", "around the model", "the tokenizer"])
def test_an_output_dir_on_a_source_folder_is_refused_and_nothing_changes(where, tiny, offline, tmp_path,  # noqa: F811
                                                                          capsys):
    model = copied(tiny, tmp_path / "user")
    extra = []
    if where == "the tokenizer":
        tok = tmp_path / "tok"
        shutil.copytree(tiny["llama_bf16"]["tokenizer"], tok)
        extra, out, words = ["--tokenizer_name", tok], tok, ["is --tokenizer_name"]
    else:
        out, words = {"model itself": (model, ["is --model_name_or_path"]),
                      "inside the model": (model / "run", ["is inside --model_name_or_path"]),
                      "around the model": (tmp_path / "user", ["contains --model_name_or_path"])}[where]
    refused(args(tiny, model, out, *extra), capsys, *words, "choose an --output_dir outside it", watch=[tmp_path])
    assert not (model / "run").exists()


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("kind", ["a saved model", "a sharded model", "a tokenizer"])
def test_a_folder_holding_a_saved_model_is_never_taken_for_a_run_folder(kind, overwrite, tiny, offline,  # noqa: F811
                                                                        tmp_path, capsys):
    model = copied(tiny, tmp_path)
    out = tmp_path / "theirs"
    if kind == "a saved model":  # another model of the user's, saved with save_pretrained
        shutil.copytree(tiny["gpt2"]["model"], out)
    elif kind == "a sharded model":
        out.mkdir()
        (out / "model-00001-of-00002.safetensors").write_bytes(b"x")
        (out / "model.safetensors.index.json").write_text("{}")
    else:
        shutil.copytree(tiny["gpt2"]["tokenizer"], out)
    more = ["--overwrite_output_dir"] if overwrite else []
    refused(args(tiny, model, out, *more), capsys, f"--output_dir '{out}' holds a saved model", "not a run",
            watch=[tmp_path])


@pytest.mark.parametrize("thing", ["a file", "a folder of the user's"])
@pytest.mark.parametrize("name", ["hf_model", "adapter"])
def test_the_export_folders_are_checked_at_the_start_not_after_training(thing, name, tiny, offline, tmp_path,  # noqa: F811
                                                                         capsys):
    model, out = copied(tiny, tmp_path), tmp_path / "run"
    out.mkdir()
    if thing == "a file":
        (out / name).write_text("mine")
    else:
        shutil.copytree(tiny["gpt2"]["model"], out / name)
    word = "is a file" if thing == "a file" else "is a folder this recipe did not write"
    refused(args(tiny, model, out), capsys, f"'{out / name}' {word}", "move it away", watch=[tmp_path])
    assert not (out / "config.yaml").exists()


@pytest.mark.slow
def test_a_finished_run_is_replaced_whole_and_a_resume_refuses_changed_sources(tiny, offline, tmp_path,  # noqa: F811
                                                                               capsys, monkeypatch):
    from transformers import AutoTokenizer

    from mixprec import models
    from mixprec.models import hf_export

    model, out = copied(tiny, tmp_path), tmp_path / "run"
    # the export writes the tokenizer the run loaded at its start, though the model's folder has moved away since
    export = hf_export.export

    def moved_first(*a, **k):
        model.rename(tmp_path / "moved")
        return export(*a, **k)

    monkeypatch.setattr(hf_export, "export", moved_first)
    run = run_in_process(args(tiny, model, out), capsys)
    assert run.returncode == 0, run.stderr[-3000:]
    monkeypatch.undo()
    (tmp_path / "moved").rename(model)
    assert (out / "hf_model" / "mixprec_export.json").is_file()
    ids = AutoTokenizer.from_pretrained(model)("def f(x): return x")["input_ids"]
    assert AutoTokenizer.from_pretrained(out / "hf_model")("def f(x): return x")["input_ids"] == ids

    # a finished run is known before any model or data is loaded
    def no_model(*a, **k):
        raise AssertionError("the model was built for a finished run")

    monkeypatch.setattr(models, "build", no_model)
    again = run_in_process(args(tiny, model, out, "--resume_from_checkpoint", "latest"), capsys)
    assert again.returncode == 0 and "finished at step 2: nothing to train" in again.stdout, again.stderr[-2000:]
    monkeypatch.undo()

    # the model's files changed since: refused in one line naming them, the run folder as it was (lock included)
    tokenizer = model / "tokenizer_config.json"
    tokenizer.write_text(tokenizer.read_text().replace("}", ', "model_max_length": 77}', 1))
    (out / "preempted.json").write_text("{}")  # as a signal leaves it: a refused resume must not remove it
    line = refused(args(tiny, model, out, "--resume_from_checkpoint", "latest", "--max_steps", 3), capsys,
                   "the model's files changed since checkpoint", "tokenizer_config.json of --model_name_or_path",
                   watch=[out, model])
    assert "start a new --output_dir" in line
    (out / "preempted.json").unlink()

    # --overwrite_output_dir leaves the new run alone in the folder: the old export goes with the old run
    new = run_in_process(["--output_dir", out, "--overwrite_output_dir", "--max_steps", 2, "--eval_steps", 2,
                          "--sample_tokens", 0], capsys)
    assert new.returncode == 0, new.stderr[-2000:]
    assert not (out / "hf_model").exists() and not (out / "sample.txt").exists()
    assert "mlp" in (out / "config.yaml").read_text()


@pytest.mark.slow
def test_overwriting_a_run_whose_export_folder_was_replaced_by_the_users_own_is_refused(tiny, offline,  # noqa: F811
                                                                                        tmp_path, capsys):
    model, out = copied(tiny, tmp_path), tmp_path / "run"
    assert run_in_process(args(tiny, model, out), capsys).returncode == 0
    shutil.rmtree(out / "hf_model")
    shutil.copytree(tiny["gpt2"]["model"], out / "hf_model")  # the user kept a model of theirs there since
    refused(args(tiny, model, out, "--overwrite_output_dir"), capsys, "a folder this recipe did not write",
            watch=[tmp_path])
