"""recipes/benchmark.py's report: targets compare the runs of one round (mixprec.benchmarking.paired), so that a
slow spell of the machine, shared by the runs of its round, cancels; `--render DIR` writes the report again from
a committed benchmark.json without running anything."""
import json
import shutil
import sys
from importlib import import_module

import pytest
from hypothesis import given, settings, strategies as st

from helpers import REPO
from mixprec import benchmarking as bm

sys.path.insert(0, str(REPO / "recipes"))
try:
    benchmark = import_module("benchmark")
finally:
    sys.path.remove(str(REPO / "recipes"))

PEERS = ("recipe", "hf_accelerate", "hf_trainer")
COMMITTED = REPO / "benchmarks" / "results" / "cpu-hf-peers-llama-checks-off-intel-amx"


def runs_of(times: dict[str, list[float]], precision: str = "no") -> list[dict]:
    """Runs as recipes/benchmark.py records them, round by round: `times[runner][k]` is round k+1's step time."""
    return [{"precision": precision, "runner": runner, "variant": "plain", "repeat": k + 1, "step_time_median_s": t}
            for k in range(max(map(len, times.values()))) for runner, ts in times.items() if k < len(ts)
            for t in [ts[k]]]


@settings(max_examples=60, deadline=None)
@given(speeds=st.lists(st.floats(0.5, 2.0), min_size=3, max_size=3),
       drifts=st.lists(st.floats(0.6, 1.7), min_size=1, max_size=8))
def test_a_slow_spell_shared_by_a_rounds_runs_cancels_in_the_targets(speeds, drifts):
    """Each runner's own speed times a drift of the machine that every run of a round shares: the paired ratios
    give the runners' own speeds back, whatever the drifts."""
    times = {r: [s * d for d in drifts] for r, s in zip(PEERS, speeds)}
    runs = runs_of(times)
    for peer, speed in zip(PEERS[1:], speeds[1:]):
        assert bm.paired(runs, ("no", "recipe"), ("no", peer)) == pytest.approx([speed / speeds[0]] * len(drifts))
    (fp32, bf16), = [benchmark.check_targets("cpu_hf", [], runs)]
    assert fp32["value"] == pytest.approx(min(speeds[1:]) / speeds[0])
    assert fp32["passed"] == (fp32["value"] >= 0.97) and bf16["value"] is None and bf16["passed"] is None


def test_rounds_not_rows_decide_the_target_where_the_two_disagree():
    """The recipe faster than the peer in 2 of 3 rounds, by 10%; the rows' medians (1.5 s against 1.4 s) would
    call it 0.933x. The cpu_mlp target likewise takes the median of the rounds' differences (0.5 ms), not the
    difference of the medians (0)."""
    runs = runs_of({"recipe": [1.0, 1.5, 2.0], "hf_accelerate": [1.1, 1.4, 2.2]})
    (fp32, _), = [benchmark.check_targets("cpu_hf", [], runs)]
    assert fp32["value"] == pytest.approx(1.1) and fp32["passed"] is True
    runs = runs_of({"recipe": [1.0e-3, 2.0e-3, 3.0e-3], "accelerate": [0.5e-3, 2.0e-3, 2.0e-3]})
    (own, _), = [benchmark.check_targets("cpu_mlp", [], runs)]
    assert own["value"] == pytest.approx(0.5) and own["passed"] is False


def test_a_round_that_lacks_a_runner_is_left_out_of_its_pairs_and_shown_as_missing():
    runs = runs_of({"recipe": [2.0, 3.0, 2.2], "hf_accelerate": [1.9, 3.3], "hf_trainer": [2.0, 3.0, 2.2]})
    assert bm.paired(runs, ("no", "recipe"), ("no", "hf_accelerate")) == pytest.approx([0.95, 1.1])
    assert bm.paired_median(runs, ("no", "recipe"), ("no", "hf_accelerate")) == pytest.approx(1.025)
    table = bm.rounds_table(runs).splitlines()
    assert table[0] == ("| precision | round | recipe (ms) | hf_accelerate (ms) | hf_trainer (ms) | recipe/hf_accelerate "
                        "| recipe/hf_trainer |")
    assert table[2:] == ["| fp32 | 1 | 2,000 | 1,900 | 2,000 | 0.950 | 1.000 |",
                         "| fp32 | 2 | 3,000 | 3,300 | 3,000 | 1.100 | 1.000 |",
                         "| fp32 | 3 | 2,200 | - | 2,200 | - | 1.000 |"]
    assert bm.rounds_table(runs_of({"recipe": [1.0, 1.0]})) is None  # nothing to compare with
    assert bm.rounds_table(runs_of({"recipe": [1.0], "hf_trainer": [1.0]})) is None  # one round: the table above


