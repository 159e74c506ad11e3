"""Experiment tracking: W&B offline runs read back with W&B's own reader (`wandb leet inspect`), TensorBoard
event files read back with TensorBoard's EventAccumulator, metrics.png opened with PIL, tracker failures that
leave training alone, one W&B run for two processes, and a resumed run that continues the same W&B run."""
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from PIL import Image

from mixprec import config
from mixprec.errors import UsageError
from mixprec.tracking import plots, trackers
from helpers import REPO, TRAIN, base_env, run_recipe

TRAIN_KEYS = {"train/loss", "train/lr", "train/grad_norm", "train/skipped_steps", "train/samples_per_s",
              "train/step_time_s", "train/mfu", "train/peak_memory_bytes", "epoch"}
EVAL_KEYS = {"eval/loss", "eval/accuracy"}


# ---------------------------------------------------------------- helpers: W&B's and TensorBoard's own readers

def wandb_records(piece: Path, *flags: str):
    """The records of an offline W&B run folder, as W&B's own `wandb leet inspect --json` prints them."""
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", *flags, str(piece)],
                          capture_output=True, text=True, timeout=120, check=True)
    if flags:
        return json.loads(proc.stdout)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def wandb_history(piece: Path) -> dict[int, dict]:
    """step -> the metrics W&B holds for that step."""
    return {r["history"]["step"]["num"]: r["history"]["item"] for r in wandb_records(piece) if r["type"] == "history"}


