"""Exporting a finished run again (recipes/export.py, and --save_dtype on the resume of a finished run), offline on
the tiny transformers models of tests/test_hf_models.py: a bf16-stored Llama trained 12 steps, exported again in
fp16 and fp32 (the files' dtypes, from_pretrained, the run's validation loss), a LoRA run exported merged and not,
and bad input: one line, exit code 2, the run folder and the model's folder unchanged (hashed before and after)."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers import REPO, Run, assert_one_line_error, main_in_process, reset_accelerate, run_in_process, snapshot
from test_hf_models import common, export_val_loss, offline, tiny, val_loss  # noqa: F401 (fixtures)
from test_lora import base_and_adapter


def export_again(args, capsys) -> Run:
    """recipes/export.py's main in this process (its exit code: 0 when it returns), as a fresh process runs it."""
    reset_accelerate()
    capsys.readouterr()  # what the test itself printed before (a loading bar) is not the recipe's
    spec = importlib.util.spec_from_file_location("export_recipe", REPO / "recipes" / "export.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    try:
        recipe.main([str(a) for a in args])
        code = 0
    except SystemExit as exited:
        code = exited.code
    out, err = capsys.readouterr()
    return Run(code, out, err, None)


def train_args(tiny, model: Path, out: Path, *extra) -> list:
    return ["--model_name_or_path", model, *common(tiny, out), "--mixed_precision", "bf16", *extra]


@pytest.fixture(scope="module")
def finished(tiny, tmp_path_factory):
    """A finished run of the tiny bf16-stored Llama (12 steps, bf16 autocast, its export in bf16), trained on a
    copy of the model's folder (a test changes it): {"args", "run", "model"}. Tests copy the run folder."""
    root = tmp_path_factory.mktemp("finished")
    model = root / "model"
    shutil.copytree(tiny["llama_bf16"]["model"], model)
    args = train_args(tiny, model, root / "run")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        main_in_process(args)
    return {"args": args, "run": root / "run", "model": model}


def copy_of(finished, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished["run"], run)
    return run


def dtypes(folder: Path) -> set:
    return {t.dtype for t in load_file(folder / "model.safetensors").values()}


@pytest.mark.slow
def test_a_finished_bf16_run_exports_again_in_fp16_and_fp32_and_reproduces_its_loss(finished, offline, tmp_path,
                                                                                    capsys):
    run, args = copy_of(finished, tmp_path), finished["args"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["hf_export"]["dtype"] == "bfloat16"
    # measured when written: fp16 1e-5 and fp32 4e-8 nats from the run's val_loss (of about 5.5; bf16 1.5e-4):
    # fp16 keeps 11 bits of mantissa where bf16 (2e-3 in tests/test_hf_models.py) keeps 8; fp32 holds the masters
    for name, dtype, tolerance in (("fp16", torch.float16, 1e-3), ("fp32", torch.float32, 1e-5)):
        done = export_again([run, "--save_dtype", name], capsys)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"exported {run / 'hf_model'} with save_pretrained in {dtype}".replace("torch.", "") in done.stdout
        assert "range audit" in done.stdout or "all 21 tensors finite" in done.stdout
        assert dtypes(run / "hf_model") == {dtype}
        assert json.loads((run / "hf_model" / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
        assert (run / "hf_model" / "tokenizer.json").is_file() and (run / "hf_model" / "mixprec_export.json").is_file()
        loss = export_val_loss(args, run / "hf_model", dtype)
        assert abs(loss - summary["val_loss"]) < tolerance, (name, loss, summary["val_loss"])
        recorded = json.loads((run / "summary.json").read_text())["hf_export"]
        assert recorded["status"] == "saved" and recorded["dtype"] == str(dtype).removeprefix("torch.")
    history = yaml.safe_load((run / "config.yaml").read_text())["history"]
    assert [h["event"] for h in history] == ["started", "exported", "exported"]
    assert history[-1]["hf_export"]["dtype"] == "float32" and history[-1]["step"] == 12
    # the final checkpoint, exported elsewhere: the same weights; summary.json still names the run's own export
    elsewhere = tmp_path / "exports" / "fp32"
    done = export_again([run, "--checkpoint", "latest", "--save_dtype", "fp32", "--output_dir", elsewhere], capsys)
    assert done.returncode == 0, done.stderr[-3000:]
    mine, theirs = load_file(elsewhere / "model.safetensors"), load_file(run / "hf_model" / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert json.loads((run / "summary.json").read_text())["hf_export"]["path"] == str(run / "hf_model")
    assert yaml.safe_load((run / "config.yaml").read_text())["history"][-1]["hf_export"]["path"] == str(elsewhere)


@pytest.mark.slow
def test_the_resume_of_a_finished_run_with_another_save_dtype_exports_it_again(finished, offline, tmp_path, capsys):
    run = copy_of(finished, tmp_path)
    resumed = run_in_process(["--resume_from_checkpoint", "latest", "--output_dir", run, "--save_dtype", "fp16"],
                             capsys)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "finished at step 12 and --save_dtype fp16 asks for another export than its own" in resumed.stdout
    assert dtypes(run / "hf_model") == {torch.float16}
    assert json.loads((run / "summary.json").read_text())["hf_export"]["dtype"] == "float16"
    before = snapshot(run)
    again = run_in_process(["--resume_from_checkpoint", "latest", "--output_dir", run, "--save_dtype", "fp16"], capsys)
    assert again.returncode == 0 and "nothing to train" in again.stdout and snapshot(run) == before


@pytest.mark.slow
def test_a_lora_run_exports_again_merged_and_not(tiny, offline, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    base = tiny["llama_bf16"]["model"]
    args = train_args(tiny, base, tmp_path / "run", "--use_peft")
    run = tmp_path / "run"
    trained = run_in_process(args, capsys)
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert "hf_export" not in summary and not (run / "hf_model").exists()
    first = (run / "adapter" / "adapter_model.safetensors").read_bytes()
    done = export_again([run], capsys)  # not merged, as the run: the fp32 adapter again, the same bytes
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run / "adapter" / "adapter_model.safetensors").read_bytes() == first
    assert abs(val_loss(args, base_and_adapter(base, run / "adapter")) - summary["val_loss"]) < 1e-5
    # measured: the adapter 1.1e-7 and the fp32 merged export 1.3e-7 nats from the run's val_loss; 12 steps move
    # the loss 0.025 from the base's (tests/test_lora.py), so the bounds catch a missing adapter
    done = export_again([run, "--merge_lora", "--save_dtype", "fp32"], capsys)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LoRA merged in fp32" in done.stdout and dtypes(run / "hf_model") == {torch.float32}
    assert abs(val_loss(args, AutoModelForCausalLM.from_pretrained(run / "hf_model")) - summary["val_loss"]) < 1e-4
    merged = json.loads((run / "summary.json").read_text())["hf_export"]
    assert merged["status"] == "saved" and merged["merged_lora"]["merged_tensors"] == 4
    assert (run / "adapter" / "adapter_model.safetensors").read_bytes() == first  # left as it was
    refused = export_again([run, "--no-merge_lora", "--save_dtype", "fp16"], capsys)
    assert_one_line_error(refused, "--save_dtype fp16", "--merge_lora")


def audit_refuses(finished, tmp_path: Path, capsys) -> None:
    """An export the range audit refuses (an fp16 overflow): one line (the audit's, on stdout), exit code 1,
    nothing written."""
    from safetensors.torch import save_file

    run = copy_of(finished, tmp_path)
    weights = load_file(run / "model.safetensors")
    name = next(k for k in weights if k.endswith("lm_head.weight"))
    weights[name][0, 0] = 1e5  # beyond fp16's 65504, within bf16's range
    save_file(weights, run / "model.safetensors")
    before = snapshot(run)
    refused = export_again([run, "--save_dtype", "fp16"], capsys)
    lines = [line for line in refused.stdout.splitlines() if line.startswith("export refused")]
    assert refused.returncode == 1 and len(lines) == 1, refused.stdout[-2000:]
    assert "lm_head.weight" in lines[0] and "python recipes/export.py RUN_FOLDER --save_dtype bf16" in lines[0]
    assert snapshot(run) == before


def bad_inputs(finished, tmp_path: Path) -> dict:
    """{case: (args, words the line names)}; the folders they need made under tmp_path."""
    run = copy_of(finished, tmp_path)
    unfinished = tmp_path / "unfinished"
    shutil.copytree(run, unfinished)
    (unfinished / "model.safetensors").unlink()
    builtin = tmp_path / "builtin"
    shutil.copytree(run, builtin)
    saved = yaml.safe_load((builtin / "config.yaml").read_text())
    (builtin / "config.yaml").write_text(yaml.safe_dump({**saved, "config": {**saved["config"], "model": "mlp"}}))
    users = tmp_path / "users"
    shutil.copytree(run, users)
    (users / "hf_model" / "mixprec_export.json").unlink()  # someone's own model where the export goes
    (tmp_path / "empty").mkdir()
    return {
        "not a run folder": ([tmp_path / "empty"], ["is not a run folder", "config.yaml"]),
        "not a transformers run": ([builtin], ["--model mlp", "not a transformers model"]),
        "a missing checkpoint": ([run, "--checkpoint", run / "checkpoints" / "step_0000099"], ["--checkpoint",
                                                                                               "no such folder"]),
        "an unfinished run": ([unfinished], ["has no model.safetensors", "--checkpoint latest"]),
        "a user's folder": ([users, "--save_dtype", "fp16"], ["did not write", "mixprec_export.json"]),
        "a folder inside the model's": ([run, "--output_dir", finished["model"] / "fp16"], ["which the run only reads"]),
        "--merge_lora without LoRA": ([run, "--merge_lora"], ["no --use_peft", "nothing to merge"]),
        "a dtype that does not exist": ([run, "--save_dtype", "fp8"], ["--save_dtype", "fp8"]),
        "the model's files changed": ([run, "--save_dtype", "fp16"], ["model's files changed", "config.json"]),
    }


def test_bad_input_is_one_line_exit_2_and_an_export_the_audit_refuses_exit_1_and_both_change_nothing(
        finished, offline, tmp_path, capsys):
    audit_refuses(finished, tmp_path / "audit", capsys)  # the one test here that trains (the module's run)
    cases = bad_inputs(finished, tmp_path / "bad")
    config_json = finished["model"] / "config.json"
    text, untouched = config_json.read_text(), snapshot(finished["model"])
    for case, (args, words) in cases.items():
        if case == "the model's files changed":
            config_json.write_text(text.replace("{", '{"mixprec_test_note": 1,', 1))  # a field added
        before, model = snapshot(tmp_path / "bad"), snapshot(finished["model"])
        try:
            done = export_again(args, capsys)
            assert snapshot(finished["model"]) == model, case
        finally:
            config_json.write_text(text)
        if case == "a dtype that does not exist":  # argparse's own line (usage first): exit code 2
            assert done.returncode == 2 and "invalid choice: 'fp8'" in done.stderr, case
        else:
            assert_one_line_error(done, *words)
        assert snapshot(tmp_path / "bad") == before, case
    assert snapshot(finished["model"]) == untouched
