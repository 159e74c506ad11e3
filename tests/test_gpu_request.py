"""A launch that names GPUs on a machine where torch sees none stops before training, before the run folder
is touched, with one line naming the likely cause and exit code 2; CPU launches (cpu.yaml, multi_cpu.yaml, the
DeepSpeed configs, no config) are unchanged."""
import pytest
import torch

from mixprec.devices import hardware
from helpers import CONFIGS, Run, assert_one_line_error, run_in_process, run_recipe

SINGLE_GPU = ["--config_file", "accelerate_configs/single_gpu.yaml"]


@pytest.mark.parametrize("argv, asked", [
    (SINGLE_GPU, ("0", "gpu_ids in accelerate_configs/single_gpu.yaml")),
    ([f"--config_file={CONFIGS / 'single_gpu.yaml'}"], ("0", f"gpu_ids in {CONFIGS / 'single_gpu.yaml'}")),
    (["--multi_gpu", "--gpu_ids", "0,1", "--num_processes", "2"], ("0,1", "--gpu_ids")),
    ([*SINGLE_GPU, "--cpu"], None),
    (["--config_file", str(CONFIGS / "cpu.yaml")], None),  # use_cpu: true
    (["--config_file", str(CONFIGS / "multi_cpu.yaml")], None),  # gpu_ids '-1,-1'
    (["--config_file", str(CONFIGS / "multi_gpu.yaml")], None),  # gpu_ids all: --multi_gpu forms a gloo group
    (["--config_file", str(CONFIGS / "deepspeed_zero2.yaml"), "--num_processes", "2"], None),  # GPUs or CPUs
    (["--num_processes", "1"], None),  # no config: what the machine has (README's `accelerate launch`)
    (None, None),  # not started by `accelerate launch`
])
def test_which_launches_name_gpus(argv, asked, monkeypatch, tmp_path):
    monkeypatch.setattr("accelerate.commands.config.default_config_file", str(tmp_path / "none.yaml"))
    assert hardware.requested_gpus(argv) == asked


def _refused(monkeypatch, capsys, tmp_path, cuda, visible) -> str:
    monkeypatch.setattr(hardware, "_launcher_argv", lambda: SINGLE_GPU)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "False")
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    out = tmp_path / "run"
    run = run_in_process(["--max_steps", "1", "--output_dir", out], capsys)
    line = assert_one_line_error(Run(run.returncode, run.stdout, run.stderr, out),
                                 "the launch asks for GPU 0 (gpu_ids in accelerate_configs/single_gpu.yaml) but "
                                 "torch sees no GPU", "launch with accelerate_configs/cpu.yaml")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    return line


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here")
@pytest.mark.parametrize("cuda, visible, cause", [
    (None, None, "is a CPU-only build (torch.version.cuda is None): install a CUDA build of torch"),
    ("12.8", "", "CUDA_VISIBLE_DEVICES='' hides the GPUs: unset it"),
    ("12.8", "-1", "CUDA_VISIBLE_DEVICES='-1' hides the GPUs"),
    ("12.8", "0", "built for CUDA 12.8 but finds no GPU among CUDA_VISIBLE_DEVICES=0: check the NVIDIA driver"),
    ("12.8", None, "built for CUDA 12.8 but finds no GPU: check the NVIDIA driver (nvidia-smi"),
])
def test_the_refusal_names_the_likely_cause(monkeypatch, capsys, tmp_path, cuda, visible, cause):
    assert cause in _refused(monkeypatch, capsys, tmp_path, cuda, visible)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here")
def test_single_gpu_yaml_through_the_real_launcher_stops_before_training(tmp_path):
    out = tmp_path / "run"
    run = run_recipe("--max_steps", "2", out=out, config=CONFIGS / "single_gpu.yaml", check=False, timeout=300)
    assert run.returncode == 1 and "returned non-zero exit status 2" in run.stderr  # the launcher turns 2 into 1
    first = next(line for line in run.stderr.splitlines() if line.strip())
    assert first.startswith("error: the launch asks for GPU 0 (gpu_ids in ") and "CPU-only build" in first
    assert "Traceback" not in run.stderr.split(first)[0] and run.stdout == ""
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # README's command: `accelerate launch -q` (1.16 adds its own traceback to a failed child; -q drops it)
    quiet = run_recipe("--max_steps", "2", out=out, config=CONFIGS / "single_gpu.yaml", launch_args=("-q",),
                       check=False, timeout=300)
    lines = [line for line in quiet.stderr.splitlines() if line.strip()]
    assert quiet.returncode == 1 and "Traceback" not in quiet.stderr, quiet.stderr[-2000:]
    assert lines[0].startswith("error: the launch asks for GPU 0") and len(lines) == 1, lines
    assert not out.exists() and list(tmp_path.iterdir()) == []
