"""The benchmark: every runner, each precision, repeated and interleaved, a report that parses (no timing is
asserted)."""
import json
import re
import statistics

import pytest
from PIL import Image

from helpers import REPO, run_recipe
from mixprec import benchmarking as bm

pytestmark = pytest.mark.slow
BENCHMARK = REPO / "recipes" / "benchmark.py"
HANDWRITTEN = REPO / "benchmarks" / "baselines" / "handwritten_loop.py"
FLOOR = REPO / "benchmarks" / "baselines" / "floor_loop.py"
ACCELERATE = REPO / "benchmarks" / "baselines" / "accelerate_loop.py"
GPT_TINY = REPO / "recipes/configs/gpt_tiny.yaml"


def test_benchmark_writes_results_for_each_precision_and_runner(tmp_path):
    from mixprec.devices.hardware import cpu_native

    out = tmp_path / "bench"
    run = run_recipe("--config", GPT_TINY, "--precisions", "no,bf16", "--repeats", "1",
                     "--steps", "10", "--warmup", "5", "--log_every", "5", "--targets", "cpu",
                     "--output_dir", out, "--batch_size", "8", launcher="python", script=BENCHMARK)
    report = json.loads((out / "benchmark.json").read_text())
    rows = {(r["precision"], r["runner"]): r for r in report["results"]}
    assert set(rows) == {(p, r) for p in ("no", "bf16") for r in ("recipe", "handwritten", "floor")}
    for (precision, _), r in rows.items():
        assert r["step_time_median_s"] > 0 and r["tokens_per_s"] > 0 and r["samples_per_s"] > 0
        assert r["peak_memory_bytes"] > 0 and r["final_loss"] < 5.55  # ln 256
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 64)  # gpt_tiny: 64 tokens a sample
        if precision == "bf16" and not cpu_native("bf16")[0]:  # emulated bf16: no peak, no MFU
            assert r["mfu"] is None and r["peak_flops"] is None and "emulated" in r["peak_flops_source"]
        else:
            assert 0 < r["mfu"] < 1
    assert len(report["targets"]) == 3 and all(t["value"] > 0 for t in report["targets"])
    for key in ("recipe/handwritten throughput, bf16", "recipe/floor throughput, fp32", "bf16/fp32 throughput, floor"):
        assert key in report["ratios"]
    assert report["complete"] and report["machine"]["usable_cores"] >= 1 and report["machine"]["loadavg_before"]
    md = (out / "benchmark.md").read_text()
    assert "| bf16 | floor |" in md and "python recipes/benchmark.py" in md and "Machine: " in md
    assert Image.open(out / "benchmark.png").format == "PNG"
    # each runner really ran its precision: the recipe's banner and the loops' first lines
    assert "effective bf16" in (out / "runs" / "recipe-bf16-1" / "run.log").read_text()
    assert "precision bf16" in (out / "runs" / "handwritten-bf16-1" / "run.log").read_text()
    assert "precision bf16" in (out / "runs" / "floor-bf16-1" / "run.log").read_text()
    assert "Benchmark" not in run.stderr
    # the threads each run used, as it chose them (mixprec.devices.threads), and the report's line says them
    for r in (r for r in report["runs"] if r["runner"] == "recipe"):  # each its own: the load at its start counts
        banner = (out / "runs" / f"recipe-{bm.LABEL[r['precision']]}-1" / "run.log").read_text()
        assert r["cpu_threads"] == int(re.search(r"threads +(\d+) per process", banner).group(1))
    assert all(r["cpu_threads"] >= 1 for r in report["runs"])
    assert f"Machine: {bm.threads_line(report['machine'], report['runs'])};" in md


