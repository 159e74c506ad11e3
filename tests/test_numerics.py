"""The precision diff (recipes/precision_diff.py): it names the module that a precision breaks, finds it exact once
--fp32_modules keeps it in fp32, simulates bf16/fp16/fp8 as the real kernels compute them, and runs like training.
--fp32_modules in training: tests/test_fp32_modules.py."""
import json
import math
import subprocess
import sys
from importlib import import_module

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file

from mixprec import models
from mixprec.formats import fp8, simulate
from helpers import REPO, base_env, run_recipe

DIFF = REPO / "recipes" / "precision_diff.py"
INFO = {"num_features": 100, "num_classes": 10}
OVERFLOW = 1e5  # above fp16's largest value, 65504


def fragile_weights(path, seed=0):
    """The lesson's MLP whose output layer adds 1e5 to every logit: harmless in fp32 (softmax ignores a constant),
    inf in fp16, where that bias and the logits exceed 65504. The other layers are healthy."""
    torch.manual_seed(seed)
    state = models.build("mlp", INFO).state_dict()
    state["net.4.bias"] = state["net.4.bias"] + OVERFLOW
    save_file({k: v.contiguous() for k, v in state.items()}, path)
    return path


def diff_in_process(args, capsys) -> tuple[dict, str]:
    """recipes/precision_diff.py's main in this process: (the result, stdout)."""
    sys.path.insert(0, str(REPO / "recipes"))
    try:
        recipe = import_module("precision_diff")
    finally:
        sys.path.remove(str(REPO / "recipes"))
    result = recipe.main([str(a) for a in args])
    return result, capsys.readouterr().out


def by_rank(result: dict) -> list[dict]:
    return sorted(result["modules"], key=lambda r: r["rank"])


def rows(result: dict) -> dict[str, dict]:
    return {r["module"]: r for r in result["modules"]}


