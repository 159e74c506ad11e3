"""The benchmark: both runners, each precision, a report that parses (no timing is asserted)."""
import json

import pytest
from PIL import Image

from helpers import REPO, run_recipe

pytestmark = pytest.mark.slow
BENCHMARK = REPO / "recipes" / "benchmark.py"
HANDWRITTEN = REPO / "recipes" / "handwritten_loop.py"


def test_benchmark_writes_results_for_each_precision_and_runner(tmp_path):
    out = tmp_path / "bench"
    run = run_recipe("--config", REPO / "recipes/configs/gpt_tiny.yaml", "--precisions", "no,bf16",
                     "--steps", "10", "--warmup", "5", "--log_every", "5", "--targets", "cpu",
                     "--output_dir", out, "--batch_size", "8", launcher="python", script=BENCHMARK)
    report = json.loads((out / "benchmark.json").read_text())
    rows = {(r["precision"], r["runner"]): r for r in report["results"]}
    assert set(rows) == {("no", "recipe"), ("no", "handwritten"), ("bf16", "recipe"), ("bf16", "handwritten")}
    for r in rows.values():
        assert r["step_time_median_s"] > 0 and r["tokens_per_s"] > 0 and r["samples_per_s"] > 0
        assert r["peak_memory_bytes"] > 0 and 0 < r["mfu"] < 1 and r["final_loss"] < 5.55  # ln 256
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 64)  # gpt_tiny: 64 tokens a sample
    assert len(report["targets"]) == 3 and all(t["value"] > 0 for t in report["targets"])
    assert "recipe/handwritten throughput, bf16" in report["ratios"]
    md = (out / "benchmark.md").read_text()
    assert "| bf16 | handwritten |" in md and "python recipes/benchmark.py" in md
    assert Image.open(out / "benchmark.png").format == "PNG"
    # both runners really ran their precision: the recipe's banner and the hand-written loop's first line
    assert "effective bf16" in (out / "runs" / "recipe-bf16" / "run.log").read_text()
    assert "precision bf16" in (out / "runs" / "handwritten-bf16" / "run.log").read_text()
    assert "Benchmark" not in run.stderr


def test_handwritten_loop_learns_with_fp16_and_accumulation(tmp_path):
    run = run_recipe("--mixed_precision", "fp16", "--max_steps", "60", "--log_every", "20",
                     "--gradient_accumulation_steps", "2", out=tmp_path / "hw", launcher="python", script=HANDWRITTEN)
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
])
def test_bad_benchmark_input(args, words):
    run = run_recipe("--config", REPO / "recipes/configs/mlp.yaml", *args, launcher="python", script=BENCHMARK,
                     check=False)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert all(word in run.stderr for word in words)
