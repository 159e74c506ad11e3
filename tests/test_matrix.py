"""Every model on every engine in every precision (tests/matrix.py), through Accelerate's launcher with the
repository's configs (helpers.ACCELERATE_LAUNCH: `accelerate launch`'s command without its console script).
Each cell that trains: the loss falls; model.safetensors, loaded into a fresh model, reproduces the reported
validation loss; and the cell agrees with one process at the same global batch (matrix.AGREEMENT). In one
model per engine x precision (in rotation: every model on several engines and precisions), a SIGKILL in the
middle plus --resume_from_checkpoint latest ends exactly (bitwise) where the uninterrupted run ends. A cell
that cannot run on a CPU stops before training with one line; where DeepSpeed has fp16 after all (oneDNN fp16),
one model per ZeRO stage trains in it (Cell.fp16_trained)."""
import importlib.util
import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import REPO, free_port, run_recipe
from matrix import AGREEMENT, BATCH_NORM, CELLS, CHECKPOINT, ENGINES, KILL, STEPS, Cell
from mixprec import config, data, models
from mixprec.data.batches import EvalBatches
from mixprec.evaluation import per_row

pytestmark = pytest.mark.slow
HF_FOLDER: list[Path] = []  # the tiny transformers models, made once (hf_folder)


@pytest.fixture(scope="module", autouse=True)
def hf_folder(tmp_path_factory):
    """A tiny bf16 Llama and a tiny BERT classifier (without dropout, as the other models) with its CSV (scripts/make_tiny_hf.py) and a small text file,
    made when the first cell of a transformers model needs them."""
    root = tmp_path_factory.mktemp("hf_models")

    def make() -> Path:
        if not HF_FOLDER:
            spec = importlib.util.spec_from_file_location("make_tiny_hf", REPO / "scripts" / "make_tiny_hf.py")
            tiny = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(tiny)
            tiny.make(root / "llama", "llama", "bfloat16")
            tiny.make_classifier(root / "bert")
            config = json.loads((root / "bert" / "model" / "config.json").read_text())  # no dropout: its masks
            config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # differ between processes
            (root / "bert" / "model" / "config.json").write_text(json.dumps(config))
            stdlib = Path(sysconfig.get_paths()["stdlib"])
            (root / "corpus.txt").write_text("".join((stdlib / n).read_text() for n in ("textwrap.py", "shlex.py")))
            HF_FOLDER.append(root)
        return HF_FOLDER[0]
    yield make
    HF_FOLDER.clear()


def launch(cell: Cell, out, *extra, **kwargs):
    accelerate_config, processes = ENGINES[cell.engine]
    port = ("--main_process_port", free_port()) if processes > 1 else ()
    hf = HF_FOLDER[0] if cell.model.startswith("hf_") else None  # helpers.base_env sets HF_HUB_OFFLINE
    return run_recipe(*cell.args(hf), *extra, out=out, config=accelerate_config,
                      launch_args=("--num_processes", processes, *port), **kwargs)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, hf_folder):
    """The one-process run of each (model, precision), made once: the reference of every other engine."""
    runs = {}

    def get(model: str, precision: str):
        if model.startswith("hf_"):
            hf_folder()
        if (model, precision) not in runs:
            cell = Cell(model, "one process", precision)
            runs[model, precision] = launch(cell, tmp_path_factory.mktemp(cell.id) / "run")
        return runs[model, precision]
    return get


def reloaded_val_loss(run) -> float:
    """The validation loss of model.safetensors in a fresh model, computed here as the run computed it (fp32;
    under DeepSpeed 16-bit, in the weights' own dtype, as DeepSpeed evaluates)."""
    saved = config.TrainConfig(**run.config()["config"])
    bundle = data.build(saved)
    model = models.build(saved.model, bundle.info, saved.model_args)
    weights = load_file(run.out / "model.safetensors")
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in weights.items()})
    dtype = next(v.dtype for v in weights.values() if v.is_floating_point())
    model.to(dtype).eval()
    total, rows = 0.0, 0
    with torch.no_grad():
        for batch in EvalBatches(bundle.validation, saved.eval_batch_size or saved.batch_size, 0, 1,
                                 torch.device("cpu")):
            inputs = batch["inputs"].to(dtype) if batch["inputs"].is_floating_point() else batch["inputs"]
            loss, _, targets = per_row(model(inputs), batch["labels"])
            total += loss.double().sum().item()
            rows += targets.double().sum().item()
    return total / rows