def test_benchmark_interleaves_repeats_and_keeps_what_it_measured(tmp_path):
    out = tmp_path / "bench"
    run_recipe("--config", GPT_TINY, "--precisions", "no", "--runners", "floor,handwritten", "--repeats", "2",
               "--steps", "5", "--warmup", "5", "--log_every", "5", "--output_dir", out, "--batch_size", "4",
               launcher="python", script=BENCHMARK)
    report = json.loads((out / "benchmark.json").read_text())
    assert [(r["runner"], r["repeat"]) for r in report["runs"]] == [  # the second round in the rotated order
        ("floor", 1), ("handwritten", 1), ("handwritten", 2), ("floor", 2)]
    assert report["order"] == "rotated"  # the round table says so where the recipe runs (test_benchmark_report.py)
    for row in report["results"]:
        times = [r["step_time_median_s"] for r in report["runs"] if r["runner"] == row["runner"]]
        assert row["runs"] == 2 and row["step_time_median_s"] == pytest.approx(statistics.median(times))
        assert row["spread"] == pytest.approx((max(times) - min(times)) / row["step_time_median_s"])
    assert all(0 <= r["other_cpu_share"] <= 1 for r in report["runs"])
    assert "median of 2 interleaved runs" in (out / "benchmark.md").read_text()
    # the fp32 peak behind MFU was probed before the runs and after each of the 2 rounds; the best counts
    peak = report["peaks"]["no"]
    assert len(peak["probes"]) == 3 and peak["peak_flops"] == max(peak["probes"]) > 0
    assert all(row["peak_flops"] == peak["peak_flops"] for row in report["results"])
    assert "Peak FLOP/s for MFU: fp32" in (out / "benchmark.md").read_text()
    # a runner that fails stops the benchmark; what ran before it stays in benchmark.json and .md
    partial = tmp_path / "partial"
    run = run_recipe("--config", GPT_TINY, "--precisions", "no", "--runners", "hf_trainer,floor", "--repeats", "1",
                     "--steps", "5", "--warmup", "5", "--log_every", "5", "--batch_size", "4", "--hf_attn", "eager",
                     "--output_dir", partial, launcher="python", script=BENCHMARK, check=False)
    assert run.returncode == 2 and "floor fp32: unrecognized arguments: --hf_attn" in run.stderr
    report = json.loads((partial / "benchmark.json").read_text())
    assert not report["complete"] and [r["runner"] for r in report["results"]] == ["hf_trainer"]
    assert "INCOMPLETE: 1 of 2 runs" in (partial / "benchmark.md").read_text()
    assert "eager attention" in (partial / "runs" / "hf_trainer-fp32-1" / "run.log").read_text()
    assert report["runs"][0]["cpu_threads"] >= 1


