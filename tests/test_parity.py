"""Parity bands (recipes/parity.py, mixprec/parity.py): Student's t as the tables give it, the band's verdicts and
their false-alarm rate, bad input in one line with nothing written, and (slow) the committed band holding for
fp32 and bf16 runs of seeds it was not calibrated on, and a killed study resumed by running it again."""
from __future__ import annotations

import importlib.util
import json
import math
import random
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO, base_env, hooks_env, snapshot
from mixprec import parity

BAND_FILE = REPO / "tests" / "data" / "parity_band_mlp.json"
# the committed band's settings (the file records them): recipes/configs/mlp.yaml, 200 steps, evaluated every 50
BAND_FLAGS = ["--config", "recipes/configs/mlp.yaml", "--max_steps", "200", "--eval_steps", "50"]


def load_recipe():
    spec = importlib.util.spec_from_file_location("parity_recipe", REPO / "recipes" / "parity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("p, df, table", [(0.975, 1, 12.706), (0.975, 4, 2.776), (0.995, 10, 3.169),
                                          (0.975, 30, 2.042), (0.999, 4, 7.173), (0.9995, 7, 5.408)])
def test_t_quantiles_are_the_tables(p, df, table):
    assert parity.t_quantile(p, df) == pytest.approx(table, abs=1e-3)


def test_intervals_paired_and_welch():
    # scipy 1.x: stats.ttest_rel / ttest_ind(equal_var=False)'s confidence_interval(0.95) on these numbers
    mean, low, high = parity.interval([0.1, 0.3, -0.1, 0.2, 0.0])
    assert (mean, low, high) == pytest.approx((0.1, -0.09632, 0.29632), abs=1e-4)
    diff, low, high = parity.welch([1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 8.0, 10.0])
    assert (diff, low, high) == pytest.approx((-3.5, -7.38537, 0.38537), abs=1e-4)


def band_of(means: list[float], spread: float, n: int = 8) -> parity.Band:
    offsets = [spread * (i - (n - 1) / 2) for i in range(n)]
    return parity.Band(list(range(50, 50 * len(means) + 1, 50)), list(range(1, n + 1)),
                       [[m + o for o in offsets] for m in means])


def test_a_curve_out_of_the_band_is_named_with_its_step_and_distance():
    band = band_of([2.0, 1.0, 0.6, 0.5], spread=0.01)
    width = band.half_width(2)
    shifted = {s: {t: m + (1.1 * width[2] if t == 150 else 0.9 * width[i])
                   for i, (t, m) in enumerate(zip(band.steps, band.mean))} for s in (9, 10)}
    v = parity.verdict("bf16", shifted, band)
    assert not v.inside and [p["step"] for p in v.outside] == [150]
    assert v.outside[0]["by"] == pytest.approx(0.1 * width[2])
    assert "step 150" in v.where()
    inside = {s: {t: m + 0.9 * w for t, m, w in zip(band.steps, band.mean, width)} for s in (9, 10)}
    assert parity.verdict("bf16", inside, band).inside
    halted = {9: {50: 2.0, 100: 1.0}, 10: {50: 2.0, 100: 1.0, 150: math.nan, 200: math.nan}}
    v = parity.verdict("fp16", halted, band)
    assert [p["step"] for p in v.outside] == [150, 200] and "no finite loss" in v.where()
    assert v.final["method"].startswith("none")


def test_a_precision_that_skipped_every_step_is_not_trained_and_not_inside(tmp_path):
    """fp16 whose GradScaler skipped every step (activations beyond fp16's range) did not train: it is reported so,
    and not inside, even where its untouched model's loss lies in the band; skips short of all are counted."""
    band = band_of([2.0, 1.0, 0.6, 0.5], spread=0.01)
    width = band.half_width(2)
    inside = {s: {t: m + 0.5 * w for t, m, w in zip(band.steps, band.mean, width)} for s in (9, 10)}
    v = parity.verdict("fp16", inside, band, {9: (200, 200), 10: (3, 200)})
    assert not v.outside and v.untrained == [9] and not v.inside
    assert v.where().startswith("not trained (every optimizer step skipped in 1 of 2 seeds)")
    assert v.to_dict()["untrained_seeds"] == [9] and v.to_dict()["skipped_steps"] == {"9": [200, 200],
                                                                                      "10": [3, 200]}
    row = parity.table([v], "fp32")[-1]
    assert "| NO: not trained (every optimizer step skipped in 1 of 2 seeds) |" in row, row
    some = parity.verdict("fp16", inside, band, {9: (3, 200), 10: (0, 200)})
    assert some.inside and "| yes (3 of 400 optimizer steps skipped) |" in parity.table([some], "fp32")[-1]
    assert parity.verdict("fp16", inside, band).inside  # counts unknown (an older study): the band alone
    recipe = load_recipe()
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 150, "skipped_steps": 150}))
    assert recipe.read_skipped(tmp_path) == (150, 150) and recipe.read_skipped(tmp_path / "none") is None


