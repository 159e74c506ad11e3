"""Bad input: one line naming the bad value and the fix, exit code 2, no traceback, and nothing on disk changed.

Every case of the table runs through `recipes/train.py`'s `main` (the entry point, with its exit-code wrapper)
against a finished run, twice: with --overwrite_output_dir (a typo must not cost the old run) and with
--resume_from_checkpoint latest. Every file of the finished run is hashed before and after. A few cases also
run as real processes, through python and through `accelerate launch`."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, assert_one_line_error, base_env, free_port, run_in_process, run_recipe, snapshot

pytestmark = pytest.mark.slow
CONFIGS = REPO / "recipes" / "configs"
ROWS = "f0,f1,label\n"


def write(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def write_bytes(tmp: Path, name: str, data: bytes) -> Path:
    path = tmp / name
    path.write_bytes(data)
    return path


def damaged_csv(value: str) -> str:
    return ROWS + "".join(f"{i},{value if i == 7 else i},{i % 2}\n" for i in range(50))


def loop(tmp: Path) -> Path:
    (tmp / "loop").symlink_to(tmp / "loop")
    return tmp / "loop"


# name -> (args, words the one line must hold); a callable builds args from a scratch folder
CASES = {
    "unknown precision": (["--mixed_precision", "fp17"], ["'fp17'", "auto, no, fp16, bf16"]),
    "unknown flag": (["--learning_rate", "0.1"], ["--learning_rate", "did you mean --lr?", "--help"]),
    "an abbreviated flag": (["--max_step", "5"], ["--max_step", "did you mean --max_steps?"]),
    "a misspelt flag": (["--mixed_precison", "bf16"], ["--mixed_precison", "did you mean --mixed_precision?"]),
    "not a number": (["--batch_size", "many"], ["--batch_size", "'many'"]),
    "float for an integer": (["--batch_size", "3.5"], ["--batch_size", "'3.5'"]),
    "zero lr": (["--lr", "0"], ["--lr 0", "positive"]),
    "negative lr": (["--lr", "-0.001"], ["--lr -0.001"]),
    "NaN lr": (["--lr", "nan"], ["lr=nan", "finite"]),
    "infinite clipping": (["--max_grad_norm", "inf"], ["max_grad_norm=inf", "finite"]),
    "NaN weight decay": (["--weight_decay", "nan"], ["weight_decay=nan", "finite"]),
    "infinite init scale": (["--init_scale=-inf"], ["init_scale=-inf", "finite"]),
    "zero batch size": (["--batch_size", "0"], ["--batch_size 0"]),
    "zero epochs": (["--num_epochs", "0"], ["--num_epochs 0"]),
    "zero max steps": (["--max_steps", "0"], ["--max_steps 0"]),
    "negative checkpointing steps": (["--checkpointing_steps", "-5"], ["--checkpointing_steps -5"]),
    "negative seed": (["--seed", "-1"], ["--seed -1"]),
    "min lr ratio above 1": (["--min_lr_ratio", "1.5"], ["--min_lr_ratio 1.5", "between 0 and 1"]),
    "flat loss window of one": (["--flat_loss_window", "1"], ["--flat_loss_window 1", "2 or more"]),
    "bad W&B project": (["--project", "a/b"], ["--project 'a/b'", "W&B project"]),
    "a tag too long": (["--tags", "x" * 65], ["--tags", "64 characters"]),
    "unknown schedule": (["--lr_schedule", "warm"], ["'warm'", "constant, linear, cosine"]),
    "change allowed for nothing": (["--allow_config_change", "seed"], ["--allow_config_change seed", "lr"]),
    "change allowed without resume": (["--allow_config_change", "lr"], ["--allow_config_change", "resum"]),
    "missing config file": (["--config", "recipes/configs/nope.yaml"], ["nope.yaml", "recipes/configs/"]),
    "unknown config key": (lambda t: ["--config", write(t, "c.yaml", "model: mlp\nlearning_rate: 0.1\n")],
                           ["learning_rate", "c.yaml"]),
    "config not YAML": (lambda t: ["--config", write(t, "c.yaml", "model: [mlp\n")], ["not valid YAML"]),
    "config not a mapping": (lambda t: ["--config", write(t, "c.yaml", "- mlp\n")], ["mapping"]),
    "NaN in a config": (lambda t: ["--config", write(t, "c.yaml", "lr: .nan\n")], ["lr=nan", "finite"]),
    "a list for a number": (lambda t: ["--config", write(t, "c.yaml", "batch_size: [32, 64]\n")],
                            ["batch_size=[32, 64]", "not a valid int"]),
    "negative in a config": (lambda t: ["--config", write(t, "c.yaml", "batch_size: -4\n")], ["--batch_size -4"]),
    "unknown model": (["--model", "resnet9000"], ["'resnet9000'", "mlp"]),
    "unknown model setting": (["--model_args", "depth=3"], ["depth", "hidden"]),
    "model setting not a list": (["--model_args", "hidden=abc"], ["hidden='abc'", "a list of integers"]),
    "model setting of words": (["--model_args", "hidden=[a,b]"], ["hidden=['a', 'b']", "a list of integers"]),
    "model setting out of range": (["--model_args", "hidden=[0]"], ["hidden=[0]", "of at least 1"]),
    "unbalanced brackets": (["--model_args", "hidden=[1,2"], ["unbalanced brackets"]),
    "not key=value": (["--model_args", "depth"], ["'depth' is not key=value"]),
    "dropout out of range": (["--config", CONFIGS / "gpt_tiny.yaml", "--model_args", "dropout=1.5"],
                             ["dropout=1.5", "from 0 and below 1"]),
    "heads do not divide": (["--config", CONFIGS / "gpt_tiny.yaml", "--model_args", "n_head=3"],
                            ["n_embd=128", "n_head=3"]),
    "unknown dataset": (["--dataset", "imagenet"], ["'imagenet'", "synthetic"]),
    "unknown dataset setting": (["--dataset_args", "rows=5"], ["rows", "val_fraction"]),
    "validation share too big": (["--dataset_args", "val_fraction=1.5"], ["val_fraction=1.5", "below 1"]),
    "dataset setting a word": (["--dataset_args", "num_samples=many"], ["num_samples='many'", "integer"]),
    "model on the wrong data": (["--model", "cnn"], ["--model cnn", "images"]),
    "missing data file": (["--dataset", "file", "--train_file", "no/such.csv"], ["no/such.csv", "not found"]),
    "a text feature column": (lambda t: ["--dataset", "file", "--train_file",
                                         write(t, "d.csv", ROWS + "".join(f"{i},x{i},{i % 2}\n" for i in range(50)))],
                              ["column 'f1' is not numeric"]),
    "a label out of range": (lambda t: ["--dataset", "file", "--train_file",
                                        write(t, "d.csv", ROWS + "".join(f"{i},{i},{-1 if i == 7 else i % 2}\n"
                                                                         for i in range(50)))],
                             ["label -1", "outside 0..1"]),
    "labels that are not classes": (lambda t: ["--dataset", "file", "--train_file",
                                               write(t, "d.csv", ROWS + "".join(f"{i},{i},{i / 3}\n" for i in range(50)))],
                                    ["'label' column", "integer labels"]),
    "an empty data file": (lambda t: ["--dataset", "file", "--train_file", write(t, "d.csv", ROWS)], ["no rows"]),
    "a broken JSON line": (lambda t: ["--dataset", "file", "--train_file",
                                      write(t, "d.jsonl", '{"f0": 1, "label": 0}\n{"f0": 2, "label": \n')],
                           ["line 2 is not valid JSON"]),
    "no label column": (lambda t: ["--dataset", "file", "--train_file", write(t, "d.csv", "a,b\n1,2\n3,4\n")],
                        ["no 'label' column"]),
    "accumulation beyond an epoch": (["--gradient_accumulation_steps", "500"],
                                     ["fewer than one optimizer step", "16,000 samples"]),
    "tf32 on a CPU": (["--tf32"], ["--tf32", "cpu"]),
    "fp8 on a CPU": (["--mixed_precision", "fp8"], ["fp8", "no CUDA GPU"]),
    "activation checkpointing of an MLP": (["--activation_checkpointing"], ["--activation_checkpointing", "mlp"]),
    "bf16 master weights without bf16": (["--master_weights", "bf16"], ["--master_weights bf16", "bf16 autocast"]),
    "bf16 master weights under fp16": (["--mixed_precision", "fp16", "--master_weights", "bf16"],
                                       ["--master_weights bf16", "fp16"]),
    "bf16 update without bf16 master weights": (["--bf16_update", "round"], ["--bf16_update round",
                                                                             "--master_weights bf16"]),
    "missing resume path": (["--resume_from_checkpoint", "runs/none/step_1"], ["runs/none/step_1", "does not exist"]),
    "output folder is a file": (lambda t: ["--output_dir", write(t, "file.txt", "x")], ["is a file"]),
    "latest without output dir": (["--resume_from_checkpoint", "latest"], ["--output_dir"]),
    # values that pass their own checks but fail when the object is made, sizes, damaged data
    "GradScaler scale beyond float32": (["--mixed_precision", "fp16", "--init_scale", "1e300"], ["--init_scale 1e+300"]),
    "growth interval beyond int32": (["--mixed_precision", "fp16", "--growth_interval", str(2**40)],
                                     ["--growth_interval", "int32"]),
    "seed beyond 32 bits": (["--seed", str(2**32)], ["--seed 4294967296", "4294967295"]),
    "absurd lr": (["--lr", "1e300"], ["--lr 1e+300", "above 1"]),
    "weight decay that erases the weights": (["--weight_decay", "1e300"], ["--weight_decay 1e+300", "1 - lr x"]),
    "a train file for a dataset that reads none": (["--train_file", "no/such.csv"], ["no/such.csv", "not found"]),
    "a line break in a path": (["--dataset", "file", "--train_file", "no/su\nch\x1d.csv"], ["no/su\\nch\\x1d.csv"]),
    "more threads than cores": (["--cpu_threads", "1000"], ["--cpu_threads 1000", "usable cores"]),
    "config not UTF-8": (lambda t: ["--config", write_bytes(t, "c.yaml", b"lr: 0.001 # \xff\n")], ["not UTF-8"]),
    "a config key in a config": (lambda t: ["--config", write(t, "c.yaml", "config: other.yaml\n")], ["'config' key"]),
    "huge hidden layers": (["--model_args", "hidden=[1000000,1000000]"], ["hidden=[1000000, 1000000]", "memory"]),
    "terabytes of samples": (["--dataset_args", "num_samples=1000000000000"], ["num_samples=1000000000000", "memory"]),
    "a label of 2**31-1": (lambda t: ["--dataset", "file", "--train_file",
                                      write(t, "d.csv", ROWS + "".join(f"{i},{i},{2147483647 if i == 3 else i % 2}\n"
                                                                       for i in range(50)))],
                           ["num_classes 2147483648", "memory"]),
    "one-row CSV": (lambda t: ["--dataset", "file", "--train_file", write(t, "d.csv", ROWS + "1,2,0\n")],
                    ["1 row", "too few to split"]),
    "ragged CSV": (lambda t: ["--dataset", "file", "--train_file",
                              write(t, "d.csv", ROWS + "".join(f"{i},{i},{i % 2}\n" for i in range(50)) + "1,2,3,4\n")],
                   ["Expected 3 fields in line 52, saw 4"]),
    "NaN in a CSV": (lambda t: ["--dataset", "file", "--train_file", write(t, "d.csv", damaged_csv("nan"))],
                     ["row 8 (line 9), column 'f1'", "--allow_nonfinite_data"]),
    "inf in a CSV": (lambda t: ["--dataset", "file", "--train_file", write(t, "d.csv", damaged_csv("inf"))],
                     ["column 'f1' is inf", "--allow_nonfinite_data"]),
    "an empty field in a CSV": (lambda t: ["--dataset", "file", "--train_file", write(t, "d.csv", damaged_csv(""))],
                                ["row 8 (line 9), column 'f1' is NaN or empty"]),
    "NaN in JSON lines": (lambda t: ["--dataset", "file", "--train_file",
                                     write(t, "d.jsonl", "".join(f'{{"f0": {"NaN" if i == 7 else i}, "label": {i % 2}}}\n'
                                                                 for i in range(50)))],
                          ["d.jsonl", "row 8", "column 'f0'"]),
    "a JSON line with other keys": (lambda t: ["--dataset", "file", "--train_file",
                                               write(t, "d.jsonl", "".join(f'{{"f0": {i}, "label": {i % 2}}}\n'
                                                                           for i in range(50)) + '{"g0": 1, "label": 0}\n')],
                                    ["line 51", "column 'g0'", "same keys"]),
    "an empty text file": (lambda t: ["--model", "gpt_tiny", "--dataset", "text", "--train_file", write(t, "e.txt", "")],
                           ["e.txt", "no text"]),
    "a binary text file": (lambda t: ["--model", "gpt_tiny", "--dataset", "text", "--train_file",
                                      write_bytes(t, "b.txt", b"abc\n" * 10 + b"\0\x01\x02")], ["binary", "NUL byte"]),
    "a folder name of 300 characters": (lambda t: ["--output_dir", t / ("y" * 300)], ["300 bytes", "shorter name"]),
    "a link that loops": (lambda t: ["--output_dir", loop(t)], ["loop of symbolic links"]),
}
FOLDER_CASES = {"missing resume path", "output folder is a file", "latest without output dir",
                "a folder name of 300 characters", "a link that loops"}  # not combined
NOT_WITH_RESUME = {"change allowed without resume"}  # with --resume_from_checkpoint it is no mistake
BASE = ["--max_steps", "20", "--checkpointing_steps", "10", "--mixed_precision", "no"]  # the finished run's


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    run_recipe(*BASE, out=out, launcher="python")
    return out, snapshot(out)


def args_of(name: str, tmp: Path) -> list:
    args, words = CASES[name]
    return (args(tmp) if callable(args) else list(args)), words


def test_the_table_has_forty_distinct_cases():
    assert len(CASES) >= 40 and len({str(a) for a, _ in CASES.values()}) == len(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_leaves_a_finished_run_untouched(name, finished, tmp_path, capsys, monkeypatch,
                                                                   fresh_accelerate_state):
    monkeypatch.chdir(REPO)
    out, before = finished
    args, words = args_of(name, tmp_path)
    combos = [[*BASE, *args]] if name in FOLDER_CASES else [[*BASE, *args, "--output_dir", out, "--overwrite_output_dir"]]
    if name not in FOLDER_CASES | NOT_WITH_RESUME:
        combos.append([*BASE, *args, "--output_dir", out, "--resume_from_checkpoint", "latest"])
    for combo in combos:
        assert_one_line_error(run_in_process(combo, capsys), *words)
        assert snapshot(out) == before, combo


@pytest.mark.parametrize("name", ["unknown flag", "NaN lr", "a label out of range", "model setting out of range"])
def test_as_real_processes(name, finished, tmp_path):
    out, before = finished
    args, words = args_of(name, tmp_path)
    run = run_recipe(*args, "--overwrite_output_dir", out=out, launcher="python", check=False)
    assert_one_line_error(run, *words)
    launched = run_recipe(*args, "--overwrite_output_dir", out=out, check=False, launch_args=("-q",))
    assert launched.returncode != 0 and f"error: {assert_line(run)}" in launched.stderr  # accelerate launch: 1
    assert snapshot(out) == before


def assert_line(run) -> str:
    return run.stderr.strip().removeprefix("error: ")


def test_a_resume_that_would_also_replace_its_own_run_is_one_line(finished, capsys, monkeypatch,
                                                                   fresh_accelerate_state):
    """--resume_from_checkpoint (latest, or a checkpoint of the folder) with --overwrite_output_dir: the overwrite
    would remove the checkpoint the resume reads (found by tests/test_generated_input.py's slow YAML draws: a
    traceback from Accelerate's load_state after the folder was emptied). Refused before anything changes."""
    monkeypatch.chdir(REPO)
    out, before = finished
    for resume in ("latest", str(out / "checkpoints" / "step_0000010")):
        run = run_in_process([*BASE, "--max_steps", "22", "--output_dir", out, "--resume_from_checkpoint", resume,
                              "--overwrite_output_dir"], capsys)
        assert_one_line_error(run, "--overwrite_output_dir would remove it", "drop --overwrite_output_dir")
        assert snapshot(out) == before, resume


def test_an_existing_run_is_never_overwritten_by_accident(finished, tmp_path):
    out, before = finished
    again = run_recipe("--num_epochs", "1", out=out, launcher="python", check=False)
    assert_one_line_error(again, str(out), "--resume_from_checkpoint latest", "--overwrite_output_dir")
    assert snapshot(out) == before
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(out), str(copy)], check=True)
    replaced = run_recipe("--max_steps", "30", "--overwrite_output_dir", "--mixed_precision", "no", out=copy,
                          launcher="python")
    assert replaced.summary()["steps"] == 30  # asked for explicitly, once the new run is known to start
    assert sorted(p.name for p in (copy / "checkpoints").glob("step_*")) == ["step_0000030"]