def test_the_minimal_loops_difference_is_the_median_of_the_rounds_differences():
    runs = runs_of({"recipe": [1.0e-3, 5.0e-3, 1.2e-3], "accelerate": [0.8e-3, 1.0e-3, 1.1e-3]}, "bf16")
    (fp32, bf16), = [benchmark.check_targets("cpu_mlp", [], runs)]
    assert fp32["value"] is None and bf16["value"] == pytest.approx(0.2) and bf16["passed"] is True


def test_render_writes_a_committed_report_again_from_its_runs_alone(tmp_path, capsys):
    """The committed Llama table (3 rounds, checks off): against each peer the median of the rounds' ratios,
    computed here by hand from its benchmark.json, and nothing but benchmark.json and benchmark.md is written."""
    folder = tmp_path / "bench"
    shutil.copytree(COMMITTED, folder, ignore=shutil.ignore_patterns("*.png", "runs"))
    runs = json.loads((folder / "benchmark.json").read_text())["runs"]
    t = {(r["precision"], r["runner"], r["repeat"]): r["step_time_median_s"] for r in runs}
    by_hand = {peer: sorted(t["no", peer, k] / t["no", "recipe", k] for k in (1, 2, 3))[1] for peer in PEERS[1:]}
    before = sorted(p.name for p in folder.iterdir())
    benchmark.main(["--render", str(folder)])
    report = json.loads((folder / "benchmark.json").read_text())
    assert report["runs"] == runs and sorted(p.name for p in folder.iterdir()) == before
    assert report["targets"][0]["value"] == pytest.approx(min(by_hand.values()))
    md = (folder / "benchmark.md").read_text()
    assert "| fp32 | 3 |" in md and "| bf16 | 1 |" in md  # every round
    assert f"recipe/hf_trainer throughput, fp32, median of 3 paired rounds: {by_hand['hf_trainer']:.3f}x" in md
    assert md.rstrip().endswith(report["command"]) and "--repeats 3" in report["command"]
    assert "in turn, in the same order every round" in md  # run before the order rotated: said so
    report["order"] = "rotated"
    assert "in turn, the order rotated by one each round" in bm.markdown(report, report["command"])
    capsys.readouterr()


@given(rows=st.integers(1, 7), rounds=st.integers(1, 15))
def test_each_round_rotates_the_order_so_that_every_row_runs_first_in_turn(rows, rounds):
    """recipes/benchmark.py's rounds: every row once per round; over any len(plan) consecutive rounds each row
    once in each position (no row always first, nor always right after the machine's probe)."""
    plan = [f"row{i}" for i in range(rows)]
    orders = [benchmark.round_order(plan, k) for k in range(1, rounds + 1)]
    assert all(sorted(o) == sorted(plan) for o in orders)
    assert orders[0] == plan
    for start in range(max(0, rounds - rows + 1)):
        window = orders[start:start + rows]
        for position in range(rows):
            assert sorted(o[position] for o in window) == sorted(plan)


def test_the_recipe_with_its_checks_off_is_a_row_of_its_own_in_the_same_rounds(tmp_path):
    """recipe_checks_off runs recipes/train.py with the checks off and the recipe's own extras; the plain recipe
    row keeps them on. Round by round it is compared with the recipe and with a peer."""
    args, extra = benchmark.parse(["--config", str(REPO / "recipes/configs/hf_gpt2_small.yaml"), "--runners",
                                   "recipe,recipe_checks_off,hf_accelerate", "--steps", "10", "--warmup", "0",
                                   "--log_every", "10", "--output_dir", str(tmp_path)])
    off = benchmark.command("recipe_checks_off", "no", "plain", args, extra, tmp_path)
    on = benchmark.command("recipe", "no", "plain", args, extra, tmp_path)
    assert off[1] == on[1] == "recipes/train.py" and off == on + benchmark.CHECKS_OFF
    assert "--report_to" in on and not set(benchmark.CHECKS_OFF) & set(on)
    runs = runs_of({"recipe": [2.0, 2.4], "recipe_checks_off": [1.9, 2.2], "hf_accelerate": [1.8, 2.0]})
    ratios = bm.ratios([], runs)
    assert ratios["recipe/recipe_checks_off throughput, fp32, median of 2 paired rounds"] == pytest.approx(
        (1.9 / 2.0 + 2.2 / 2.4) / 2)
    assert ratios["recipe_checks_off/hf_accelerate throughput, fp32, median of 2 paired rounds"] == pytest.approx(
        (1.8 / 1.9 + 2.0 / 2.2) / 2)
    head, _, first, second = bm.rounds_table(runs).splitlines()
    assert head.startswith("| precision | round | recipe (ms) | recipe_checks_off (ms) | hf_accelerate (ms) | "
                           "recipe/recipe_checks_off | recipe/hf_accelerate |")
    assert first == "| fp32 | 1 | 2,000 | 1,900 | 1,800 | 0.950 | 0.900 |"


