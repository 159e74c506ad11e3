"""benchmarks/step_profile.py: one step of the recipe and of the Accelerate peer on a tiny GPT-2, profiled and
summed into phases that add up to the step (no timing is checked)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import yaml

from helpers import REPO, base_env

pytestmark = pytest.mark.slow  # two profiled runs of a transformers model (19 s), two rounds side by side, a round in turn


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_tiny_hf", REPO / "scripts" / "make_tiny_hf.py")
    make_tiny_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny_hf)
    return make_tiny_hf.make(tmp_path_factory.mktemp("tiny") / "gpt2", "gpt2", "float32")


def on_tiny(tiny, script: str, *args, max_steps: int = 6) -> subprocess.CompletedProcess:
    """`script args -- FLAGS`, FLAGS: the tiny GPT-2 in fp32, `max_steps` steps logged every 3; it must succeed."""
    proc = subprocess.run(
        [sys.executable, script, *args, "--", "--config", "recipes/configs/hf_gpt2_small.yaml", "--config_name",
         str(tiny["config"]), "--tokenizer_name", str(tiny["tokenizer"]), "--block_size", "64", "--batch_size", "4",
         "--mixed_precision", "no", "--max_steps", str(max_steps), "--log_every", "3"], cwd=REPO,
        capture_output=True, text=True, timeout=600, env=base_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def refuses_a_used_folder(script: str, out, *flags) -> None:
    """`script --output_dir out -- flags` with `out` holding a report: one line, exit code 2."""
    again = subprocess.run([sys.executable, script, "--output_dir", str(out), "--", *flags], cwd=REPO,
                           capture_output=True, text=True, env=base_env())
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"error: --output_dir {out} is not a new or empty folder"]


@pytest.mark.parametrize("runner", ["recipe", "hf_accelerate"])
def test_a_profiled_step_is_summed_into_its_phases(tiny, tmp_path, runner):
    out = tmp_path / "profile.json"
    extra = ["--overwrite_output_dir", "--report_to", "none", "--sample_tokens", "0"] if runner == "recipe" else []
    proc = subprocess.run(
        [sys.executable, "benchmarks/step_profile.py", "--runner", runner, "--at", "2", "--steps", "2", "--output",
         str(out), "--step_times", str(tmp_path / "times.json"), "--", "--config", "recipes/configs/hf_gpt2_small.yaml", "--config_name", str(tiny["config"]),
         "--tokenizer_name", str(tiny["tokenizer"]), "--block_size", "64", "--batch_size", "4",
         "--mixed_precision", "bf16", "--max_steps", "5", "--log_every", "50", "--output_dir", str(tmp_path / "run"),
         *extra], cwd=REPO, capture_output=True, text=True, timeout=600, env=base_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    phases = report["phases_s_per_step"]
    assert report["steps"] == [3, 4] and f"{runner}: steps 3-4" in proc.stdout
    for name in ("forward", "loss", "backward", "clip", "optimizer"):
        assert phases[name] > 0, name
    assert phases["fp32 copy of the output"] > 0  # bf16 autocast: Accelerate's convert_to_fp32 of the outputs
    assert sum(phases.values()) == pytest.approx(report["wall_s_per_step"])
    kernel = report["process_per_step"]  # the kernel's counts of the same steps
    assert kernel["minor_faults"] >= 0 and kernel["user_s"] > 0 and kernel["system_s"] >= 0
    assert "minor page faults" in proc.stdout
    times = json.loads((tmp_path / "times.json").read_text())  # written at the exit, every step's
    assert times["runner"] == runner and len(times["step_times_s"]) == 5 and min(times["step_times_s"]) > 0


def test_side_by_side_runs_both_at_once_on_swapped_cores_and_compares_the_steps_that_do_not_log(tiny, tmp_path):
    """benchmarks/side_by_side.py: two rounds of the recipe and the Accelerate peer at the same time, 1 thread each,
    the cores swapped in the second round; the steps compared leave out the first and the logging steps."""
    out = tmp_path / "sbs"
    on_tiny(tiny, "benchmarks/side_by_side.py", "--rounds", "2", "--output_dir", str(out))
    report = json.loads((out / "side_by_side.json").read_text())
    first, second = report["rounds"]
    assert [first["recipe"]["core"], first["hf_accelerate"]["core"]] == sorted(os.sched_getaffinity(0))[:2]
    assert (second["recipe"]["core"], second["hf_accelerate"]["core"]) == (first["hf_accelerate"]["core"],
                                                                           first["recipe"]["core"])
    for r in report["rounds"]:
        for runner in ("recipe", "hf_accelerate"):
            assert len(r[runner]["step_times_s"]) == 6 and r[runner]["steps_compared"] == 3  # steps 2, 4, 5
            assert "--cpu_threads 1" in r[runner]["command"]
        assert r["recipe_over_peer"] == pytest.approx(r["hf_accelerate"]["median_step_s"] / r["recipe"]["median_step_s"])
        means = [sum(r[x]["step_times_s"][1:]) / 5 for x in ("hf_accelerate", "recipe")]  # the logging steps in
        assert r["recipe_over_peer_all_steps"] == pytest.approx(means[0] / means[1])
    assert report["recipe_over_peer"] == pytest.approx((first["recipe_over_peer"] * second["recipe_over_peer"]) ** 0.5)
    assert report["recipe_over_peer_all_steps"] == pytest.approx(
        (first["recipe_over_peer_all_steps"] * second["recipe_over_peer_all_steps"]) ** 0.5)
    assert "geometric mean of 2 rounds" in (out / "side_by_side.md").read_text()
    refuses_a_used_folder("benchmarks/side_by_side.py", out, "--max_steps", "2", "--log_every", "1")
    for flags, words in ((["--max_steps", "2", "--log_every", "1"], "leave no step to compare"),
                         (["--max_steps=x", "--log_every", "3"], "--max_steps 'x' is not a whole number"),
                         (["--max_steps", "6"], "give --log_every after `--`")):
        bad = subprocess.run([sys.executable, "benchmarks/side_by_side.py", "--output_dir", str(tmp_path / "new"),
                              "--", *flags], cwd=REPO, capture_output=True, text=True, env=base_env())
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(lines) == 1 and words in lines[0], bad.stderr
    assert not (tmp_path / "new").exists()


def test_rounds_of_whole_runs_split_each_window_into_its_logging_and_its_ordinary_steps(tiny, tmp_path):
    """benchmarks/step_times_rounds.py: a round of the recipe with its checks off and the Accelerate peer (the order
    of later rounds is recipes/benchmark.py's round_order, tested in tests/test_benchmark_report.py); each window
    (steps 4-6 of 7 logged every 3) split into the step after the first logging step (4), the ordinary step (5)
    and the logging step (6), and the rows' speed ratio."""
    out = tmp_path / "rounds"
    proc = on_tiny(tiny, "benchmarks/step_times_rounds.py", "--runners", "hf_accelerate,recipe_checks_off",
                   "--rounds", "1", "--output_dir", str(out), max_steps=7)
    started = [line for line in proc.stdout.splitlines() if line.startswith("[round 1]")]
    assert [line.split("--runner ")[1].split()[0] for line in started] == ["recipe", "hf_accelerate"]
    assert "--no-health_checks --no-lost_updates" in started[0] and "--report_to none" in started[0]
    assert "--no-health_checks" not in started[1] and "--report_to" not in started[1]
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["rounds"]["1"]
    assert summary["rows"] == ["recipe_checks_off", "hf_accelerate"] == rows["hf_accelerate"]["order"]
    for row, x in rows.items():
        record = json.loads((out / f"{row}-r1.json").read_text())
        times = record["step_times_s"]
        assert len(times) == 7  # step 7 ends the run but is past the last logging step: not in the window
        assert x["window_s"] == pytest.approx(sum(times[3:6]) / 3)
        assert x["ordinary_s"] == pytest.approx(times[4])
        assert x["after_log_extra_s"] == pytest.approx(times[3] - times[4])
        assert x["log_step_extra_s"] == pytest.approx(times[5] - times[4])
        fifth = record["step_process"][4]  # the ordinary step's own kernel counts
        assert x["ordinary_cpu_s"] == pytest.approx(fifth["user_s"] + fifth["system_s"]) and x["ordinary_cpu_s"] > 0
        assert x["ordinary_busy_cores"] == pytest.approx(x["ordinary_cpu_s"] / times[4])
        assert x["ordinary_minor_faults"] == fifth["minor_faults"]
    for part in ("window", "ordinary", "ordinary_cpu"):
        speed = summary["speed"][f"recipe_checks_off/hf_accelerate {part}"]
        a, b = (rows[row][f"{part}_s"] for row in ("recipe_checks_off", "hf_accelerate"))
        assert speed["rounds"] == [pytest.approx(b / a)]
        assert speed["behind"] == (speed["rounds"][0] < 1)
    md = (out / "summary.md").read_text()
    assert "| recipe_checks_off/hf_accelerate ordinary_cpu |" in md and "minor faults" in md
    rendered = json.loads(json.dumps(summary))  # the folder rendered again from its step times: the same summary
    (out / "summary.md").unlink()
    subprocess.run([sys.executable, "benchmarks/step_times_rounds.py", "--render", str(out)], cwd=REPO, check=True,
                   capture_output=True)
    assert json.loads((out / "summary.json").read_text()) == rendered and (out / "summary.md").read_text() == md
    refuses_a_used_folder("benchmarks/step_times_rounds.py", out, "--max_steps", "6", "--log_every", "3")


def test_side_by_side_taking_turns_runs_one_step_of_each_at_a_time_with_their_own_threads(tiny, tmp_path):
    """benchmarks/side_by_side.py --turns: from the second step on, the recipe's and the peer's steps never overlap
    and alternate, the recipe first in round 1 and the peer in round 2; no thread count or core is imposed."""
    out = tmp_path / "turns"
    on_tiny(tiny, "benchmarks/side_by_side.py", "--turns", "--rounds", "2", "--output_dir", str(out))
    report = json.loads((out / "side_by_side.json").read_text())
    assert report["turns"] is True and [r["first"] for r in report["rounds"]] == ["recipe", "hf_accelerate"]
    for r in report["rounds"]:
        spans = []
        for runner in ("recipe", "hf_accelerate"):
            x = r[runner]
            assert "--cpu_threads" not in x["command"] and x["core"] is None
            assert x["step_times_s"] == pytest.approx([end - start for start, end in x["step_spans"]])
            spans += [(start, end, runner) for start, end in x["step_spans"][1:]]  # steps 2-6
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # one step at a time
        second = "hf_accelerate" if r["first"] == "recipe" else "recipe"
        assert [runner for *_, runner in spans] == [r["first"], second] * 5
    table = (out / "side_by_side.md").read_text()
    assert "taking turns step by step" in table and "| 2 | hf_accelerate |" in table


def test_side_by_side_measures_one_check_against_the_same_recipe_without_the_checks(tiny, tmp_path):
    """--peer recipe_checks_off --recipe_flags=--no-lost_updates: both sides are recipes/train.py, the peer with
    recipes/benchmark.py's checks-off flags, the recipe with the health checks alone; each run's config.yaml says
    so, and each step's kernel counts are kept beside its time."""
    out = tmp_path / "one-check"
    on_tiny(tiny, "benchmarks/side_by_side.py", "--turns", "--rounds", "1", "--peer", "recipe_checks_off",
            "--recipe_flags=--no-lost_updates", "--output_dir", str(out))
    report = json.loads((out / "side_by_side.json").read_text())
    assert report["peer"] == "recipe_checks_off" and report["recipe_flags"] == ["--no-lost_updates"]
    for side, checks in (("recipe", True), ("recipe_checks_off", False)):
        ran = yaml.safe_load((out / f"{side}-1" / "run" / "config.yaml").read_text())["config"]
        assert (ran["health_checks"], ran["lost_updates"]) == (checks, False), side
        kept = json.loads((out / f"{side}-1" / "step_times.json").read_text())
        assert len(kept["step_process"]) == len(kept["step_times_s"]) == 6
        assert report["rounds"][0][side]["step_process"] == kept["step_process"]
        assert all(x["minor_faults"] >= 0 and x["user_s"] >= 0 for x in kept["step_process"])
        user = [x["user_s"] for x in kept["step_process"]]  # each step's own: the first holds the start-up
        assert max(user) == user[0] > 3 * max(user[1:]), user
    table = (out / "side_by_side.md").read_text()
    assert "Flags given to the recipe only:\n\n    --no-lost_updates" in table
    assert "recipe_checks_off is the recipe with --no-health_checks --no-lost_updates." in table


def test_the_step_code_benchmark_alternates_the_recipes_step_and_the_peers_in_one_process(tiny, tmp_path):
    """benchmarks/step_code.py: the recipe's step (logits out, loss_fn outside) and the peers' (labels into the
    model) take turns on one model; each counted the same number of times, a ratio written (no timing checked);
    a folder that holds a report is refused in one line."""
    out = tmp_path / "code"
    command = [sys.executable, "benchmarks/step_code.py", "--config_name", str(tiny["config"]), "--pairs", "3",
               "--warmup", "1", "--batch_size", "4", "--block_size", "32", "--output_dir", str(out)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=base_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "step_code.json").read_text())
    assert {k: w["steps"] for k, w in report["ways"].items()} == {"recipe": 2, "labels": 2}
    ratio = report["labels_over_recipe"]
    assert ratio["median"] > 0 and ratio["pairs"] == 2 and 0 <= ratio["labels_slower_pairs"] <= 2
    written = (out / "step_code.md").read_text()
    assert "labels over recipe" in written and "pair by pair" in written
    rendered = subprocess.run([sys.executable, "benchmarks/step_code.py", "--render", str(out)], cwd=REPO,
                              capture_output=True, text=True, timeout=300, env=base_env())
    assert rendered.returncode == 0 and (out / "step_code.md").read_text() == written  # from the step times alone
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=base_env())
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"error: --output_dir {out} already holds step_code.json: name a new folder"]
