"""Several processes on CPUs, for real: accelerate launch with accelerate_configs/multi_cpu.yaml starts 2
processes that form one gloo group. (a) 2 processes x batch B train like 1 process x batch 2B, (b) only the
global main process writes the run folder, (c) a killed 2-process run resumes to the same result; and the
launches that would quietly train alone are refused."""
import json
import subprocess

import pytest

from helpers import CONFIGS, CPU_CONFIG, REPO, TRAIN, base_env, free_port, hooks_env, run_recipe

pytestmark = pytest.mark.slow
ARGS = ["--mixed_precision", "no", "--max_steps", "30", "--log_every", "5", "--eval_steps", "10",
        "--checkpointing_steps", "10", "--checkpoints_total_limit", "3"]


def two_processes(*args, out, env=None, check=True, faults=None):
    return run_recipe(*args, out=out, config=CONFIGS / "multi_cpu.yaml", env=env, check=check, faults=faults,
                      launch_args=("--main_process_port", free_port()))




@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiprocess")
    audit = root / "audit"
    audit.mkdir()
    audit_env = hooks_env(audit=(root / "two", audit))
    runs = {"one": run_recipe(*ARGS, "--batch_size", "64", out=root / "one"),
            "two": two_processes(*ARGS, "--batch_size", "32", out=root / "two", env=audit_env),
            "killed": two_processes(*ARGS, "--batch_size", "32", out=root / "resumed", check=False,
                                    faults="kill_at_step=15")}
    runs["killed_latest"] = (root / "resumed" / "checkpoints" / "latest").read_text()
    runs["resumed"] = two_processes(*ARGS, "--batch_size", "32", "--resume_from_checkpoint", "latest",
                                    out=root / "resumed")
    runs["audit"] = {int(p.stem.split("-")[1]): [json.loads(line) for line in p.read_text().splitlines()]
                     for p in audit.glob("rank-*.jsonl")}
    return runs


def test_two_processes_form_one_gloo_group(runs):
    two = runs["two"]
    assert "processes      2 (MULTI_CPU, backend gloo)" in two.stdout
    effective = two.config()["effective"]
    assert (effective["world_size"], effective["backend"], effective["distributed_type"]) == (2, "gloo", "MULTI_CPU")
    assert two.summary()["world_size"] == 2 and runs["one"].summary()["world_size"] == 1
    assert two.config()["derived"]["samples_per_step"] == 64  # 32 per process x 2 processes


def test_two_processes_of_batch_b_match_one_process_of_batch_2b(runs):
    one, two = runs["one"].metrics(), runs["two"].metrics()
    assert [r["step"] for r in one] == [r["step"] for r in two] and len(one) == 9  # 6 logs, 3 evaluations
    for a, b in zip(one, two):
        for key in ("loss", "grad_norm", "val_loss", "val_accuracy"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
    losses = [r["loss"] for r in runs["two"].train_records()]
    assert losses[-1] < losses[0] - 0.1  # and it learns


def test_only_the_global_main_process_writes(runs):
    audit, two = runs["audit"], runs["two"]
    assert sorted(audit) == [0, 1]
    steps = [10, 20, 30]
    # rank 1 writes its own RNG state into each checkpoint (resume needs it) and nothing else
    rank1 = [(e["op"], e["path"]) for e in audit[1] if e["op"] != "mkdir"]
    assert rank1 == [("write", f"checkpoints/.tmp-step_{s:07d}/random_states_1.pkl") for s in steps]
    made0 = {e["path"] for e in audit[0] if e["op"] == "mkdir"}
    assert {e["path"] for e in audit[1] if e["op"] == "mkdir"} <= made0  # exist_ok on folders rank 0 made
    written0 = {e["path"] for e in audit[0] if e["op"] == "write"}
    assert {"metrics.jsonl", "model.safetensors", ".summary.json.tmp", ".config.yaml.tmp"} <= written0
    for s in steps:
        assert {f"checkpoints/.tmp-step_{s:07d}/{f}" for f in ("model.safetensors", "optimizer.bin",
                                                                "random_states_0.pkl")} <= written0
    # and the record reads like one run: every logged step once
    assert [r["step"] for r in two.train_records()] == [5, 10, 15, 20, 25, 30]
    assert [r["step"] for r in two.eval_records()] == steps


def test_a_killed_two_process_run_resumes_to_the_same_result(runs):
    killed, resumed = runs["killed"], runs["resumed"]
    assert killed.returncode != 0 and runs["killed_latest"] == "step_0000010"
    assert "resumed from" in resumed.stdout and "at step 10 (epoch 0, batch 10)" in resumed.stdout
    assert resumed.comparable() == runs["two"].comparable()
    for key in ("steps", "train_loss", "val_loss", "val_accuracy", "world_size"):
        assert resumed.summary()[key] == runs["two"].summary()[key], key


@pytest.mark.parametrize("how", ["--cpu flag", "MULTI_CPU config"])
def test_a_launch_that_starts_one_of_several_processes_is_refused(tmp_path, how):
    if how == "--cpu flag":
        config, launch_args = CPU_CONFIG, ("--cpu", "--num_processes", "2")
    else:
        config = tmp_path / "multi_cpu_mpi.yaml"
        config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_machines: 1\n"
                          "num_processes: 2\nuse_cpu: true\nmixed_precision: 'no'\n")
        launch_args = ()
    run = run_recipe("--max_steps", "2", out=tmp_path / "run", config=config, check=False,
                     launch_args=(*launch_args, "--main_process_port", free_port()))
    assert run.returncode != 0
    assert "error: accelerate launch was asked for several processes but started only this one" in run.stderr
    assert not (tmp_path / "run").exists()


def test_fsdp_on_cpus_is_refused_not_quietly_ddp(tmp_path):
    run = run_recipe("--max_steps", "2", out=tmp_path / "run", config=CONFIGS / "fsdp.yaml", check=False,
                     launch_args=("--num_processes", "2", "--main_process_port", free_port()))
    assert run.returncode != 0 and "error: FSDP needs CUDA GPUs" in run.stderr
    assert not (tmp_path / "run").exists()


def test_multi_node_config_two_machines_on_one_host(tmp_path):
    """multi_node.yaml with 2 'machines' of 1 process each, both on this host: one gloo group of 2."""
    port, out = free_port(), tmp_path / "run"
    procs = [subprocess.Popen(
        ["accelerate", "launch", "--config_file", str(CONFIGS / "multi_node.yaml"), "--num_processes", "2",
         "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
         str(TRAIN), "--mixed_precision", "no", "--max_steps", "20", "--log_every", "10", "--output_dir", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=base_env(), cwd=REPO) for rank in (0, 1)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    banner = "processes      2 (MULTI_CPU, backend gloo)"
    assert banner in logs[0] and banner not in logs[1]  # said once per run, by the global main process
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 20
