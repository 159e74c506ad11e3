"""Bad input: one line naming the bad value and the fix, exit code 2, no traceback, nothing on disk damaged."""
import pytest

from helpers import REPO, assert_one_line_error, run_in_process, run_recipe, snapshot

pytestmark = pytest.mark.slow


CASES = {
    "unknown precision": (["--mixed_precision", "fp17"], ["'fp17'", "auto, no, fp16, bf16"]),
    "unknown flag": (["--learning_rate", "0.1"], ["--learning_rate", "--help"]),
    "not a number": (["--batch_size", "many"], ["--batch_size", "'many'"]),
    "zero lr": (["--lr", "0"], ["--lr 0", "positive"]),
    "negative lr": (["--lr", "-0.001"], ["--lr -0.001"]),
    "zero batch size": (["--batch_size", "0"], ["--batch_size 0"]),
    "zero epochs": (["--num_epochs", "0"], ["--num_epochs 0"]),
    "zero max steps": (["--max_steps", "0"], ["--max_steps 0"]),
    "negative checkpointing steps": (["--checkpointing_steps", "-5"], ["--checkpointing_steps -5"]),
    "accumulation beyond an epoch": (["--gradient_accumulation_steps", "500"], ["500", "200 batches"]),
    "missing config file": (["--config", "recipes/configs/nope.yaml"], ["nope.yaml", "recipes/configs/"]),
    "missing data file": (["--dataset", "file", "--train_file", "no/such.csv"], ["no/such.csv", "not found"]),
    "unknown dataset": (["--dataset", "imagenet"], ["'imagenet'", "synthetic"]),
    "unknown model": (["--model", "resnet9000"], ["'resnet9000'", "mlp"]),
    "unknown model setting": (["--model_args", "depth=3"], ["depth", "hidden"]),
    "missing resume path": (["--resume_from_checkpoint", "runs/none/step_1"], ["runs/none/step_1", "does not exist"]),
    "latest without output dir": (["--resume_from_checkpoint", "latest"], ["--output_dir"]),
}


# These run as their own `python recipes/train.py` process, start to exit; the other cases call the same
# `main` in the test's process (2 s less each: no interpreter and imports to start), through the same
# `exit_on_usage_error` wrapper that turns the error into one line and exit code 2.
IN_A_PROCESS = {"unknown precision", "unknown flag", "not a number", "missing config file",
                "accumulation beyond an epoch", "missing resume path"}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_flag_values(name, capsys, monkeypatch, fresh_accelerate_state):
    args, words = CASES[name]
    if name in IN_A_PROCESS:
        run = run_recipe(*args, launcher="python", check=False, cwd=None)
    else:
        monkeypatch.chdir(REPO)
        run = run_in_process(args, capsys)
    assert_one_line_error(run, *words)


def test_unknown_config_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: mlp\nlearning_rate: 0.1\n")
    assert_one_line_error(run_recipe("--config", bad, launcher="python", check=False), "learning_rate", "bad.yaml")
    bad.write_text("model: [mlp\n")
    assert_one_line_error(run_recipe("--config", bad, launcher="python", check=False), "not valid YAML")


def test_bad_values_in_a_config_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_size: -4\n")
    assert_one_line_error(run_recipe("--config", bad, launcher="python", check=False), "--batch_size -4")


def test_existing_run_is_never_overwritten_by_accident(tmp_path):
    out = tmp_path / "run"
    run_recipe("--num_epochs", "1", "--checkpointing_steps", "100", "--mixed_precision", "no", out=out,
               launcher="python")
    before = snapshot(out)
    again = run_recipe("--num_epochs", "1", out=out, launcher="python", check=False)
    assert_one_line_error(again, str(out), "--resume_from_checkpoint latest", "--overwrite_output_dir")
    assert snapshot(out) == before
    # through accelerate launch, too: the same line from the recipe (Accelerate then adds its own report)
    again = run_recipe("--num_epochs", "1", out=out, check=False)
    assert again.returncode != 0 and f"error: --output_dir '{out}' already holds a run" in again.stderr
    assert snapshot(out) == before
    # a bad resume path must not touch it either
    bad = run_recipe("--resume_from_checkpoint", out / "nope", out=out, launcher="python", check=False)
    assert_one_line_error(bad, "nope")
    assert snapshot(out) == before
    # asked for explicitly, the old run is replaced
    replaced = run_recipe("--num_epochs", "2", "--overwrite_output_dir", "--mixed_precision", "no", out=out,
                          launcher="python")
    assert replaced.summary()["steps"] == 400
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_0000400"]