def close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel)


@pytest.mark.parametrize("cell", [c for c in CELLS if not c.refused], ids=lambda c: c.id)
def test_cell_trains_reloads_agrees_and_resumes_after_sigkill(cell, one_process, hf_folder, tmp_path):
    if cell.model.startswith("hf_"):
        hf_folder()
    whole = one_process(cell.model, cell.precision) if cell.engine == "one process" else launch(cell, tmp_path / "w")
    summary, losses = whole.summary(), [r["loss"] for r in whole.train_records()]
    assert summary["steps"] == STEPS and summary["world_size"] == ENGINES[cell.engine][1]
    assert summary["effective_precision"] == cell.precision and losses[-1] < losses[0], losses
    rel = 1e-2 if cell.engine.startswith("ZeRO") and cell.precision != "no" else 1e-5
    assert close(reloaded_val_loss(whole), summary["val_loss"], rel)

    if cell.killed:  # SIGKILL after step KILL, then resume in the same folder from its latest checkpoint
        killed = launch(cell, tmp_path / "k", faults=f"kill_at_step={KILL}", check=False)
        assert killed.returncode != 0 and (tmp_path / "k" / "checkpoints" / "latest").read_text() == \
            f"step_{CHECKPOINT:07d}"
        resumed = launch(cell, tmp_path / "k", "--resume_from_checkpoint", "latest")
        assert f"at step {CHECKPOINT}" in resumed.stdout
        assert resumed.comparable() == whole.comparable()  # every logged number, bitwise
        assert resumed.summary()["val_loss"] == summary["val_loss"]

    if cell.engine != "one process":
        reference = one_process(cell.model, cell.precision)
        tol = max(AGREEMENT[cell.engine, cell.precision], BATCH_NORM if cell.model == "cnn" else 0)
        pairs = [(a["loss"], b["loss"]) for a, b in zip(reference.train_records(), whole.train_records())]
        pairs.append((reference.summary()["val_loss"], summary["val_loss"]))
        worst = max(abs(b - a) / abs(a) for a, b in pairs)
        print(f"{cell.id}: largest relative difference from one process {worst:.2e} (allowed {tol:g})")
        assert len(pairs) == len(reference.train_records()) + 1 and worst <= tol


def refused_here(cell: Cell) -> bool:
    from mixprec.devices.distributed import deepspeed_cpu_fp16

    return cell.refused is not None and not deepspeed_cpu_fp16()


@pytest.mark.parametrize("cell", [c for c in CELLS if c.refused], ids=lambda c: c.id)
def test_a_cell_that_cannot_run_here_says_so_before_training(cell, one_process, hf_folder, tmp_path):
    trains = not refused_here(cell)  # this CPU has oneDNN fp16: DeepSpeed trains in fp16 here
    if trains and not cell.fp16_trained:  # one model per ZeRO stage (the suite's time: 15 s a cell, 2 processes each)
        pytest.skip("DeepSpeed has fp16 on this CPU: one model per ZeRO stage trains in it (Cell.fp16_trained)")
    if cell.model.startswith("hf_"):
        hf_folder()
    if trains:
        return test_cell_trains_reloads_agrees_and_resumes_after_sigkill(cell, one_process, hf_folder, tmp_path)
    run = launch(cell, tmp_path / "r", check=False)
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert lines == ["error: --mixed_precision fp16 with DeepSpeed on CPUs: DeepSpeed's CPU accelerator has no "
                     "fp16 on this CPU (it needs oneDNN fp16: AVX512-FP16 or AMX-FP16): use bf16 or fp32 with "
                     "DeepSpeed, or fp16 with multi_cpu.yaml (DDP)"]
    assert not (tmp_path / "r").exists()
