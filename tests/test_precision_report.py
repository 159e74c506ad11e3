"""The precision doctor: the lesson's fp16 analysis on a model's real weights, gradients and activations."""
import copy
import json
import re
import shlex

import pytest
import torch
from safetensors.torch import save_file

import yaml

from mixprec import config, doctor, models
from mixprec.run_folder import run_loading as inputs
from mixprec.doctor import analysis, fp8, memory
from mixprec.errors import UsageError
from mixprec.evaluation import loss_fn
from mixprec.precision import policy
from helpers import assert_one_line_error, REPO, run_in_process, run_recipe, snapshot

REPORT = REPO / "recipes" / "precision_report.py"
INFO = {"num_features": 100, "num_classes": 10}


def mlp(seed=0, **scale):
    torch.manual_seed(seed)
    model = models.build("mlp", INFO)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(scale.get(name.split(".")[1], 1.0))
    return model


def batches(n=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [{"inputs": torch.randn(32, 100, generator=gen), "labels": torch.randint(0, 10, (32,), generator=gen)}
            for _ in range(n)]


def test_the_lessons_small_gradients_through_fp16():
    values = torch.tensor([1e-6, 1e-7, 1e-8, 1e-9])
    unscaled = analysis.cast_counts(values, torch.float16)
    assert (unscaled["zero"], unscaled["subnormal"], unscaled["overflow"]) == (2, 2, 0)  # 1e-8 and 1e-9 vanish
    scaled = analysis.cast_counts(values, torch.float16, 65536.0)
    assert (scaled["zero"], scaled["subnormal"], scaled["overflow"]) == (0, 0, 0)  # all normal numbers now
    assert analysis.shares(scaled)["mean_rel_error"] < 1e-3 < analysis.shares(unscaled)["mean_rel_error"]
    assert analysis.cast_counts(torch.tensor([1.0]), torch.float16, 2.0 ** 17)["overflow"] == 1  # 131072 > 65504
    assert analysis.cast_counts(values, torch.bfloat16)["zero"] == 0


def test_an_overflowing_layer_is_named_and_fp16_is_refused():
    model = mlp(**{"2": 1e6})  # net.2's outputs reach about 1e5, above fp16's 65504
    report = doctor.analyze(model, batches(), loss_fn, torch.device("cpu"), 65536.0, progress=False)
    acts = {a["layer"]: a for a in report["activations"]}
    assert acts["net.2"]["overflow_starts_here"] and acts["net.2"]["fp16_nonfinite"] > 0
    assert acts["net.4"]["exceeds_fp16"] and not acts["net.4"]["overflow_starts_here"]  # passed on, not started
    assert not acts["net.0"]["exceeds_fp16"] and acts["net.0"]["fp16_nonfinite"] == 0
    assert report["autocast"]["bf16"]["layers"]["net.2"]["nonfinite"] == 0
    v = report["verdict"]
    assert not v["fp16_safe"] and v["bf16_safe"] and v["recommendation"] == "bf16"
    # net.2 in fp32 is not enough: its fp32 output (about 1e5) reaches net.4, whose input autocast casts to fp16
    assert v["keep_fp32"] == ["net.2", "net.4"] and v["fp32_modules_flag"] == "--fp32_modules net.2,net.4"
    assert v["fp32_modules_checked"]
    assert any(line.startswith("keep these layers in fp32") and line.count("--fp32_modules net.2,net.4") == 1
               for line in v["lines"])
    for keep, finite in ((["net.2"], False), (["net.2", "net.4"], True)):  # train.py's policy, as the report checks
        trial = copy.deepcopy(model)
        policy.keep_fp32(trial, keep)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            assert bool(torch.isfinite(trial(batches()[0]["inputs"])).all()) == finite


def test_a_healthy_model_gets_fp16_with_a_scale_that_fits():
    report = doctor.analyze(mlp(), batches(), loss_fn, torch.device("cpu"), 2.0 ** 24, progress=False)
    grads, v = report["gradients"], report["verdict"]
    assert grads["fp16"]["chosen"]["overflow"] > 0  # 2**24: too high for gradients of about 0.1
    assert grads["fp16"]["recommended"]["overflow"] == 0 and v["fp16_safe"] and v["keep_fp32"] == []
    assert grads["max_abs"] * grads["recommended_scale"] * analysis.HEADROOM <= 65504
    assert "the GradScaler would skip steps" in v["lines"][1]
    assert [d["lesson_value"] for d in report["demonstration"]] == analysis.DECADES
    assert sum(grads["histogram"]["counts"]) == grads["values"] - grads["exact_zeros"]


def test_fp8_overflow_is_saturation_not_the_scales_own_rounding():
    """amax * (448 / amax) can round to just above 448 in fp32: that value lands on 448 exactly, not an overflow.
    A value above the amax a delayed scale was computed from saturates: an overflow."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        x = torch.randn(64, generator=gen) * 10.0 ** int(torch.randint(-6, 6, (1,), generator=gen))
        for fmt in ("e4m3", "e5m2"):
            stream = fp8.Stream(fmt, "tensorwise")
            stream.add(x)
            assert stream.overflow == 0 and stream.result()["sqnr_db"] > 20
    delayed = fp8.Stream("e4m3", "delayed")
    delayed.add(torch.tensor([1.0, -0.5]))
    delayed.add(torch.tensor([3.0, 0.5, -1.0]))  # scaled by 448 / 1.0: 3.0 saturates at 448, read back as 1.0
    assert delayed.overflow == 1 and delayed.result()["overflow"] == 1 / 5

@pytest.fixture(scope="module")
def fp8_report():
    """The report on an MLP whose middle layers are 256 -> 40 -> 128 (40 does not divide by 16), batches of 20."""
    torch.manual_seed(0)
    model = models.build("mlp", INFO, {"hidden": [256, 40, 128]})
    gen = torch.Generator().manual_seed(0)
    data = [{"inputs": torch.randn(20, 100, generator=gen), "labels": torch.randint(0, 10, (20,), generator=gen)}
            for _ in range(2)]
    return model, doctor.analyze(model, data, loss_fn, torch.device("cpu"), 65536.0, progress=False)


def test_fp8_columns_hold_sane_values(fp8_report):
    _, report = fp8_report
    section = report["fp8"]
    assert "simulated" in section["simulated"] and "not fp8 speed" in section["simulated"]
    assert [r["layer"] for r in section["layers"]] == ["net.0", "net.2", "net.4", "net.6"]
    for row in section["layers"]:
        for tensor in fp8.TENSORS:
            for fmt in ("e4m3", "e5m2"):
                for recipe in ("tensorwise", "delayed", "rowwise"):
                    stats = row[tensor][fmt][recipe]
                    assert 0 <= stats["flushed_to_zero"] < 0.01 and 0 <= stats["overflow"] < 0.01
                    assert 20 < stats["sqnr_db"] < 45, (row["layer"], tensor, fmt, recipe, stats)
                    if recipe != "delayed":  # scaled by its own amax: nothing saturates
                        assert stats["overflow"] == 0
            # 3 mantissa bits against 2: about 6 dB apart (uniform rounding: 28.9 and 22.9 dB in theory)
            e4m3, e5m2 = (row[tensor][f]["tensorwise"]["sqnr_db"] for f in ("e4m3", "e5m2"))
            assert 4 < e4m3 - e5m2 < 8 or row["layer"] == "net.6"  # the loss's gradient: few distinct values
        assert row["training_sqnr_db"]["grad_output"] == row["grad_output"]["e5m2"]["tensorwise"]["sqnr_db"]
        assert row["weight"]["e4m3"]["tensorwise"]["values"] == row["in_features"] * row["out_features"]
    assert section["layers"][1]["input"]["e4m3"]["tensorwise"]["values"] == 2 * 20 * 256  # 2 batches of 20


def test_fp8_flags_gemm_shapes_and_excludes_first_and_last(fp8_report):
    model, report = fp8_report
    rows = {r["layer"]: r for r in report["fp8"]["layers"]}
    assert rows["net.2"]["not_divisible_by_16"] == ["out_features 40", "tokens per batch 20"]
    assert rows["net.4"]["not_divisible_by_16"] == ["in_features 40", "tokens per batch 20"]
    assert rows["net.2"]["gemms"] == {"forward": "(20x256)(256x40)", "input_gradient": "(20x40)(40x256)",
                                      "weight_gradient": "(40x20)(20x256)"}
    assert not rows["net.2"]["accelerate_converts"] and "not divisible by 16" in rows["net.2"]["accelerate_leaves_out"]
    assert report["fp8"]["exclude"] == [{"layer": "net.0", "reasons": ["first Linear layer"]},
                                        {"layer": "net.6", "reasons": ["last Linear layer"]}]
    for row in report["fp8"]["layers"]:  # healthy: no operand loses 1% of its values, nor a weight row 10%
        assert all(lost["lost"] < fp8.LOST_THRESHOLD for lost in row["training_lost"].values())
        assert row["training_lost"]["weight"]["worst_channel_lost"] < fp8.CHANNEL_LOST_THRESHOLD
    assert report["fp8"]["fp32_modules_flag"] == "--fp32_modules net.0,net.6" and report["fp8"]["pad_inner_dim"]
    assert any(line.startswith("fp8 (simulated numerics, not speed)") and line.endswith("--fp32_modules net.0,net.6")
               for line in report["verdict"]["lines"])
    # a threshold above E5M2's SQNR (about 25 dB) keeps every layer whose output gradient is that noisy out
    strict = doctor.fp8.exclusions(model, report["fp8"]["layers"], 28.0)
    assert [e["layer"] for e in strict] == ["net.0", "net.2", "net.4", "net.6"]
    assert strict[1]["reasons"][0].startswith("SQNR below 28 dB: grad_output E5M2 2")
    assert not any("weight" in r or "input" in r for e in strict for r in e["reasons"])  # E4M3: about 31 dB


def fp8_section(edit):
    """fp8 readiness of the MLP 100 -> 256 -> 128 -> 128 -> 10 after `edit(net.4's weight)`, from two real batches
    through the report's own hooks (forward and backward in fp32)."""
    torch.manual_seed(0)
    model = models.build("mlp", INFO, {"hidden": [256, 128, 128]})
    with torch.no_grad():
        edit(model.net[4].weight)
    gen, layers = torch.Generator().manual_seed(0), {}
    with fp8.collect(model, layers):
        for _ in range(2):
            loss_fn(model(torch.randn(32, 100, generator=gen)), torch.randint(0, 10, (32,), generator=gen)).backward()
    section = fp8.readiness(model, layers)
    return section, {r["layer"]: r for r in section["layers"]}, {e["layer"]: e["reasons"] for e in section["exclude"]}


def test_fp8_one_outlier_weight_that_flushes_a_third_keeps_its_layer_out_though_its_sqnr_is_high():
    """One weight of 1.4e4 among weights within 0.09: a tensorwise E4M3 scale of 448 / 1.4e4 flushes every weight
    below about 3e-2 to zero, a third of them, while the SQNR, ruled by the outlier's own power, is above 70 dB."""
    section, rows, excluded = fp8_section(lambda w: w.__setitem__((5, 7), 1.4e4))
    weight = rows["net.4"]["weight"]["e4m3"]
    assert rows["net.4"]["training_sqnr_db"]["weight"] > 70  # the SQNR threshold alone would keep it in fp8
    assert 0.3 < weight["tensorwise"]["lost"] < 0.4 and weight["tensorwise"]["flushed_to_zero"] > 0.3
    assert weight["rowwise"]["lost"] < 0.01  # a scale per output channel loses only the outlier's own row's
    assert excluded["net.4"][0].startswith("weight E4M3 tensorwise loses 3")
    assert "rowwise scaling: 0." in excluded["net.4"][0]
    assert "net.4" in section["fp32_modules_flag"].split(" ")[1].split(",")
    line = doctor.fp8_lines(section)[0]
    assert line.endswith(section["fp32_modules_flag"])
    assert "net.4" in line.split("lost to zero or saturation: ")[1].split(")")[0].split(", ")


def test_fp8_an_output_channel_flushed_whole_keeps_its_layer_out_and_a_healthy_layer_stays():
    """net.4's output channel 3 scaled by 1e-7: it flushes to zero entirely under a tensorwise scale, 1/128 of the
    weights (under the 1% of the whole tensor), and the SQNR hardly moves; the worst output channel shows it.
    net.2, untouched, stays in fp8."""
    section, rows, excluded = fp8_section(lambda w: w[3].mul_(1e-7))
    weight = rows["net.4"]["training_lost"]["weight"]
    assert weight["lost"] == pytest.approx(1 / 128) and weight["worst_channel_lost"] == 1.0
    assert rows["net.4"]["training_sqnr_db"]["weight"] > 30
    assert list(excluded) == ["net.0", "net.4", "net.6"] and "100.0% in its worst output channel" in excluded["net.4"][0]
    assert rows["net.2"]["accelerate_converts"] and all(
        lost["lost"] < fp8.LOST_THRESHOLD for lost in rows["net.2"]["training_lost"].values())


def test_fp8_accelerate_config_is_one_accelerate_reads(fp8_report, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import str_to_bool
    from accelerate.utils.launch import setup_fp8_env

    model, report = fp8_report
    cfg = config.parse_config(["--model_args", "hidden=[256,40,128]", "--batch_size", "20"])
    path = tmp_path / fp8.CONFIG_FILE
    ready = fp8.ready_to_run(cfg, report["fp8"], path)
    path.write_text(ready["accelerate_config"])
    raw = yaml.safe_load(path.read_text())
    assert raw["mixed_precision"] == "fp8" and raw["fp8_config"] == {"backend": "AO", "pad_inner_dim": True}
    loaded = load_config_from_file(str(path))  # Accelerate's own loader: it refuses unknown keys
    assert loaded.mixed_precision == "fp8" and loaded.fp8_config["backend"] == "AO"
    options = {a.dest for a in launch_command_parser()._actions}
    assert {f"fp8_{k}" for k in raw["fp8_config"]} <= options  # keys `accelerate launch` knows
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    _validate_launch_command(args)  # what `accelerate launch --config_file` does with the file
    env = setup_fp8_env(args, {})  # ... and the environment it hands the Accelerator (AORecipeKwargs reads it)
    assert (args.multi_gpu, args.num_processes, args.mixed_precision) == (True, 8, "fp8")
    assert env["ACCELERATE_FP8_BACKEND"] == "AO" and str_to_bool(env["ACCELERATE_FP8_PAD_INNER_DIM"])
    # the launch command, in the file's comments too, is one recipes/train.py takes: its flags name real modules
    assert f"# Launch:   {ready['launch']}" in ready["accelerate_config"]
    argv = shlex.split(ready["launch"].split("recipes/train.py", 1)[1])
    parsed = config.parse_config(argv)
    assert parsed.fp32_modules == ["net.0", "net.6"] and parsed.model_args == {"hidden": [256, 40, 128]}
    assert policy.names_of(policy.match(model, parsed.fp32_modules)) == ["net.0", "net.6"]

def test_memory_is_the_bytes_really_allocated():
    model = mlp()
    n, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    rows = {r["format"]: r for r in memory.measure(model, batches(1)[0], loss_fn, torch.device("cpu"))}
    assert rows["fp32"]["parameters"] == rows["fp32"]["gradients"] == 4 * n
    assert rows["fp16"]["parameters"] == rows["bf16"]["gradients"] == 2 * n
    assert rows["fp32"]["optimizer_state"] == 2 * 4 * n + 4 * tensors  # exp_avg, exp_avg_sq and a step per tensor
    assert rows["int8"]["parameters"] == n + 4 * tensors and rows["int8"]["gradients"] is None
    for amp in ("fp16 autocast", "bf16 autocast"):  # fp32 master weights, gradients and optimizer state
        assert {k: rows[amp][k] for k in ("parameters", "gradients", "optimizer_state")} == \
               {k: rows["fp32"][k] for k in ("parameters", "gradients", "optimizer_state")}
    assert 0 < rows["fp16"]["activations"] < rows["fp32"]["activations"]
    assert rows["fp16 autocast"]["activations"] != rows["fp32"]["activations"]


def test_bad_report_input_is_refused(tmp_path):
    with pytest.raises(UsageError, match="--num_batches 0"):
        inputs.parse(["--num_batches", "0"], "")
    with pytest.raises(UsageError, match="--fp8_sqnr_threshold nan"):
        inputs.parse(["--fp8_sqnr_threshold", "nan"], "")
    assert inputs.parse(["--fp8_sqnr_threshold", "25"], "")[1].fp8_sqnr_threshold == 25.0
    with pytest.raises(UsageError, match="does not exist"):
        inputs.parse(["--resume_from_checkpoint", str(tmp_path / "nope")], "")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no model.safetensors"):
        inputs.parse(["--resume_from_checkpoint", str(tmp_path / "empty")], "")
    weights = tmp_path / "w.safetensors"
    save_file(mlp().state_dict(), weights)
    cfg, _, found, _ = inputs.parse(["--resume_from_checkpoint", str(weights), "--model_args", "hidden=[8]"], "")
    with pytest.raises(UsageError, match="do not fit --model mlp"):
        inputs.load_weights(models.build("mlp", INFO, cfg.model_args), found, cfg)


@pytest.mark.slow
def test_tiny_gradients_underflow_at_scale_1_and_not_at_a_suitable_scale(tmp_path):
    """The issue's test: every weight scaled by 0.03 makes most gradients tiny (below 1e-5)."""
    save_file({k: v * 0.03 for k, v in mlp().state_dict().items()}, tmp_path / "tiny.safetensors")
    run = run_recipe("--resume_from_checkpoint", tmp_path / "tiny.safetensors", "--init_scale", "1",
                     "--num_batches", "4", launcher="python", script=REPORT, cwd=tmp_path)
    (out,) = (tmp_path / "reports").iterdir()  # the default output folder
    report = json.loads((out / "precision_report.json").read_text())
    fp16 = report["gradients"]["fp16"]
    assert fp16["unscaled"]["flushed_to_zero"] > 0.005 and fp16["unscaled"]["subnormal"] > 0.5
    assert fp16["chosen"] == fp16["unscaled"]  # --init_scale 1: no scaling
    suitable = report["gradients"]["recommended_scale"]
    assert suitable >= 1024 and fp16["recommended"]["flushed_to_zero"] == 0 and fp16["recommended"]["overflow"] == 0
    measured = {g["scale"]: g for g in report["autocast"]["fp16"]["gradients"]}  # real fp16 backward passes
    assert measured[1.0]["flushed_to_zero"] > 0.005 > 10 * measured[suitable]["flushed_to_zero"]
    demo = {d["lesson_value"]: d for d in report["demonstration"]}
    assert demo[1e-9]["fp16"] == 0 and abs(demo[1e-9]["gradient"]) > 0  # the lesson's point, on real values
    assert report["verdict"]["fp16_init_scale"] == suitable and report["meta"]["weights"].endswith("tiny.safetensors")
    assert f"fp16 is safe with --init_scale {suitable:g}" in run.stdout and "flushed to zero" in run.stdout
    png = (out / "gradient_histogram.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


@pytest.mark.slow
def test_report_on_a_trained_run_takes_its_settings_and_weights(tmp_path):
    run_dir = tmp_path / "run"
    run_recipe("--model_args", "hidden=[32]", "--max_steps", "20", "--checkpointing_steps", "10", out=run_dir,
               launcher="python")
    before = snapshot(run_dir)
    report = run_recipe("--resume_from_checkpoint", run_dir, "--num_batches", "2", out=tmp_path / "rep",
                        launcher="python", script=REPORT)
    meta = json.loads((tmp_path / "rep" / "precision_report.json").read_text())["meta"]
    assert meta["model_args"] == {"hidden": [32]} and meta["settings_from"] == str(run_dir / "config.yaml")
    assert meta["weights"] == str(run_dir / "model.safetensors") and meta["num_parameters"] == 100 * 32 + 32 + 330
    assert "verdict:" in report.stdout
    # `latest` in --output_dir, as in train.py: the run's latest checkpoint, the report beside it
    run_recipe("--resume_from_checkpoint", "latest", "--num_batches", "1", out=run_dir, launcher="python",
               script=REPORT)
    meta = json.loads((run_dir / "precision_report.json").read_text())["meta"]
    assert meta["weights"] == str(run_dir / "checkpoints" / "step_0000020" / "model.safetensors")
    after = snapshot(run_dir)
    assert {k: after[k] for k in before} == before  # the run's own files are untouched
    assert set(after) - set(before) == {"precision_report.json", "gradient_histogram.png", fp8.CONFIG_FILE}
    bad = run_recipe("--resume_from_checkpoint", run_dir, "--model_args", "hidden=[8]", launcher="python",
                     script=REPORT, check=False)
    assert_one_line_error(bad, "do not fit", "hidden")


@pytest.mark.slow
def test_the_printed_fp32_modules_flag_is_what_train_takes(tmp_path, capsys, fresh_accelerate_state):
    """The report on weights whose net.2 overflows fp16 prints a --fp32_modules flag; recipes/train.py takes it as
    printed and lists the modules in its banner."""
    weights = {k: v * (1e6 if k.startswith("net.2.") else 1.0) for k, v in mlp().state_dict().items()}
    save_file(weights, tmp_path / "overflowing.safetensors")
    report = run_recipe("--resume_from_checkpoint", tmp_path / "overflowing.safetensors", "--num_batches", "2",
                        "--fp32_modules", "net.0", out=tmp_path / "report", launcher="python", script=REPORT)
    assert "not applied here: fp32_modules net.0" in report.stdout  # the report judges layers as autocast runs them
    (line,) = [x for x in report.stdout.splitlines() if x.startswith("  - keep these layers in fp32")]
    flag = re.search(r"(--fp32_modules \S+)", line).group(1)
    assert flag == "--fp32_modules net.2,net.4" and "(checked: " in line
    saved = json.loads((tmp_path / "report" / "precision_report.json").read_text())
    assert saved["verdict"]["fp32_modules_flag"] == flag and saved["fp32_modules"]["checked"]
    # the fp8 exclusions: in the JSON, on the console, and as the Accelerate config file the JSON names
    assert saved["fp8"]["fp32_modules_flag"] == "--fp32_modules net.0,net.4"
    snippet = tmp_path / "report" / fp8.CONFIG_FILE
    assert saved["fp8"]["accelerate_config_file"] == str(snippet)
    assert snippet.read_text() == saved["fp8"]["accelerate_config"] and saved["fp8"]["launch"] in report.stdout
    assert "not fp8 speed" in report.stdout and "E4M3 SQNR dB" in report.stdout
    run = run_in_process(["--mixed_precision", "fp16", "--max_steps", "2", *flag.split(), "--output_dir",
                          tmp_path / "train"], capsys)  # recipes/train.py's main, in this process
    assert run.returncode == 0, run.stderr[-2000:]
    assert "fp32 modules   'net.2' -> net.2; 'net.4' -> net.4" in run.stdout.splitlines()


def test_the_weights_label_names_a_run_a_checkpoint_a_config_or_fresh_weights_with_the_seed(tmp_path):
    from mixprec.config.sections import ModelSettings
    from mixprec.run_folder.run_loading import weights_label

    # the model section alone: a label that read another section would fail here
    assert weights_label(ModelSettings(), 3, tmp_path / "model.safetensors") == str(tmp_path / "model.safetensors")
    assert weights_label(ModelSettings(model_name_or_path="m"), 3, None) == "m (the transformers checkpoint's)"
    assert weights_label(ModelSettings(config_name="c"), 7, None) == "fresh from c's config (--seed 7)"
    assert weights_label(ModelSettings(), 3, None) == "fresh (--seed 3)"