@pytest.mark.parametrize("argv", [[], ["a", "b"], ["no/such/folder"]])
def test_render_without_one_benchmark_folder_is_one_line_and_exit_code_2(argv, capsys, tmp_path):
    with pytest.raises(SystemExit) as stop:
        benchmark.main(["--render", *argv])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give one folder that holds a benchmark.json" in err[0]


def test_render_refuses_a_report_from_before_rounds_were_recorded_and_changes_nothing(tmp_path, capsys):
    old = REPO / "benchmarks" / "results" / "cpu-gpt_small-amd-avx2"  # no peaks in its benchmark.json
    folder = tmp_path / "old"
    shutil.copytree(old, folder, ignore=shutil.ignore_patterns("*.png"))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(SystemExit) as stop:
        benchmark.main(["--render", str(folder)])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and "cannot be written again" in err[0]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


SIDE_BY_SIDE = REPO / "benchmarks" / "results" / "cpu-side-by-side-gpt2-intel-amx" / "defaults"
TURNS = REPO / "benchmarks" / "results" / "cpu-side-by-side-gpt2-turns-intel-amx" / "defaults"


def test_side_by_side_render_computes_both_comparisons_from_the_step_times_alone(tmp_path, capsys):
    """benchmarks/side_by_side.py --render: each round's median over the steps that do not log and mean over every
    step but the first, computed here by hand from the committed step times; nothing else in the folder changes."""
    import math
    import runpy
    import statistics

    folder = tmp_path / "defaults"
    shutil.copytree(SIDE_BY_SIDE, folder)
    recorded = json.loads((folder / "side_by_side.json").read_text())
    for r in recorded["rounds"]:  # the derived figures go: render must compute them again
        for key in ("recipe_over_peer", "recipe_over_peer_all_steps"):
            r.pop(key, None)
        for runner in ("recipe", "hf_accelerate"):
            for key in ("median_step_s", "mean_step_s", "steps_compared"):
                r[runner].pop(key, None)
    for key in ("recipe_over_peer", "recipe_over_peer_all_steps"):
        recorded.pop(key, None)
    (folder / "side_by_side.json").write_text(json.dumps(recorded))
    measured = [(r["round"], r[x]["core"], r[x]["step_times_s"], r[x]["command"]) for r in recorded["rounds"]
                for x in ("recipe", "hf_accelerate")]
    script = runpy.run_path(str(REPO / "benchmarks" / "side_by_side.py"))
    report = script["main"](["--render", str(folder)])
    log_every = 15  # the committed folder's --max_steps 30 --log_every 15: steps 15 and 30 log
    quiet, alls = [], []
    for r in report["rounds"]:
        a, b = r["recipe"]["step_times_s"], r["hf_accelerate"]["step_times_s"]
        kept = [[t for i, t in enumerate(x, 1) if i > 1 and i % log_every] for x in (a, b)]
        assert len(kept[0]) == 27 and r["recipe"]["steps_compared"] == 27
        quiet.append(statistics.median(kept[1]) / statistics.median(kept[0]))
        alls.append(statistics.fmean(b[1:]) / statistics.fmean(a[1:]))
        assert r["recipe_over_peer"] == pytest.approx(quiet[-1], rel=1e-12)
        assert r["recipe_over_peer_all_steps"] == pytest.approx(alls[-1], rel=1e-12)
    geo = [math.exp(statistics.fmean(map(math.log, x))) for x in (quiet, alls)]
    assert (report["recipe_over_peer"], report["recipe_over_peer_all_steps"]) == pytest.approx(geo, rel=1e-12)
    assert round(geo[0], 3) == 0.983 and round(geo[1], 3) == 0.982  # as docs/benchmarks.md gives them
    md = (folder / "side_by_side.md").read_text()
    assert md == (SIDE_BY_SIDE / "side_by_side.md").read_text()  # the committed report is this render's
    assert sorted(p.name for p in folder.iterdir()) == ["side_by_side.json", "side_by_side.md"]
    written = json.loads((folder / "side_by_side.json").read_text())
    assert [(r["round"], r[x]["core"], r[x]["step_times_s"], r[x]["command"]) for r in written["rounds"]
            for x in ("recipe", "hf_accelerate")] == measured  # what was measured is kept as it was


