"""Generated bad input (Hypothesis): settings drawn from their declarations (tests/generated_input.py), in flags
and in a YAML config, and damaged data files, each run through `recipes/train.py`'s main in this process
against a copy of one finished run, with --overwrite_output_dir and with --resume_from_checkpoint latest.

The property, for every draw and both ways: exit 0 with a run whose losses are finite (unless the draw asked for
--allow_nonfinite_data); or exit 2 with one line, every file of the finished run as it was and nothing written
in the working folder; or a documented exit of a run that went bad (3 halted, 74 a refused write, 75 a signal)
with one line, the newest checkpoint still good. Never a traceback.

The quick tier runs a fixed-seed sample (derandomized); the slow tier (`-m slow`) many more.
"""
from __future__ import annotations

import math
import resource
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, Phase, example, given, settings as hsettings, strategies as st

import generated_input as gen
from helpers import REPO, run_in_process, run_recipe, snapshot

FINISHED = ["--max_steps", "20", "--checkpointing_steps", "10", "--mixed_precision", "no"]
MODES = {"overwrite": ["--overwrite_output_dir", "--max_steps", "3"],
         "resume": ["--resume_from_checkpoint", "latest", "--max_steps", "22"]}
DOCUMENTED_BAD_RUN = {3, 74, 75}  # mixprec/errors.py
QUICK = {"flags": 14, "yaml": 10, "tables": 10, "images": 4}  # examples per test in the quick tier
SLOW = {"flags": 100, "yaml": 70, "tables": 80, "texts": 20, "images": 20}
MEMORY_LIMIT = 12 * 2**30  # an allocation beyond it is a MemoryError (a traceback), not a machine out of memory


def tier(name: str, slow: bool):
    return hsettings(max_examples=(SLOW if slow else QUICK)[name], derandomize=True, deadline=None,
                     database=None, suppress_health_check=list(HealthCheck),
                     phases=[Phase.explicit, Phase.generate])  # no shrinking: each try is a run


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    run_recipe(*FINISHED, out=out, launcher="python")
    return out


@pytest.fixture
def sandbox(monkeypatch, fresh_accelerate_state):
    """Offline, W&B disabled (no service process left running), an address-space limit."""
    for key, value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
                       "TOKENIZERS_PARALLELISM": "false"}.items():
        monkeypatch.setenv(key, value)
    before = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, before)


def listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def losses_finite(out: Path) -> bool:
    from mixprec.tracking.jsonl import read_records

    values = [r[k] for r in read_records(out / "metrics.jsonl") for k in ("loss", "val_loss") if k in r]
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def check(finished: Path, args: list, capsys, monkeypatch, allow_nonfinite: bool = False) -> None:
    """The property, for `args` against a copy of the finished run, both ways."""
    for mode, extra in MODES.items():
        work = Path(tempfile.mkdtemp(prefix="draw-"))
        try:
            out = work / "run"
            shutil.copytree(finished, out, symlinks=True)
            (work / "cwd").mkdir()
            monkeypatch.chdir(work / "cwd")
            before = snapshot(out)
            run = run_in_process([*FINISHED, "--output_dir", out, *extra, *args], capsys)
            lines = [line for line in run.stderr.splitlines() if line.strip()]
            said = f"{mode} {args}: exit {run.returncode}\n{run.stderr[-1500:]}"
            assert "Traceback" not in run.stdout + run.stderr, said
            if run.returncode == 0:
                assert allow_nonfinite or not (out / "metrics.jsonl").is_file() or losses_finite(out), said
                continue
            assert len(lines) == 1 and lines[0].startswith("error: "), said
            if run.returncode == 2:
                assert snapshot(out) == before, said
                assert listing(work / "cwd") == set(), said
            else:
                from mixprec.run_folder.checkpointing import find

                assert run.returncode in DOCUMENTED_BAD_RUN, said
                assert find(out / "checkpoints")[0] is not None, said
        finally:
            monkeypatch.chdir(REPO)
            shutil.rmtree(work, ignore_errors=True)


def allows_nonfinite(drawn: dict) -> bool:
    return drawn.get("allow_nonfinite_data") is True


# --- settings ----------------------------------------------------------------------------------------------------

def flags_test(finished, capsys, monkeypatch, drawn):
    check(finished, gen.as_flags(drawn), capsys, monkeypatch, allows_nonfinite(drawn))


def yaml_test(finished, capsys, monkeypatch, drawn):
    folder = Path(tempfile.mkdtemp(prefix="yaml-"))
    try:
        path = folder / "c.yaml"
        path.write_text(gen.as_yaml(drawn))
        check(finished, ["--config", path], capsys, monkeypatch, allows_nonfinite(drawn))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@given(drawn=gen.settings())