@pytest.mark.parametrize("script", [HANDWRITTEN, FLOOR, ACCELERATE], ids=["handwritten", "floor", "accelerate"])
def test_loops_learn_with_fp16_and_accumulation(tmp_path, script):
    run = run_recipe("--mixed_precision", "fp16", "--max_steps", "60", "--log_every", "20",
                     "--gradient_accumulation_steps", "2", out=tmp_path / "hw", launcher="python", script=script)
    records = [json.loads(line) for line in (tmp_path / "hw" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [20, 40, 60]
    assert records[-1]["loss"] < records[0]["loss"] and all(r["loss_scale"] > 0 for r in records)
    summary = json.loads((tmp_path / "hw" / "summary.json").read_text())
    assert summary["effective_precision"] == "fp16" and summary["grad_scaler"] is True
    assert "GradScaler on" in run.stdout


@pytest.mark.parametrize("args, words", [
    (["--precisions", "fp17"], ["'fp17'"]),
    (["--steps", "7", "--log_every", "5"], ["multiples of --log_every"]),
    (["--runners", "deepspeed"], ["'deepspeed'"]),
    (["--variants", "fast"], ["'fast'"]),
    (["--repeats", "0"], ["--repeats 0"]),
    (["--compile"], ["--variants compile"]),
    (["--peak_flops", "0"], ["--peak_flops 0 must be positive"]),
    (["--peak_flops", "many"], ["--peak_flops", "'many'"]),
    (["--peak_flops", "inf"], ["--peak_flops inf must be positive and finite"]),
    (["--runners", "hf_trainer", "--repeats", "1", "--steps", "5", "--warmup", "0"], ["give a gpt model"]),
])
def test_bad_benchmark_input(args, words, tmp_path):
    run = run_recipe("--config", REPO / "recipes/configs/mlp.yaml", *args, "--output_dir", tmp_path / "b",
                     launcher="python", script=BENCHMARK, check=False)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and run.stderr.startswith("error: ")
    assert all(word in run.stderr for word in words)
    if "--peak_flops" in args:  # refused by the benchmark itself, before any run (not passed on from a runner)
        assert not (tmp_path / "b").exists()


def test_benchmark_refuses_a_folder_that_holds_a_benchmark(tmp_path):
    (tmp_path / "benchmark.json").write_text("{}")
    run = run_recipe("--config", GPT_TINY, "--output_dir", tmp_path, launcher="python", script=BENCHMARK,
                     check=False)
    assert run.returncode == 2 and "holds a benchmark already" in run.stderr


def test_threads_benchmark_runs_each_setting_and_reports_the_recipes_choice(tmp_path):
    out = tmp_path / "threads"
    # The shell's OMP_WAIT_POLICY and OMP_NUM_THREADS are removed from every run, so the report must not show
    # them as the runs' setting (CI's pytest worker had PASSIVE from an in-process test's quiet_waiting).
    run_recipe("--max_steps", "20", "--log_every", "5", "--repeats", "1", "--settings", "1,default",
               "--conditions", "idle", "--output_dir", out, launcher="python", script=REPO / "benchmarks" / "threads.py",
               env={"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "97"})
    report = json.loads((out / "threads.json").read_text())
    assert not {"OMP_WAIT_POLICY", "OMP_NUM_THREADS"} & set(report["machine"]["thread_env"])
    assert "torch_threads" not in report["machine"]
    assert report["complete"] and {r["setting"] for r in report["runs"]} == {"1", "default"}
    one, default = sorted(report["runs"], key=lambda r: r["setting"] != "1")
    assert one["threads"] == 1 and default["threads"] >= 1 and one["step_time_median_s"] > 0
    assert "OMP_WAIT_POLICY=ACTIVE python recipes/train.py" in one["command"]
    md = (out / "threads.md").read_text()
    assert "| idle |" in md and ("Machine: CPU flags" in md or "Machine: load average" in md)  # rows say threads
    assert "PASSIVE" not in md.split("Machine:")[1].split("Command:")[0]
    assert all(r["threads"] != 97 for r in report["runs"])


def test_components_benchmark_measures_each_part(tmp_path):
    run_recipe("--threads", "1", "--parts", "gelu,data,loss", "--precisions", "no", "--batch_size", "2",
               "--repeats", "1", "--output", tmp_path / "parts.json", launcher="python",
               script=REPO / "benchmarks" / "peers" / "components.py")
    report = json.loads((tmp_path / "parts.json").read_text())
    assert {r["part"] for r in report["results"]} == {"gelu", "data", "loss"} and report["threads"] == 1
    assert all(r["best_ms"] > 0 for r in report["results"] if "best_ms" in r)


def test_the_report_names_the_model_a_flag_put_in_the_configs_place():
    assert bm.subject("recipes/configs/mlp.yaml", []) == "mlp"
    assert bm.subject("c/hf.yaml", ["--config_name", "m/config", "--bf16"]) == "hf with --config_name m/config"
    assert bm.subject("c/hf.yaml", ["--model_name_or_path=m"]) == "hf with --model_name_or_path m"
    assert bm.subject("c/hf.yaml", ["--config_name"]) == "hf"  # no value: argparse refused it before
    assert bm.subject("c/hf.yaml", ["--config_name", "a", "--config_name", "b"]) == "hf with --config_name b"


def test_the_report_says_the_threads_each_run_used():
    runs = [{"runner": "recipe", "cpu_threads": 1}, {"runner": "floor", "cpu_threads": 1}]
    assert bm.threads_line({"torch_threads": 2}, runs) == "1 thread per run"
    runs.append({"runner": "hf_trainer", "cpu_threads": 2})
    assert bm.threads_line({"torch_threads": 2}, runs) == "threads per run: recipe 1, floor 1, hf_trainer 2"
    assert bm.threads_line({"torch_threads": 2}, [{"runner": "recipe"}]) == "2 threads for the peak FLOP/s"


def test_a_measured_peak_is_the_best_of_its_probes_and_a_table_or_flag_peak_is_kept():
    measured = {"peak_flops": 2e10, "peak_flops_source": "measured at start-up (cpu: no table): best fp32 matmul"}
    later = bm.add_probe(bm.add_probe(measured, 3e10), 2.5e10)
    assert later["peak_flops"] == 3e10 and later["probes"] == [2e10, 3e10, 2.5e10]
    assert "best of 3 probes" in later["peak_flops_source"] and "fp32 matmul" in later["peak_flops_source"]
    for fixed in ({"peak_flops": 1e15, "peak_flops_source": "H200 datasheet, dense bf16"},
                  {"peak_flops": 5e10, "peak_flops_source": "--peak_flops"},
                  {"peak_flops": None, "peak_flops_source": "none: bf16 is emulated on this CPU (avx2 only)"}):
        assert bm.add_probe(fixed, 9e15) == fixed
        assert not bm.probed(fixed)
    assert bm.probed(measured)
    assert bm.add_probe(measured, None) == measured  # a probe that failed (metrics.peak_flops: None) changes nothing


def test_the_report_names_its_peaks_and_says_what_an_mfu_above_100_percent_means():
    row = {"precision": "no", "runner": "recipe", "variant": "plain", "runs": 3, "step_time_median_s": 1.0,
           "spread": 0.1, "samples_per_s": 10.0, "peak_memory_bytes": 2**30, "final_loss": 1.0,
           "flops_per_sample": 3e9, "peak_flops": 2.5e10,
           "peak_flops_source": "measured here: best fp32 matmul, best of 4 probes (before the runs and after each "
                                "round)"}
    report = {"config": "gpt_small.yaml", "steps": 4, "warmup": 2, "repeats": 3, "complete": True, "runs": [],
              "planned_runs": 3, "hardware": "AMD EPYC", "machine": {"torch_threads": 2}, "ratios": {},
              "targets": [], "results": [dict(row, mfu=1.2)]}
    md = bm.markdown(report, "python recipes/benchmark.py")
    assert "Peak FLOP/s for MFU: fp32 0.025 TFLOP/s (measured here: best fp32 matmul, best of 4 probes" in md
    assert "MFU above 100%" in md
    report["results"] = [dict(row, mfu=0.6)]
    assert "MFU above 100%" not in bm.markdown(report, "python recipes/benchmark.py")


def test_a_peak_given_with_peak_flops_is_the_benchmarks_peak_and_never_probed_again():
    from importlib import import_module
    import sys
    sys.path.insert(0, str(REPO / "recipes"))
    try:
        benchmark = import_module("benchmark")
    finally:
        sys.path.remove(str(REPO / "recipes"))
    args, extra = benchmark.parse(["--config", str(REPO / "recipes/configs/mlp.yaml"), "--peak_flops=2e12",
                                   "--tf32", "--no-tf32", "--output_dir", "unused"])
    assert args.peak_flops == 2e12 and args.tf32 is False and "--peak_flops=2e12" in extra  # the runners get it
    peaks = {"no": benchmark.peak_flops("no", args)}
    assert peaks["no"] == {"peak_flops": 2e12, "peak_flops_source": "--peak_flops"}
    assert benchmark.probe_again(peaks, args) == peaks
    row = {"precision": "no", "mfu": 1.5, **peaks["no"]}
    assert "datasheet or `--peak_flops` peak" in bm.markdown(
        {"config": "mlp.yaml", "steps": 1, "warmup": 0, "repeats": 1, "complete": True, "runs": [], "planned_runs": 1,
         "hardware": "cpu", "machine": {"torch_threads": 1}, "ratios": {}, "targets": [],
         "results": [dict(row, runner="recipe", variant="plain", runs=1, step_time_median_s=1.0, spread=0.0,
                          samples_per_s=1.0, peak_memory_bytes=1, final_loss=1.0)]}, "cmd")


def test_loop_calls_times_each_call_of_both_loops_with_accumulation_and_fp16(tmp_path):
    """benchmarks/loop_calls.py: the recipe's loop and the plain one alternate, with accumulation and a
    GradScaler (the paths a plain fp32 step does not take); every call is reported on both sides."""
    out = tmp_path / "lc"
    run = run_recipe("--max_steps", "10", "--gradient_accumulation_steps", "2", "--mixed_precision", "fp16",
                     "--log_every", "5", "--output", out, launcher="python",
                     script=REPO / "benchmarks" / "loop_calls.py")
    report = json.loads((out / "loop_calls.json").read_text())
    rows = {r["call"]: r for r in report["rows"]}
    assert report["steps_per_side"] == 10 and "cores" in report["machine"]
    assert set(rows) == {"batch", "accumulate", "autocast", "forward", "loss", "backward", "clip", "step decision",
                         "optimizer.step", "scheduler.step", "zero_grad", "bookkeeping", "step"}
    assert rows["step"]["recipe_mean_us"] > rows["forward"]["recipe_mean_us"] > 0
    assert rows["accumulate"]["plain_mean_us"] == 0 and rows["step decision"]["plain_mean_us"] == 0
    assert rows["forward"]["plain_mean_us"] > 0 and "median: recipe" in run.stdout
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["effective_precision"] == "fp16"


@pytest.mark.parametrize("args, words", [
    ((), "--output"),  # the folder below holds a file
    (("--output_dir", "OTHER"), "--output_dir"),  # someone's run folder: it must not train into it
    (("--resume_from_checkpoint", "latest"), "--resume_from_checkpoint"),
], ids=["non-empty folder", "output_dir", "resume"])
def test_loop_calls_refuses_to_touch_another_folder(tmp_path, args, words):
    (tmp_path / "keep.txt").write_text("mine")
    out = tmp_path if not args else tmp_path / "new"
    args = [str(tmp_path) if a == "OTHER" else a for a in args]
    run = run_recipe("--output", out, *args, launcher="python", script=REPO / "benchmarks" / "loop_calls.py",
                     check=False)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0 and words in run.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_startup_benchmark_runs_both_commands_in_turn_and_reports_the_difference(tmp_path):
    """benchmarks/startup.py: the floor script and the default command alternate; the report holds both and
    the recipe's cost beyond the floor (no timing is asserted)."""
    import subprocess
    import sys

    from helpers import base_env

    out = tmp_path / "startup"
    proc = subprocess.run([sys.executable, "benchmarks/startup.py", "--repeats", "2", "--max_steps", "2",
                           "--output", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=base_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "startup.json").read_text())
    assert report["repeats"] == 2 and report["max_steps"] == 2 and report["machine"]
    for key in ("floor_s", "recipe_s", "recipe_training_s", "recipe_beyond_floor_s"):
        assert set(report[key]) == {"median", "min", "max"}, key
    assert report["recipe_s"]["median"] > report["recipe_training_s"]["median"] >= 0  # 2 steps: "0.0s" is possible
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["0", "1"]  # the recipe's runs, in DIR/runs
    # the wall time split: its five parts add up to the recipe's command (each run's), in order of the timeline
    parts = report["recipe_split_s"]
    assert list(parts) == ["start_up", "steps", "evaluation", "checkpoints", "end"]
    assert all(parts[p]["min"] >= 0 for p in parts) and parts["start_up"]["median"] > 0 and parts["end"]["median"] > 0
    timeline = json.loads((out / "runs" / "0" / "summary.json").read_text())["timeline"]
    assert timeline["process_start"] <= timeline["first_batch"] <= timeline["finish"]
    assert "the recipe's wall time: start-up " in proc.stdout
    again = subprocess.run([sys.executable, "benchmarks/startup.py", "--output", str(out)], cwd=REPO,
                           capture_output=True, text=True, timeout=60, env=base_env())
    assert again.returncode == 2 and "not empty" in again.stderr and again.stderr.count("\n") == 1


def test_the_peer_benchmark_trains_the_same_transformers_model_in_each_runner(tmp_path):
    """The peer benchmark, small: recipes/configs/hf_gpt2_small.yaml with a tiny GPT-2 config in its place,
    through the recipe, the plain Accelerate loop (run_clm_no_trainer's style) and HF Trainer, fp32 and bf16;
    each run trains the same model (its parameter count in each run's log) and the cpu_hf targets are checked."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_hf", REPO / "scripts" / "make_tiny_hf.py")
    make_tiny_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny_hf)
    tiny = make_tiny_hf.make(tmp_path / "gpt2", "gpt2", "float32")
    out = tmp_path / "bench"
    run_recipe("--config", REPO / "recipes/configs/hf_gpt2_small.yaml", "--config_name", tiny["config"],
               "--tokenizer_name", tiny["tokenizer"], "--block_size", "64",
               "--runners", "recipe,hf_accelerate,hf_trainer",
               "--precisions", "no,bf16", "--repeats", "1", "--steps", "4", "--warmup", "2", "--log_every", "2",
               "--targets", "cpu_hf", "--output_dir", out, launcher="python", script=BENCHMARK)
    report = json.loads((out / "benchmark.json").read_text())
    rows = {(r["precision"], r["runner"]): r for r in report["results"]}
    assert set(rows) == {(p, r) for p in ("no", "bf16") for r in ("recipe", "hf_accelerate", "hf_trainer")}
    for r in rows.values():
        assert r["step_time_median_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 64)
        assert 5.5 < r["final_loss"] < 6.6  # ln 512 = 6.24: a fresh model's loss on a 512-token vocabulary
    from transformers import AutoConfig, AutoModelForCausalLM

    count = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny["config"])).num_parameters()
    logs = {name: (out / "runs" / f"{name}-bf16-1" / "run.log").read_text()
            for name in ("recipe", "hf_accelerate", "hf_trainer")}
    assert all(f"{count:,} parameters" in text for text in logs.values()), count
    assert "effective bf16" in logs["recipe"] and "precision bf16" in logs["hf_accelerate"]
    assert "precision bf16" in logs["hf_trainer"]
    assert [t["target"].split(", ")[-1] for t in report["targets"]] == ["fp32", "bf16"]
    assert all(t["value"] > 0 for t in report["targets"])
    assert "recipe/hf_accelerate throughput, bf16" in report["ratios"]
    title = (out / "benchmark.md").read_text().splitlines()[0]  # which model, where a flag replaced the config's
    assert title.startswith(f"**hf_gpt2_small with --config_name {tiny['config']}, 4 steps after 2 warm-up"), title


def test_the_minimal_accelerate_loop_trains_as_the_recipe_does_and_the_benchmark_states_the_recipes_own_cost(tmp_path):
    """The runner the recipe's own per-step cost is measured against does the same work: its logged window losses
    equal the recipe's (fp16 with accumulation; they differ only in how the window's losses are summed), and the
    benchmark reports the step-time difference in ms with the cpu_mlp targets."""
    args = ("--mixed_precision", "fp16", "--max_steps", "40", "--log_every", "20", "--gradient_accumulation_steps", "2")
    run_recipe(*args, out=tmp_path / "acc", launcher="python", script=ACCELERATE)
    run_recipe(*args, out=tmp_path / "recipe")
    loop = [json.loads(line) for line in (tmp_path / "acc" / "metrics.jsonl").read_text().splitlines()]
    recipe = [r for r in map(json.loads, (tmp_path / "recipe" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in loop] == [r["step"] for r in recipe] == [20, 40]
    for a, b in zip(loop, recipe):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["loss_scale"] == b["loss_scale"]
    out = tmp_path / "bench"
    run_recipe("--config", REPO / "recipes/configs/mlp.yaml", "--precisions", "no", "--runners", "recipe,accelerate",
               "--repeats", "1", "--steps", "20", "--warmup", "10", "--log_every", "10", "--targets", "cpu_mlp",
               "--output_dir", out, launcher="python", script=BENCHMARK)
    report = json.loads((out / "benchmark.json").read_text())
    rows = {r["runner"]: r for r in report["results"]}
    own = report["ratios"]["recipe - accelerate step time (ms), fp32"]
    assert own == pytest.approx((rows["recipe"]["step_time_median_s"] - rows["accelerate"]["step_time_median_s"]) * 1e3)
    assert [t["value"] for t in report["targets"]][0] == pytest.approx(own)
    assert "recipe - accelerate step time (ms), fp32: " in (out / "benchmark.md").read_text()


def test_threads_benchmark_beside_busy_processes_runs_the_tiny_bert_with_each_setting(tmp_path):
    """busy-K starts K spinning processes beside each run, train-K K small training loops; the tiny BERT is made
    into the benchmark's folder; a default that chose 1 thread is said to be the 1-thread configuration."""
    out = tmp_path / "busy"
    run_recipe("--models", "bert", "--conditions", "busy-2,train-1", "--settings", "1,default", "--repeats", "1",
               "--hf_steps", "4", "--hf_log_every", "2", "--output_dir", out, launcher="python",
               script=REPO / "benchmarks" / "threads.py")
    report = json.loads((out / "threads.json").read_text())
    assert [(r["model"], r["condition"], r["setting"]) for r in report["rows"]] == [
        ("bert", "busy-2", "1"), ("bert", "busy-2", "default"), ("bert", "train-1", "1"), ("bert", "train-1", "default")]
    assert report["rows"][0]["threads"] == [1] and all(r["step_time_median_s"] > 0 for r in report["rows"])
    assert {(r["condition"], r["competitors"]) for r in report["runs"]} == {("busy-2", "busy"), ("train-1", "train")}
    assert all(r["wall_median_s"] > r["step_time_median_s"] * 4 for r in report["rows"])  # the whole command
    table = (out / "threads.md").read_text()
    assert "| bert | 2 busy processes | the recipe's default (" in table and "| bert | 1 training process | " in table
    if report["rows"][1]["threads"] == [1]:
        assert "the recipe's default (1): the 1-thread run's configuration" in table
    assert (out / "tiny_bert" / "classify.csv").is_file()
    bad = run_recipe("--conditions", "busy-0", "--output_dir", tmp_path / "bad", launcher="python",
                     script=REPO / "benchmarks" / "threads.py", check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --conditions: 'busy-0'") and "Traceback" not in bad.stderr


def test_allocator_reuse_reports_each_settings_faults_and_resident_set():
    """benchmarks/allocator_reuse.py: both glibc settings, each round's page faults (the first round of a fresh
    tensor always faults its pages in), the resident set; a size below 1 MB is one line and exit code 2."""
    run = run_recipe("--mb", "8", "--rounds", "2", launcher="python", script=REPO / "benchmarks" / "allocator_reuse.py")
    lines = run.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["glibc as it is", "glibc keeping freed memory"]
    assert lines[0].endswith("malloc environment: none") and "MALLOC_MMAP_MAX_=0" in lines[1], lines
    first = [int(re.search(r"\[(\d+),", line).group(1)) for line in lines]
    assert all(f > 0 for f in first), lines  # a fresh tensor's pages are faulted in
    bad = run_recipe("--mb", "0", launcher="python", script=REPO / "benchmarks" / "allocator_reuse.py", check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == ["error: --mb and --rounds must be at least 1"]