def table_rows(console: str) -> list[list[str]]:
    """The console's module table, worst first: the cells of each row."""
    lines = console.split("modules, worst first:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return [line.split() for line in lines[2:]]  # after the header and its rule


# --- the precision diff on a fragile model --------------------------------------------------------------------------

@pytest.mark.slow
def test_the_diff_ranks_an_overflowing_layer_first(tmp_path):
    weights = fragile_weights(tmp_path / "fragile.safetensors")
    out = tmp_path / "diff"
    # fp16 simulated on every CPU (auto simulates it only where the CPU lacks AVX512-FP16/AMX-FP16), so that the
    # test reads the same on each kind of machine
    run = run_recipe("--resume_from_checkpoint", weights, "--compare", "no,fp16", "--steps", "2", "--simulate",
                     "always", out=out, launcher="python", script=DIFF, cwd=tmp_path)
    result = json.loads((out / "diff.json").read_text())
    worst = by_rank(result)[0]
    assert worst["module"] == "net.4" and worst["worst_local_sqnr_db"] == "-inf"  # JSON: inf and NaN as strings
    assert all(step["nonfinite"] > 0 for step in worst["local"])
    for name in ("net.0", "net.2"):  # healthy layers: fp16's rounding, about 3e-4
        local = rows(result)[name]["local"]
        assert all(1e-5 < s["rel_error"] < 3e-3 and s["nonfinite"] == 0 for s in local), (name, local)
    assert [s["loss"]["fp16"] for s in result["steps"]] == ["nan", "nan"]
    assert all(s["fp16"]["skipped"] for s in result["steps"]) and result["meta"]["simulated"]["fp16"]

    cells = table_rows(run.stdout)
    assert cells[0][:3] == ["1", "net.4", "Linear"] and cells[0][4] == "NaN/Inf"
    md = (out / "diff.md").read_text()
    table = md.split("## Modules, worst first\n\n", 1)[1].splitlines()
    assert table[2].startswith("| 1 | net.4 | Linear | inf | NaN/Inf |")
    assert "fp16 simulated" in md and "skipped (NaN/Inf gradients)" in md
    png = out / "diff.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] >= 1000
    assert f"wrote {out / 'diff.json'}, {out / 'diff.md'}, {png}" in run.stdout


@pytest.mark.slow
def test_the_overflowing_layer_in_fp32_is_exact(tmp_path, capsys):
    weights = fragile_weights(tmp_path / "fragile.safetensors")
    result, console = diff_in_process(["--resume_from_checkpoint", weights, "--compare", "no,fp16", "--steps", "2",
                                       "--fp32_modules", "net.4", "--output_dir", tmp_path / "diff"], capsys)
    fixed = rows(result)["net.4"]
    assert all(s["rel_error"] == 0 and s["sqnr_db"] == math.inf for s in fixed["local"])  # fp32: no error at all
    assert by_rank(result)[0]["module"] in ("net.0", "net.2")  # the worst is fp16's rounding now
    assert by_rank(result)[0]["worst_local_sqnr_db"] > 50
    for step in result["steps"]:  # the overflow is gone: every step applied, the losses agree
        assert not step["fp16"]["skipped"] and step["loss_rel_diff"] < 1e-3
    assert result["meta"]["fp32_modules"] == {"net.4": ["net.4"]}
    assert "--fp32_modules: 'net.4' -> net.4 (fp32 in both runs)" in console
    net4 = next(cells for cells in table_rows(console) if cells[1] == "net.4")
    assert net4[3:5] == ["0", "exact"]
    assert "| net.4 | Linear | 0 | exact |" in (tmp_path / "diff" / "diff.md").read_text()


@pytest.mark.slow
def test_an_overflowing_layer_inside_attention_is_ranked_before_the_attention(tmp_path, capsys):
    """A huge-scale Linear (the first block's attention output projection, weights x 1e7) in gpt_tiny: its outputs
    exceed 65504. The attention module around it overflows too, alone; the layer where it starts ranks first."""
    torch.manual_seed(0)
    state = models.build("gpt_tiny", {"task": "language_modeling", "vocab_size": 256, "block_size": 64}).state_dict()
    state["h.0.attn.c_proj.weight"] = state["h.0.attn.c_proj.weight"] * 1e7
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "fragile.safetensors")
    result, _ = diff_in_process(["--config", REPO / "recipes" / "configs" / "gpt_tiny.yaml", "--resume_from_checkpoint",
                                 tmp_path / "fragile.safetensors", "--compare", "no,fp16", "--steps", "1",
                                 "--batch_size", "8", "--output_dir", tmp_path / "diff"], capsys)
    ranked = by_rank(result)
    assert [r["module"] for r in ranked[:2]] == ["h.0.attn.c_proj", "h.0.attn"]
    assert all(r["worst_local_sqnr_db"] == -math.inf for r in ranked[:2])
    assert ranked[2]["worst_local_sqnr_db"] > 50  # every other module: fp16's rounding alone


@pytest.mark.slow
def test_the_tied_output_projection_is_measured_alone_like_the_other_linears(tmp_path, capsys):
    """gpt_tiny's logits matmul uses wte's weight (lm_head, a TiedLinear): it has its own row, its bf16 error
    measured alone is of the order of every other Linear's (one bf16 rounding of inputs and output)."""
    result, console = diff_in_process(["--config", REPO / "recipes" / "configs" / "gpt_tiny.yaml", "--compare",
                                       "no,bf16", "--steps", "1", "--batch_size", "8", "--output_dir",
                                       tmp_path / "diff"], capsys)
    row = rows(result)["lm_head"]
    linears = [r["local"][0]["rel_error"] for r in result["modules"] if r["type"] == "Linear"]
    assert row["type"] == "TiedLinear" and len(linears) == 8 and row["grad"] == [None]  # its gradient: wte's
    assert min(linears) / 2 < row["local"][0]["rel_error"] < 2 * max(linears)
    assert 1e-3 < row["local"][0]["rel_error"] < 1e-2  # bf16: 8 bits of mantissa, 2^-9 per rounding
    assert any(cells[1] == "lm_head" for cells in table_rows(console))


@pytest.mark.slow
def test_modules_inside_a_module_kept_in_fp32_are_exact(tmp_path, capsys):
    """--fp32_modules net keeps the whole Sequential, its layers included, in fp32: every error is zero, the
    layers measured alone too."""
    result, _ = diff_in_process(["--compare", "no,bf16", "--steps", "1", "--fp32_modules", "net",
                                 "--output_dir", tmp_path / "diff"], capsys)
    for name in ("net.0", "net.2", "net.4"):
        row = rows(result)[name]
        assert [row[kind][0]["rel_error"] for kind in ("local", "output", "grad")] == [0, 0, 0], name
    assert result["steps"][0]["loss_diff"] == 0 and result["weights"]["total"]["rel_divergence"] == 0