def test_the_band_raises_false_alarms_at_most_alpha_of_the_time():
    """Seeds whose losses differ by noise only: a precision's mean of 2 seeds leaves the band (8 fp32 seeds, 4
    points, alpha 0.01) about 1% of the time, as the calibration promises (Bonferroni over independent points)."""
    rng, alarms, trials = random.Random(0), 0, 2000
    for _ in range(trials):
        fp32 = [[rng.gauss(1.0, 0.02) for _ in range(8)] for _ in range(4)]
        band = parity.Band([50, 100, 150, 200], list(range(1, 9)), fp32, floor=0.0)
        other = {s: {t: rng.gauss(1.0, 0.02) for t in band.steps} for s in (9, 10)}
        alarms += not parity.verdict("bf16", other, band).inside
    assert 0.002 < alarms / trials < 0.02


def test_the_final_difference_is_paired_over_shared_seeds_else_welch():
    band = parity.Band([100], [1, 2, 3], [[1.00, 1.10, 0.90]])
    paired = parity.verdict("bf16", {1: {100: 1.01}, 2: {100: 1.11}, 3: {100: 0.91}}, band).final
    assert paired["method"] == "paired t over 3 seeds" and paired["diff"] == pytest.approx(0.01)
    assert paired["high"] - paired["low"] < 1e-9  # the same shift on every seed: no doubt left
    unpaired = parity.verdict("bf16", {7: {100: 1.01}, 8: {100: 1.11}}, band).final
    assert unpaired["method"].startswith("Welch") and unpaired["high"] - unpaired["low"] > 0.1