@example(drawn={"weight_decay": 1e300})  # found by the property: exit 0 with NaN losses
@example(drawn={"train_file": "´", "seed": 0})  # found by the property: FileNotFoundError
@example(drawn={"train_file": "@\x91\U00057089\x1dwõ"})  # found by the property: a message of two lines
@tier("flags", slow=False)
def test_drawn_flags(finished, capsys, monkeypatch, sandbox, drawn):
    flags_test(finished, capsys, monkeypatch, drawn)


@given(drawn=gen.settings())
@example(drawn={"overwrite_output_dir": True})  # found by the property: with resume, a traceback from load_state
@tier("yaml", slow=False)
def test_drawn_yaml(finished, capsys, monkeypatch, sandbox, drawn):
    yaml_test(finished, capsys, monkeypatch, drawn)


@pytest.mark.slow
@given(drawn=gen.settings())
@tier("flags", slow=True)
def test_drawn_flags_many(finished, capsys, monkeypatch, sandbox, drawn):
    flags_test(finished, capsys, monkeypatch, drawn)


@pytest.mark.slow
@given(drawn=gen.settings())
@tier("yaml", slow=True)
def test_drawn_yaml_many(finished, capsys, monkeypatch, sandbox, drawn):
    yaml_test(finished, capsys, monkeypatch, drawn)


def test_every_declared_setting_is_drawn():
    """The draw is derived from the declarations: every TrainConfig field and every schema key is reachable."""
    from mixprec import data, models
    from mixprec.config import FIELDS

    assert set(FIELDS) == set(gen.FIELDS) and all(gen.field_value(name) is not None for name in FIELDS)
    for schema in [*(entry[1] for entry in models.REGISTRY.values()), *data.SCHEMAS.values()]:
        for spec in schema.values():
            assert gen.setting_value(spec) is not None


# --- damaged data files --------------------------------------------------------------------------------------------

def data_test(finished, capsys, monkeypatch, name: str, content: bytes, args: list, allow: bool):
    folder = Path(tempfile.mkdtemp(prefix="data-"))
    try:
        path = folder / name
        path.write_bytes(content)
        check(finished, [*args, "--train_file", path, *(["--allow_nonfinite_data"] if allow else [])], capsys,
              monkeypatch, allow)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@given(table=gen.table_file(), allow=st.booleans())
@tier("tables", slow=False)
def test_drawn_tables(finished, capsys, monkeypatch, sandbox, table, allow):
    data_test(finished, capsys, monkeypatch, *table, ["--dataset", "file"], allow)


@pytest.mark.slow
@given(table=gen.table_file(), allow=st.booleans())
@tier("tables", slow=True)
def test_drawn_tables_many(finished, capsys, monkeypatch, sandbox, table, allow):
    data_test(finished, capsys, monkeypatch, *table, ["--dataset", "file"], allow)


TEXT = ["--model", "gpt_tiny", "--dataset", "text", "--model_args", "n_layer=1,n_embd=32,n_head=2,block_size=16",
        "--batch_size", "4"]


@pytest.mark.slow
@given(content=gen.text_file())
@tier("texts", slow=True)
def test_drawn_texts(finished, capsys, monkeypatch, sandbox, content):
    data_test(finished, capsys, monkeypatch, "t.txt", content, TEXT, False)


def write_images(folder: Path, images) -> None:
    from PIL import Image

    for cls, number, damage in images:
        path = folder / cls / f"{number}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("L", (8, 8), color=number * 20).save(path)
        if damage == "truncated":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        elif damage == "empty":
            path.write_bytes(b"")
        elif damage == "not an image":
            path.write_text("not an image\n")


def images_test(finished, capsys, monkeypatch, images):
    folder = Path(tempfile.mkdtemp(prefix="images-"))
    try:
        write_images(folder / "imgs [1]", images)  # glob characters are taken literally
        check(finished, ["--model", "cnn", "--dataset", "imagefolder", "--model_args", "widths=[4],blocks=[1]",
                         "--dataset_args", "image_size=8", "--batch_size", "2", "--train_file", folder / "imgs [1]"],
              capsys, monkeypatch)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@given(images=gen.image_folder())
@tier("images", slow=False)
def test_drawn_image_folders(finished, capsys, monkeypatch, sandbox, images):
    images_test(finished, capsys, monkeypatch, images)


@pytest.mark.slow
@given(images=gen.image_folder())
@tier("images", slow=True)
def test_drawn_image_folders_many(finished, capsys, monkeypatch, sandbox, images):
    images_test(finished, capsys, monkeypatch, images)



def test_readme_and_docs_state_these_counts():
    from test_bad_input import CASES

    quick, slow = sum(QUICK.values()), sum(SLOW.values())
    readme = (REPO / "README.md").read_text()
    assert f"{len(CASES)} listed cases and {quick} generated draws\n  ({slow} in the slow tier" in readme
    docs = " ".join((REPO / "docs" / "checkpoints.md").read_text().split())
    assert f"{len(CASES)} bad inputs" in docs and f"quick tier runs {quick} draws ({2 * quick} runs)" in docs
    assert f"(`pytest -m slow`) {slow}." in docs