# --- the simulation against real autocast ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_simulated_autocast_is_real_autocast_to_one_rounding(fmt, dtype):
    """What the diff simulates on CPUs without 16-bit arithmetic: a Linear layer's output and all its gradients as
    real autocast computes them (torch's emulated 16-bit kernels here), to one unit in the last place; a
    convolution the same; attention's error of the same size as real autocast's."""
    results = {}
    for real in (False, True):
        gen = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        linear = torch.nn.Linear(64, 32)
        x = torch.randn(16, 64, generator=gen, requires_grad=True)
        image, kernel = torch.randn(2, 3, 12, 12, generator=gen), torch.randn(8, 3, 3, 3, generator=gen) * 0.2
        qkv = torch.randn(3, 2, 4, 32, 16, generator=gen)
        with simulate.computing(fmt, real=real):
            y = linear(x)
            conv = F.conv2d(image, kernel, padding=1)
            attention = F.scaled_dot_product_attention(*qkv, is_causal=True)
        assert (y.dtype == dtype) == real  # simulated: fp32 tensors holding 16-bit values
        y.float().pow(2).sum().backward()
        results[real] = [t.float() for t in (y, linear.weight.grad, linear.bias.grad, x.grad, conv, attention)]
    eps = torch.finfo(dtype).eps
    for simulated, real in zip(results[False][:5], results[True][:5]):
        torch.testing.assert_close(simulated, real, rtol=eps, atol=1e-6)
    exact = F.scaled_dot_product_attention(*qkv, is_causal=True)
    errors = [((r[5] - exact).norm() / exact.norm()).item() for r in (results[False], results[True])]
    assert 0.5 < errors[0] / errors[1] < 2 and errors[1] < 10 * eps


@pytest.mark.slow
def test_the_diff_with_real_autocast_ranks_the_overflowing_layer_first_too(tmp_path, capsys):
    weights = fragile_weights(tmp_path / "fragile.safetensors")
    result, console = diff_in_process(["--resume_from_checkpoint", weights, "--compare", "no,fp16", "--steps", "1",
                                       "--simulate", "never", "--output_dir", tmp_path / "diff"], capsys)
    assert result["meta"]["simulated"]["fp16"] is False and "fp16 autocast (real fp16 kernels" in console
    assert [r["module"] for r in by_rank(result)][:1] == ["net.4"] and by_rank(result)[0]["local"][0]["nonfinite"]
    assert all(rows(result)[n]["local"][0]["rel_error"] < 3e-3 for n in ("net.0", "net.2"))


# --- fp8, simulated ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("a_fmt, b_fmt, recipe", [("e4m3", "e4m3", "tensorwise"), ("e5m2", "e4m3", "tensorwise"),
                                                  ("e4m3", "e4m3", "rowwise")])