def tensorboard_scalars(logdir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return acc, {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_png(path: Path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 600 and image.size[1] > 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def no_wandb_login(monkeypatch, tmp_path):
    """Whatever this machine has, the recipe sees no W&B credentials and no W&B settings from the environment."""
    for name in [n for n in os.environ if n.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    empty = tmp_path / "netrc"
    empty.write_text("")
    monkeypatch.setenv("NETRC", str(empty))
    return empty


# ---------------------------------------------------------------- quick checks

def test_tracker_names():
    step = {"step": 10, "epoch": 0.5, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "skipped_steps": 0,
            "samples_per_s": 100.0, "loss_scale": 1024.0}
    assert trackers.tracker_values(step) == {"epoch": 0.5, "train/loss": 2.0, "train/lr": 1e-3,
                                             "train/grad_norm": 0.5, "train/skipped_steps": 0,
                                             "train/samples_per_s": 100.0, "train/loss_scale": 1024.0}
    assert trackers.tracker_values({"step": 20, "epoch": 1.0, "val_loss": 1.5, "val_accuracy": 0.7}) == {
        "epoch": 1.0, "eval/loss": 1.5, "eval/accuracy": 0.7}
    assert trackers.tracker_values({"step": 30, "event": "nan_loss", "loss": float("nan")})["event/event"] == "nan_loss"
    late = trackers.tracker_values({"step": 31, "event": "grad_norm_spike", "value": 50.0, "reported_at": 35})
    assert late == {"event/event": "grad_norm_spike", "event/value": 50.0, "event/step": 31}


def test_a_resume_keeps_the_records_written_by_its_checkpoints_step(tmp_path):
    """An event said after the step it is about (a spike, judged 4 steps later) was written at `reported_at`: a
    resume from a checkpoint between the two drops it, and the resumed run says it again, once."""
    from mixprec.tracking.record import MetricsLog

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 30, "loss": 1.0}, {"step": 31, "event": "grad_norm_spike", "reported_at": 35},
            {"step": 33, "event": "nan_loss"}, {"step": 36, "loss": 1.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = MetricsLog(path, enabled=True, resume_step=33)
    log.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [rows[0], rows[2]]


def test_wandb_mode_says_why(tmp_path):
    empty = tmp_path / "netrc"
    empty.write_text("")
    mode, why = trackers.wandb_mode({"NETRC": str(empty)})
    assert mode == "offline" and "not logged in" in why and str(empty) in why
    assert trackers.wandb_mode({"WANDB_MODE": "offline", "WANDB_API_KEY": "k" * 40}) == ("offline", "WANDB_MODE=offline")
    assert trackers.wandb_mode({"WANDB_MODE": "disabled"})[0] == "disabled"
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there: a machine without a network
    mode, why = trackers.wandb_mode({"WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": closed})
    assert mode == "offline" and "logged in (WANDB_API_KEY), but 127.0.0.1 cannot be reached" in why
    with socket.socket() as server:  # something listens: online
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        logged_in = tmp_path / "netrc_key"
        logged_in.write_text(f"machine 127.0.0.1\n  login user\n  password {'k' * 40}\n")
        logged_in.chmod(0o600)
        assert trackers.wandb_mode({"NETRC": str(logged_in), "WANDB_BASE_URL": url}) == (
            "online", f"logged in ({logged_in})")
        assert trackers.wandb_mode({"NETRC": str(empty), "WANDB_BASE_URL": url})[0] == "offline"


def test_tracking_flags(tmp_path, monkeypatch):
    yml = tmp_path / "c.yaml"
    yml.write_text("report_to: all\nproject: lesson\ntags: [fp16, baseline]\n")
    cfg = config.parse_config(["--config", str(yml)])
    assert (cfg.report_to, cfg.project, cfg.tags, cfg.run_name) == ("all", "lesson", ["fp16", "baseline"], None)
    assert config.parse_config(["--tags", "a, b,,c"]).tags == ["a", "b", "c"]
    assert config.parse_config([]).report_to == "none"
    for argv, words in [(["--report_to", "comet"], ["'comet'", "wandb, tensorboard, all"]),
                        (["--project", "me/proj"], ["'me/proj'", "without /"]),
                        (["--tags", "x" * 65], ["64 characters"])]:
        with pytest.raises(UsageError) as err:
            config.parse_config(argv)
        assert all(w in str(err.value) for w in words), str(err.value)
    monkeypatch.setitem(sys.modules, "wandb", None)  # Python's own way to make a package unimportable
    with pytest.raises(UsageError, match="--report_to all needs the 'wandb' package"):
        trackers.accelerator_kwargs(config.parse_config(["--report_to", "all"]))
    assert trackers.accelerator_kwargs(config.parse_config(["--report_to", "tensorboard"]))["log_with"][0].name == \
        "tensorboard"


def test_plot_is_a_png_with_or_without_data(tmp_path):
    records = [{"step": s, "epoch": s / 100, "loss": 2.0 / s, "lr": 1e-3, "grad_norm": 1.0,
                "skipped_steps": s // 30, "samples_per_s": 500.0, "loss_scale": 2.0 ** (16 - s // 30)}
               for s in range(10, 101, 10)]
    records += [{"step": 50, "epoch": 0.5, "val_loss": 0.1, "val_accuracy": 0.8},
                {"step": 60, "event": "loss_spike", "loss": "nan"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 1')
    assert_png(plots.plot_run(tmp_path))
    (tmp_path / "metrics.jsonl").write_text("")  # a run killed before its first log: still a picture
    assert_png(plots.plot_run(tmp_path, tmp_path / "empty.png"))


def test_plot_command(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_code:
        plots.main([str(tmp_path / "nope")])
    assert exit_code.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: '{tmp_path / 'nope'}' holds no metrics.jsonl: give a run folder (runs/NAME)")


# ---------------------------------------------------------------- end to end

ARGS = ["--report_to", "all", "--mixed_precision", "fp16", "--max_steps", "60", "--log_every", "10",
        "--eval_steps", "20", "--checkpointing_steps", "30", "--tags", "smoke,fp16", "--run_name", "lesson-fp16"]


@pytest.mark.slow
def test_offline_wandb_and_tensorboard_continue_after_a_crash(tmp_path, no_wandb_login):
    """Killed at step 45 (checkpoint at 30) and resumed: the same W&B run id continues from step 40, never
    from 0; TensorBoard drops what the crashed job wrote after the checkpoint; one plot of the whole run."""
    out = tmp_path / "run"
    killed = run_recipe(*ARGS, out=out, launcher="python", faults="kill_at_step=45", check=False)
    assert killed.returncode != 0
    assert f"W&B: offline (not logged in: no WANDB_API_KEY and no key for api.wandb.ai in {no_wandb_login})" \
        in killed.stdout
    resumed = run_recipe(*ARGS, "--resume_from_checkpoint", "latest", out=out, launcher="python")
    state = json.loads((out / "checkpoints" / "step_0000060" / "trainer_state.json").read_text())
    run_id = state["extra"]["tracking"]["wandb_run_id"]
    assert f"run {run_id} (continued from the checkpoint)" in resumed.stdout
    sync = f"wandb sync {out / 'wandb'}/offline-run-*-{run_id}"
    assert sync in resumed.stdout.splitlines()[-1]  # the last line of the run
    first, second = sorted((out / "wandb").glob(f"offline-run-*-{run_id}"))  # one run per job, one id
    assert len(list((out / "wandb").glob("offline-run-*"))) == 2

    before = wandb_history(first)  # W&B writes its file every 15 s and commits a step's row at the next step:
    assert sorted(before) == [10, 20, 30, 40][:len(before)]  # SIGKILL loses the last seconds, never more
    history = wandb_history(second)
    # the resumed job sends the record up to the checkpoint again (from metrics.jsonl), then continues after
    # step 30: the piece holds the whole run, in order, and no step is sent twice in one piece
    assert sorted(history) == [10, 20, 30, 40, 50, 60]
    assert all(before[s]["train/loss"] == history[s]["train/loss"] for s in before if s <= 30)
    mfu = {"train/mfu"} if "mfu" in resumed.train_records()[-1] else set()  # none where fp16 is emulated
    assert (TRAIN_KEYS - {"train/mfu"}) | mfu | {"train/loss_scale"} <= set(history[50])
    assert EVAL_KEYS <= set(history[60])
    assert history[60]["train/loss"] == resumed.train_records()[-1]["loss"]
    assert history[60]["train/loss_scale"] == 65536.0 and history[60]["eval/accuracy"] > 0.3

    summary = wandb_records(second, "--summary")
    assert (summary["run_id"], summary["name"], summary["project"]) == (run_id, "lesson-fp16", "mixprec")
    assert summary["tags"] == ["smoke", "fp16"] and summary["state"] == "finished"
    assert summary["summary"]["val_accuracy"] == resumed.summary()["val_accuracy"]
    logged = summary["config"]
    assert logged["config"]["mixed_precision"] == "fp16" and logged["config"]["report_to"] == "all"
    assert logged["effective"]["effective_precision"] == "fp16" and logged["effective"]["autocast_dtype"] == "float16"
    assert logged["effective"]["grad_scaler"]["init_scale"] == 65536 and "device_name" in logged["effective"]
    assert logged["environment"]["versions"]["torch"].startswith("2.") and "wandb" in logged["environment"]["versions"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert logged["environment"]["git_commit"] == head.stdout.strip()

    acc, steps = tensorboard_scalars(out / "tensorboard")
    assert steps["train/loss"] == [10, 20, 30, 40, 50, 60]  # the crashed job's step 40 purged, then relogged
    assert steps["eval/loss"] == [20, 40, 60] and steps["train/loss_scale"] == [10, 20, 30, 40, 50, 60]
    assert acc.Scalars("train/loss")[-1].value == pytest.approx(resumed.train_records()[-1]["loss"])
    assert {"config/text_summary", "summary/text_summary"} <= set(acc.Tags()["tensors"])

    assert_png(out / "metrics.png")
    assert f"curves: {out / 'metrics.png'}" in resumed.stdout


@pytest.mark.slow
def test_two_processes_make_one_wandb_run(tmp_path, no_wandb_login):
    out = tmp_path / "run"
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no",
           str(TRAIN), "--report_to", "wandb", "--max_steps", "20", "--log_every", "5", "--mixed_precision", "no",
           "--output_dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=base_env(), cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    (piece,) = (out / "wandb").glob("*run-*")  # exactly one run
    assert sorted(wandb_history(piece)) == [5, 10, 15, 20]
    assert proc.stdout.count("W&B: offline (not logged in") == 1 and proc.stdout.count("wandb sync") == 1


class _RejectingServer(http.server.BaseHTTPRequestHandler):
    """A W&B server that answers every request with 401: a bad API key, for real, over HTTP."""

    def _reject(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"errors": [{"message": "invalid api key"}]}'
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _reject

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_tracker_failures_never_stop_training(tmp_path, no_wandb_login, monkeypatch):
    """A bad API key (W&B falls back to offline), and both trackers raising at step 20: three warnings, and the
    run ends as if nothing had happened. (A file where TensorBoard's folder goes is refused before the run:
    tests/test_nothing_lost.py.)"""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RejectingServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.server_address[1]}")
    out = tmp_path / "run"
    try:
        run = run_recipe("--report_to", "all", "--max_steps", "40", "--log_every", "10", "--mixed_precision", "no",
                         out=out, launcher="python", faults="tracker_error=20")
    finally:
        server.shutdown()
    warnings = [line for line in run.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 3, run.stderr[-3000:]
    assert warnings[0].startswith("warning: W&B could not start online (CommError: ") and "invalid api key" in \
        warnings[0] and warnings[0].endswith("): logging offline instead")
    assert warnings[1].startswith("warning: W&B failed to log step 20 (OSError: [test hook] tracker_error=20)")
    assert warnings[2].startswith("warning: TensorBoard failed to log step 20 (OSError: [test hook] tracker_")
    assert "training goes on and metrics.jsonl keeps the record" in warnings[1]
    assert [r["step"] for r in run.train_records()] == [10, 20, 30, 40] and run.summary()["steps"] == 40
    (piece,) = (out / "wandb").glob("offline-run-*")
    assert sorted(wandb_history(piece)) == [10]  # what W&B got before it failed, still worth uploading:
    assert f"wandb sync {out / 'wandb'}/offline-run-*-{piece.name.split('-')[-1]}" in run.stdout
    assert_png(out / "metrics.png")


def tensorboard_texts(logdir: Path, tag: str) -> dict[int, str]:
    """step -> the text TensorBoard holds under `tag` (a string logged through Accelerate's tracker)."""
    acc, _ = tensorboard_scalars(logdir)
    return {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(f"{tag}/text_summary")}


@pytest.mark.slow
def test_fp16_overflow_names_its_module_in_every_record(tmp_path, no_wandb_login):
    """The real recipe in fp16 with an inf injected into net.2's gradient at step 3: the GradScaler skips the
    step, and the health event (--max_skipped_steps 1) names net.2 in metrics.jsonl, W&B and TensorBoard."""
    out = tmp_path / "run"
    run = run_recipe("--report_to", "all", "--mixed_precision", "fp16", "--max_steps", "4", "--log_every", "1",
                     "--max_skipped_steps", "1", out=out, launcher="python",
                     faults="inf_grad_at_step=3:net.2")
    assert [r["skipped_steps"] for r in run.train_records()] == [0, 0, 1, 1]
    (event,) = run.events()
    assert (event["step"], event["event"], event["modules"]) == (3, "skipped_steps", "net.2")
    assert "net.2" in event["diagnosis"] and "[health] step 3: skipped_steps" in run.stdout
    (piece,) = (out / "wandb").glob("offline-run-*")
    history = wandb_history(piece)
    assert history[3]["event/event"] == "skipped_steps" and history[3]["event/modules"] == "net.2"
    assert "event/modules" not in history[2] and history[3]["train/skipped_steps"] == 1
    assert tensorboard_texts(out / "tensorboard", "event/modules") == {3: "net.2"}


@pytest.mark.parametrize("mode", ["bogus", "OFFLINE"])  # wandb 0.31's init refuses OFFLINE: its modes are lower case
def test_a_wandb_mode_that_wandb_refuses_is_one_line_before_the_run_folder(mode, tmp_path, capsys, monkeypatch,
                                                                            fresh_accelerate_state):
    """wandb.init would refuse WANDB_MODE=bogus after the run folder opened (a warning, W&B off): the tracker
    set-up checks it in memory, with the other settings, and stops in one line."""
    from helpers import assert_one_line_error, run_in_process

    monkeypatch.setenv("WANDB_MODE", mode)
    out = tmp_path / "run"
    run = run_in_process(["--report_to", "wandb", "--max_steps", "2", "--output_dir", out], capsys)
    assert_one_line_error(run, f"WANDB_MODE={mode!r}", "offline")
    assert not out.exists()
    monkeypatch.setenv("WANDB_MODE", "bogus")
    run = run_in_process(["--report_to", "tensorboard", "--max_steps", "2", "--output_dir", out,
                          "--mixed_precision", "no"], capsys)  # W&B not asked for: its variable is not its business
    assert run.returncode == 0, run.stderr[-2000:]


def test_a_tracker_warning_says_what_to_do_about_an_errno():
    import errno

    full = trackers._short(OSError(errno.ENOSPC, "No space left on device", "/run/wandb/run.wandb"))
    assert full.startswith("OSError: [Errno 28] No space left on device")
    assert full.endswith("the disk is full: free space")
    assert trackers._short(NotADirectoryError(errno.ENOTDIR, "Not a directory")).endswith("move it away")
    assert trackers._short(ValueError("bad")) == "ValueError: bad"