def test_the_plot_draws_a_result(tmp_path):
    from mixprec.tracking.band_plot import plot_bands

    band = band_of([2.0, 1.0], spread=0.01)
    v = parity.verdict("bf16", {9: {50: 2.5, 100: 1.0}}, band)
    result = {"title": "t", "machine": "m", "band": band.to_dict(1),
              "precisions": {"bf16": {**v.to_dict(), "curves": {}}}}
    path = plot_bands(result, tmp_path / "parity.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, words", [
    (["--precisions", "fp32,bf32"], ["--precisions", "bf16-weights-stochastic"]),
    (["--seed", "3"], ["--seed", "--seeds"]),
    (["--master_weights", "bf16"], ["--master_weights", "bf16-weights-MODE"]),
    (["--seeds", "2"], ["at least 3 --seeds", "--band"]),
    (["--seeds", "1,x"], ["--seeds", "1,x"]),
    (["--lr", "-1"], ["--lr"]),
    (["--band", "tests/data/no-such-band.json"], ["--band", "no-such-band.json"]),
    (["--band", str(BAND_FILE), "--max_steps", "100"], ["--band", "other settings", "--max_steps 100"]),
    (["--precisions", "fp32,bf16-weights-round", "--fp32_modules", "net.0"], ["--fp32_modules", "bf16"]),
])
def test_bad_input_is_one_line_and_writes_nothing(argv, words, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "study"
    with pytest.raises(SystemExit) as exited:
        load_recipe().main([*argv, "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert all(w in err for w in words), err
    assert not out.exists()


def test_a_study_folder_of_other_settings_is_refused_untouched(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "study"
    out.mkdir()
    (out / "parity-settings.json").write_text(json.dumps({"config": {}, "flags": ["--lr", "1"]}))
    before = snapshot(out)
    with pytest.raises(SystemExit) as exited:
        load_recipe().main(["--output_dir", str(out)])
    assert exited.value.code == 2 and "other settings" in capsys.readouterr().err
    assert snapshot(out) == before


@pytest.mark.parametrize("argv, flags", [
    (["--config", "recipes/configs/gpt_tiny.yaml", "--eval_steps", "20"],
     ["--eval_steps", "20", "--checkpointing_steps", "20"]),
    (["--config", "recipes/configs/gpt_tiny.yaml"], ["--checkpointing_steps", "100"]),  # the config's eval_steps
    (["--max_steps", "300"], ["--max_steps", "300", "--eval_steps", "50", "--checkpointing_steps", "50"]),
])
def test_the_band_points_are_parity_s_eval_steps_else_the_config_s(argv, flags, monkeypatch):
    monkeypatch.chdir(REPO)
    recipe = load_recipe()
    common, settings = recipe.plan(*recipe.parse_args(argv))
    assert settings["flags"] == flags and common[2:] == flags


def parity_run(*args, env=None):
    return subprocess.run([sys.executable, str(REPO / "recipes" / "parity.py"), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=900, env=base_env(env))


@pytest.mark.slow
def test_the_committed_band_holds_for_fp32_and_bf16(tmp_path):
    """The CI check: fp32 and bf16, 2 seeds each that the band was not calibrated on, stay inside the committed
    fp32 band (benchmarks/results/cpu-parity-intel-amx/ci-band-calibration.md: how often this fails unchanged)."""
    proc = parity_run(*BAND_FLAGS, "--precisions", "fp32,bf16", "--seeds", "9,10", "--band", BAND_FILE,
                      "--output_dir", tmp_path / "check")
    left = [line for line in proc.stdout.splitlines() if "leaves the fp32 band" in line]
    assert proc.returncode == 0, "\n".join(left) or proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "check" / "parity.json").read_text())
    assert set(result["precisions"]) == {"fp32", "bf16"} and result["exit_code"] == 0
    assert all(p["inside"] for p in result["precisions"].values())
    assert (tmp_path / "check" / "parity.png").stat().st_size > 0
    assert sorted(p.name for p in (tmp_path / "check").iterdir() if p.is_dir()) == [
        "bf16-seed10", "bf16-seed9", "fp32-seed10", "fp32-seed9"]


@pytest.mark.slow
def test_a_killed_study_resumes_by_running_it_again(tmp_path):
    out = tmp_path / "study"
    args = [*BAND_FLAGS, "--precisions", "bf16", "--seeds", "11-11", "--band", BAND_FILE, "--output_dir", out]
    killed = parity_run(*args, env=hooks_env("kill_at_step=120"))  # after the checkpoint of step 100
    assert killed.returncode == 4 and "bf16-seed11.log" in killed.stderr, killed.stderr
    assert not (out / "bf16-seed11" / "summary.json").exists()
    again = parity_run(*args)
    assert again.returncode in (0, 1), again.stderr
    log = (out / "bf16-seed11.log").read_text()
    commands = [line for line in log.splitlines() if line.startswith("$ ")]
    assert len(commands) == 2 and "--resume_from_checkpoint latest" in commands[1]
    steps = [json.loads(x)["step"] for x in (out / "bf16-seed11" / "metrics.jsonl").read_text().splitlines()
             if "val_loss" in x]
    assert sorted(set(steps)) == [50, 100, 150, 200]
    third = parity_run(*args)
    assert "bf16 seed 11: reused" in third.stdout and third.returncode == again.returncode


@pytest.mark.slow
def test_a_signal_to_parity_reaches_the_run_which_checkpoints(tmp_path):
    """SIGTERM to parity goes to the running run (its own session): it saves a checkpoint and exits 75, and so
    does parity; the same command then resumes it."""
    out, release = tmp_path / "study", tmp_path / "release"
    release.mkdir()
    args = [*BAND_FLAGS, "--precisions", "bf16", "--seeds", "12-12", "--band", BAND_FILE, "--output_dir", out]
    proc = subprocess.Popen([sys.executable, str(REPO / "recipes" / "parity.py"), *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=base_env(hooks_env("pause_at_step=60", release=release)))
    log = out / "bf16-seed12.log"
    deadline = time.monotonic() + 300  # a bound on a hang, not a measurement
    while not (log.is_file() and "paused at step 60" in log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    while not (release / "signalled-0").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    (release / "60").touch()
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 75 and "run the same command again" in stderr, stderr
    assert (out / "bf16-seed12" / "preempted.json").is_file()
    again = parity_run(*args)
    commands = [line for line in log.read_text().splitlines() if line.startswith("$ ")]
    assert again.returncode in (0, 1) and "--resume_from_checkpoint latest" in commands[-1], again.stderr


@pytest.mark.slow
def test_what_only_a_run_finds_is_the_run_s_own_line(tmp_path):
    """A file that does not exist passes the flags' parsing; the first run refuses it: parity says the run's line
    (naming the precision and seed) with exit code 2, and no run folder was made."""
    out = tmp_path / "study"
    proc = parity_run("--precisions", "fp32", "--seeds", "3", "--max_steps", "5", "--dataset", "file",
                      "--train_file", tmp_path / "missing.csv", "--output_dir", out)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: fp32 seed 1: --train_file") and "missing.csv" in lines[0]
    assert sorted(p.name for p in out.iterdir()) == ["fp32-seed1.log", "parity-settings.json"]