def test_the_simulated_fp8_gemm_is_torchs_scaled_mm(a_fmt, b_fmt, recipe):
    """The diff's fp8 matmul against torch's own fp8 GEMM (torch._scaled_mm, which runs on CPUs too) fed the same
    fp8 values and scales: equal to fp32 rounding."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 64, generator=gen), torch.randn(48, 64, generator=gen) * 0.1
    ours = fp8._gemm(a, a_fmt, b, b_fmt, recipe)
    operands = []
    for x, fmt in ((a, a_fmt), (b, b_fmt)):
        scale, top = fp8.scale_for(x, fmt, recipe), torch.finfo(fp8.FORMATS[fmt]).max
        operands.append(((x * scale).clamp(-top, top).to(fp8.FORMATS[fmt]), (1 / scale).float()))
    (qa, inv_a), (qb, inv_b) = operands
    if recipe == "rowwise":
        inv_a, inv_b = inv_a.reshape(-1, 1), inv_b.reshape(1, -1)
    torchs = torch._scaled_mm(qa, qb.t(), scale_a=inv_a, scale_b=inv_b, out_dtype=torch.float32)
    torch.testing.assert_close(ours, torchs, rtol=1e-6, atol=1e-5)
    error = ((ours - a @ b.t()).norm() / (a @ b.t()).norm()).item()
    assert 0.01 < error < 0.1  # fp8's few mantissa bits: a few percent


@pytest.mark.slow
def test_fp8_against_fp32_on_a_cpu(tmp_path, capsys):
    result, console = diff_in_process(["--compare", "no,fp8", "--steps", "1", "--output_dir", tmp_path / "a"], capsys)
    assert result["fp8_layers"] == {"net.0": "first Linear layer", "net.2": None, "net.4": "last Linear layer"}
    assert ("fp8: 1 of 3 Linear layers in fp8 (tensorwise scales); not in fp8: net.0 (first Linear layer: bf16), "
            "net.4 (last Linear layer: bf16)") in console
    worst = by_rank(result)[0]
    assert worst["module"] == "net.2" and 0.01 < worst["local"][0]["rel_error"] < 0.1  # E4M3: 3 mantissa bits
    assert all(rows(result)[n]["local"][0]["rel_error"] < 0.01 for n in ("net.0", "net.4"))  # bf16's rounding
    assert result["meta"]["simulated"] == {"no": False, "fp8": True} and "E4M3" in result["meta"]["how"]["fp8"]

    result, console = diff_in_process(["--compare", "no,fp8", "--steps", "1", "--fp32_modules", "net.2",
                                       "--fp8_recipe", "rowwise", "--output_dir", tmp_path / "b"], capsys)
    assert result["fp8_layers"]["net.2"] == "--fp32_modules"
    assert "0 of 3 Linear layers in fp8 (rowwise scales)" in console and "net.2 (--fp32_modules: fp32)" in console
    assert rows(result)["net.2"]["local"][0]["rel_error"] == 0


def test_the_diff_steps_like_train_py():
    """The diff's optimizer is the one recipes/train.py builds on this device: fused AdamW on CPUs."""
    from mixprec import config
    from mixprec.training import speed
    from mixprec.numerics import diff

    cfg = config.parse_config([])
    cpu = torch.device("cpu")
    for name in ("no", "fp16"):
        trainer = diff.Trainer(models.build("mlp", INFO), diff.Side(name, True, ""), cfg.optim, cfg.precision, cpu,
                               steps=3)
        assert trainer.optimizer.defaults["fused"] is speed.fused_adamw(cpu) is True
        assert (trainer.scaler is not None) == (name == "fp16")


@pytest.mark.parametrize("script, argv, error", [  # a launch each: the report's in the quick tier
    pytest.param("precision_diff", ["--fp32_modules", "nope"], "--fp32_modules 'nope' matches no module of --model mlp",
                 marks=pytest.mark.slow),
    ("precision_report", ["--num_batches", "0"], "--num_batches 0 must be positive")])
def test_the_tools_let_idle_openmp_threads_sleep_before_torch_loads(tmp_path, script, argv, error):
    """As recipes/train.py does (mixprec.devices.threads): spinning OpenMP threads beside another busy process make the
    tools several times slower on a few cores. The policy must be in the environment when torch loads."""
    probe = f"""
import importlib.abc, os, sys
seen = []
class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("OMP_WAIT_POLICY"))
sys.meta_path.insert(0, Finder())
sys.path.insert(0, {str(REPO / "recipes")!r})
import {script}
try:
    {script}.main({argv!r} + ["--output_dir", {str(tmp_path / "out")!r}])
except SystemExit as exited:
    print("exit", exited.code, "policy at torch import:", seen)
"""
    env = {k: v for k, v in base_env().items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert "exit 2 policy at torch import: ['PASSIVE']" in proc.stdout, proc.stdout + proc.stderr
    assert error in proc.stderr


def test_the_diff_refuses_fp32_modules_auto_in_one_line(tmp_path):
    """`auto` is chosen while training (mixprec.precision.auto_fp32); the diff compares modules it is given."""
    proc = subprocess.run([sys.executable, "recipes/precision_diff.py", "--compare", "no,fp16", "--steps", "1",
                           "--fp32_modules", "auto", "--output_dir", str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, env=base_env(), timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "effective.fp32_plan" in proc.stderr
    assert not (tmp_path / "out").exists()