def test_help_and_flag_errors_answer_before_torch_loads():
    """--help and a bad flag need only the settings: the recipe imports torch after them."""
    for args in (["--help"], ["--lr", "nan"]):
        code = ("import atexit, runpy, sys; sys.argv = ['train.py', *%r]\n"  # the recipe ends its process itself
                "atexit.register(lambda: print('torch' in sys.modules))\n"
                "runpy.run_path('recipes/train.py', run_name='__main__')" % (args,))
        proc = subprocess.run(["python", "-c", code], cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.stdout.strip().splitlines()[-1] == "False", proc.stdout + proc.stderr


def test_a_usage_error_on_every_process_is_said_once_even_when_the_main_process_is_last(tmp_path):
    """Only the main process says a usage error; the launcher stops the others when the first one exits. Were
    another process to exit first, the launcher would stop the main process before it had said anything."""
    script = tmp_path / "bad.py"
    script.write_text("import os, time\nfrom mixprec.errors import UsageError, exit_on_usage_error\n\n"
                      "@exit_on_usage_error\ndef main():\n    if os.environ['RANK'] == '0':\n        time.sleep(2)\n"
                      "    raise UsageError('--lr -1 is negative: give a positive --lr')\n\nmain()\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(script)], capture_output=True, text=True, env=base_env(), cwd=REPO,
                          timeout=120)
    assert proc.returncode != 0
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "--lr -1 is negative" in line]
    assert said == ["error: --lr -1 is negative: give a positive --lr"], proc.stderr[-3000:]