def test_side_by_side_taking_turns_also_compares_the_mean_steps(tmp_path, capsys):
    """A --turns report: per round, the peer's mean step time over the steps that do not log over the recipe's;
    their geometric mean over the rounds as docs/benchmarks.md gives it."""
    import math
    import runpy
    import statistics

    folder = tmp_path / "turns"
    shutil.copytree(TURNS, folder)
    script = runpy.run_path(str(REPO / "benchmarks" / "side_by_side.py"))
    report = script["main"](["--render", str(folder)])
    ratios = []
    for r in report["rounds"]:
        kept = [[t for i, t in enumerate(r[x]["step_times_s"], 1) if i > 1 and i % 25] for x in ("hf_accelerate",
                                                                                              "recipe")]
        ratios.append(statistics.fmean(kept[0]) / statistics.fmean(kept[1]))
        assert r["recipe_over_peer_means"] == pytest.approx(ratios[-1], rel=1e-12)
    assert report["recipe_over_peer_means"] == pytest.approx(math.exp(statistics.fmean(map(math.log, ratios))))
    assert round(report["recipe_over_peer_means"], 3) == 1.001  # as docs/benchmarks.md gives it
    assert (folder / "side_by_side.md").read_text() == (TURNS / "side_by_side.md").read_text()
    assert "| 1 | recipe | 2,743.2 ms | 2,668.8 ms | 0.973 | 0.988 | 0.983 |" in (TURNS / "side_by_side.md").read_text()


def test_side_by_side_taking_turns_compares_the_cpu_time_of_the_same_steps(tmp_path, capsys):
    """A --turns report whose runs kept their kernel counts: per round, the peer's mean CPU seconds (user +
    system) over the steps that do not log over the recipe's, from each step's counts; as the docs give it."""
    import math
    import runpy
    import statistics

    folder = tmp_path / "cpu"
    shutil.copytree(TURNS.parent / "defaults-again", folder)
    report = runpy.run_path(str(REPO / "benchmarks" / "side_by_side.py"))["main"](["--render", str(folder)])
    ratios = []
    for r in report["rounds"]:
        cpu = [[x["user_s"] + x["system_s"] for i, x in enumerate(r[runner]["step_process"], 1) if i > 1 and i % 25]
               for runner in ("hf_accelerate", "recipe")]
        ratios.append(statistics.fmean(cpu[0]) / statistics.fmean(cpu[1]))
        assert r["recipe_over_peer_cpu"] == pytest.approx(ratios[-1], rel=1e-12)
        wall = [t for i, t in enumerate(r["recipe"]["step_times_s"], 1) if i > 1 and i % 25]
        assert r["recipe"]["busy_cores"] == pytest.approx(sum(cpu[1]) / sum(wall), rel=1e-12)
    geo = math.exp(statistics.fmean(map(math.log, ratios)))
    assert report["recipe_over_peer_cpu"] == pytest.approx(geo, rel=1e-12) and round(geo, 3) == 1.003  # the docs'
    md = (folder / "side_by_side.md").read_text()
    assert md == (TURNS.parent / "defaults-again" / "side_by_side.md").read_text()
    assert "| 1 | recipe | 1,957.6 ms | 1,931.2 ms | 0.986 | 0.996 | 0.997 | 0.993 |" in md
    assert "**1.003x**. CPU seconds per second" in md and "by round: recipe 1.99, 1.99, 1.92, 1.98, 1.98, 1.99;" in md


def test_side_by_side_render_of_a_folder_without_a_report_is_one_line_and_exit_code_2(tmp_path, capsys):
    import runpy

    (tmp_path / "side_by_side.json").write_text('{"peer": "hf_accelerate", "flags": ["--log_every", "5"], '
                                                 '"rounds": [{"recipe": {"step_times_s": [1, 1, 1]}}]}')
    before = (tmp_path / "side_by_side.json").read_bytes()
    script = runpy.run_path(str(REPO / "benchmarks" / "side_by_side.py"))
    with pytest.raises(SystemExit) as exited:
        script["main"](["--render", str(tmp_path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(lines) == 1 and "is not a side-by-side report" in lines[0], lines
    assert (tmp_path / "side_by_side.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["side_by_side.json"]  # no .md, the JSON as it was
    with pytest.raises(SystemExit) as exited:
        script["main"](["--render", str(tmp_path), "--rounds", "3"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and lines == [
        "error: --render DIR takes nothing else: the report is written again from DIR's own flags and step times"]
