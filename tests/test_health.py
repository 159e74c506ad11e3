"""Health checks: skipped steps that really skip (fused AdamW too), NaN that halts and resumes, diagnoses."""
import json
import math

import pytest
import torch

import faults
from mixprec import config, health, models, optim, precision
from mixprec.errors import UsageError
from mixprec.health import Watch
from mixprec.health.watch import SPIKE_CONFIRM
from helpers import run_recipe

# 30 steps of warmup (the lr rises every step, so a step the schedule skips shows), checkpoints every 5
ARGS = ["--max_steps", "30", "--warmup_steps", "40", "--log_every", "1", "--checkpointing_steps", "5",
        "--checkpoints_total_limit", "10", "--mixed_precision", "fp16"]


def steps(run) -> dict[int, dict]:
    return {r["step"]: r for r in run.train_records()}


def events(run) -> list[dict]:
    return [r for r in run.metrics() if "event" in r]


def adam_steps(checkpoint) -> set[float]:
    state = torch.load(checkpoint / "optimizer.bin", weights_only=False)["state"]
    return {s["step"].item() for s in state.values()}




# --- the watch, on its own -------------------------------------------------------------------------------------

def feed(watch, n, start=1, loss=2.0, grad_norm=1.0, skipped=False, scale=None, nonfinite_loss=False):
    out = []
    for step in range(start, start + n):
        value = loss(step) if callable(loss) else loss
        out += watch.observe(step, loss=value, grad_norm=grad_norm, nonfinite_loss=nonfinite_loss, skipped=skipped,
                             scale=scale, lr=1e-3)
    return out


def test_a_plateau_after_learning_is_not_a_stall():
    """A loss that levels off after falling, as a converging run does late in a decaying schedule, flapping
    around the tolerance, gives no event."""
    watch = Watch(flat_loss_window=20, flat_loss_tolerance=0.01)
    assert feed(watch, 60, loss=lambda s: 2.3 * 0.97 ** s) == []
    assert feed(watch, 300, start=61, loss=lambda s: 0.4 + 0.004 * (-1) ** (s // 7)) == []


def test_a_stall_is_reported_once_per_episode():
    watch = Watch(flat_loss_window=20, flat_loss_tolerance=0.01)
    stall = feed(watch, 100, loss=lambda s: 2.3 + 0.01 * (-1) ** (s // 7))  # never falls from where it started
    assert [(e.event, e.step) for e in stall] == [("loss_flat", 20)]
    assert "training is stalled" in stall[0].diagnosis and "learning rate" in stall[0].diagnosis
    assert feed(watch, 20, start=101, loss=lambda s: 2.3 * 0.97 ** (s - 100)) == []  # it learns: the episode ends
    assert feed(watch, 60, start=121, loss=2.3 * 0.97 ** 20) == []  # a plateau well below the start: not a stall


def test_a_loss_stuck_from_the_start_suggests_vanishing_gradients_and_the_scaler():
    watch = Watch(precision="fp16", flat_loss_window=10)
    (event,) = feed(watch, 10, loss=2.3026, scale=65536.0)
    assert event.event == "loss_flat" and "vanishing gradients" in event.diagnosis
    assert "check the scaler" in event.diagnosis and "--init_scale" in event.diagnosis


def test_gradient_norm_spike():
    """A norm 10x its median is a suspect; the losses of the SPIKE_CONFIRM steps after it decide: risen by half,
    it is exploding gradients, reported on the spike's own step with that step's values; else nothing."""
    watch = Watch(grad_spike_factor=10)
    lrs = iter(range(1, 100))
    lr_of = {}

    def steps(n, start, **kwargs):
        out = []
        for step in range(start, start + n):
            lr_of[step] = next(lrs) * 1e-4
            out += watch.observe(step, loss=kwargs.get("loss", 2.0), grad_norm=kwargs.get("grad_norm", 1.0),
                                 nonfinite_loss=False, skipped=False, scale=None, lr=lr_of[step])
        return out
    assert steps(30, 1) == []
    assert steps(1, 31, grad_norm=50.0) == []
    assert steps(SPIKE_CONFIRM - 1, 32, loss=4.0, grad_norm=60.0) == []  # the same episode, judged after
    (spike,) = steps(1, 32 + SPIKE_CONFIRM - 1, loss=4.0)
    assert spike.event == "grad_norm_spike" and spike.step == 31 and spike.value == 50.0 and spike.threshold == 10.0
    assert spike.lr == lr_of[31] and spike.cause == "exploding_gradients"
    assert "lower the learning rate" in spike.diagnosis.lower() and "--max_grad_norm" in spike.diagnosis
    assert "averaged 4, up from 2" in spike.diagnosis
    assert steps(5, 40, loss=2.0) == []
    assert steps(1, 45, grad_norm=70.0) == [] and steps(SPIKE_CONFIRM, 46, loss=2.2) == []  # the loss held: nothing
    assert steps(1, 50, grad_norm=80.0) == [] and steps(1, 51, loss=float("nan"), grad_norm=float("nan")) != []
    assert watch.suspect is None  # a non-finite loss's own event names the cause


def test_a_spike_waiting_for_its_verdict_survives_a_resume():
    first, second = Watch(grad_spike_factor=10), Watch(grad_spike_factor=10)
    feed(first, 30)
    feed(first, 1, start=31, grad_norm=50.0)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert second.state_dict() == first.state_dict()
    said = [e.record() for e in feed(second, SPIKE_CONFIRM, start=32, loss=4.0)]
    assert said == [e.record() for e in feed(first, SPIKE_CONFIRM, start=32, loss=4.0)]
    assert [(r["step"], r["reported_at"]) for r in said] == [(31, 31 + SPIKE_CONFIRM)]


def test_skipped_steps_in_a_row_and_a_falling_scale():
    watch = Watch(precision="fp16", max_skipped_steps=3, min_loss_scale=1.0, init_scale=2.0 ** 20)
    seen = []
    for step in range(1, 13):
        seen += watch.observe(step, loss=2.0, grad_norm=math.inf, nonfinite_loss=False, skipped=True,
                              scale=2.0 ** (20 - step * 2), lr=1e-3)
    assert [(e.event, e.step) for e in seen] == [("skipped_steps", 3), ("skipped_steps", 6), ("loss_scale_low", 11),
                                                ("skipped_steps", 12)]  # at K, 2K, 4K
    assert "--init_scale 16384" in seen[0].diagnosis  # nothing applied yet: start where it backed off to
    assert "switch to bf16" in seen[0].diagnosis.lower() and "without fp16 support" in seen[0].diagnosis
    assert "bf16" in seen[2].diagnosis and seen[2].value == 0.25


def test_nonfinite_values_and_halt():
    skip = Watch(precision="bf16", on_nan="skip")
    (event,) = feed(skip, 2, grad_norm=math.inf)  # reported when it begins
    assert event.event == "nonfinite_grad" and "applied" in event.diagnosis and skip.halt is None
    (event,) = feed(Watch(precision="bf16"), 2, grad_norm=math.inf, skipped=True)
    assert "skipped (--on_nan skip)" in event.diagnosis
    halt = Watch(precision="fp16", on_nan="halt")
    assert feed(halt, 1, grad_norm=math.inf) == [] and halt.halt is None  # fp16 overflow: the GradScaler's job
    (event,) = feed(halt, 1, start=2, loss=math.nan, grad_norm=math.nan, nonfinite_loss=True)
    assert event.event == "nan_loss" and halt.halt is event
    assert "65504" in event.diagnosis and "recipes/precision_report.py" in event.diagnosis


def test_the_watch_resumes_from_a_checkpoint():
    """A skip streak and a flat-loss window that span a checkpoint are judged as if nothing stopped."""
    made = [Watch(precision="fp16", max_skipped_steps=3, flat_loss_window=10) for _ in range(2)]
    feed(made[0], 4, skipped=True, scale=1024.0, loss=2.3)
    made[1].load_state_dict(json.loads(json.dumps(made[0].state_dict())))  # through trainer_state.json
    later = [[e.record() for e in feed(w, 12, start=5, skipped=True, scale=512.0, loss=2.3)] for w in made]
    assert later[0] == later[1] and [r["event"] for r in later[0]] == ["skipped_steps", "loss_flat", "skipped_steps"]


@pytest.mark.parametrize("argv, words", [
    (["--on_nan", "explode"], ["--on_nan 'explode'", "skip, halt"]),
    (["--max_skipped_steps", "-1"], ["--max_skipped_steps -1", "0 or more"]),
    (["--flat_loss_window", "1"], ["--flat_loss_window 1", "2 or more"]),
    (["--grad_spike_factor", "-2"], ["--grad_spike_factor -2.0"]),
])
def test_bad_health_settings(argv, words, tmp_path):
    with pytest.raises(UsageError) as err:
        config.parse_config(argv)
    for word in words:
        assert word in str(err.value)
    (tmp_path / "c.yaml").write_text("on_nan: ignore\n")  # a YAML value is checked like a flag
    with pytest.raises(UsageError, match="--on_nan 'ignore'"):
        config.parse_config(["--config", str(tmp_path / "c.yaml")])


# --- one optimizer step, in this process ---------------------------------------------------------------------------

def _fp16_loop(tmp_path, fused, monkeypatch, inf_at=3, n=6):
    injected = faults.apply(f"inf_grad_at_step={inf_at}", monkeypatch)
    cfg = config.parse_config(["--mixed_precision", "fp16", "--warmup_steps", "10", "--output_dir", str(tmp_path)])
    accelerator, prec = precision.build_accelerator(cfg)
    torch.manual_seed(0)
    model = models.build("mlp", {"num_features": 100, "num_classes": 10})
    optimizer = optim.adamw(model, 1e-3, 0.01, fused=fused)
    scheduler = optim.scheduler(optimizer, 10, 100, "constant", 0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    monitor = health.Monitor(cfg, accelerator, model, optimizer, "fp16", [], say=lambda text: None)
    seen = []
    for step in range(n):
        injected.done = step
        with accelerator.autocast():
            loss = model(torch.randn(8, 100)).float().pow(2).mean()
        accelerator.backward(loss)
        monitor.add_loss(loss)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), math.inf)
        before = [p.detach().clone() for p in model.parameters()]
        lr = optimizer.param_groups[0]["lr"]
        if monitor.allows_step(grad_norm):
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        monitor.step_done()
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        seen.append((monitor.skipped_steps, changed, lr))
    adam = {s["step"].item() for s in optimizer.optimizer.state.values()}
    return seen, adam


def test_the_logged_loss_and_the_watched_values_are_the_devices_sums_rounded_as_before(tmp_path,
                                                                                      fresh_accelerate_state):
    """With accumulation (3 micro-batches a step): the window's loss is the float64 sum of the float32 losses in
    their order, rounded to float32 at the log, also across a checkpoint in the middle of the window and in the
    run resumed from it; the watch sees each step's float64 mean rounded to float32 and the gradient norm.
    (Summed on the host from the one read per step, as the device summed them before.)"""
    cfg = config.parse_config(["--mixed_precision", "no", "--output_dir", str(tmp_path)])
    accelerator, _ = precision.build_accelerator(cfg)
    model = models.build("mlp", {"num_features": 4, "num_classes": 3})
    seen = []

    def monitor():
        made = health.Monitor(cfg, accelerator, model, optim.adamw(model, 1e-3, 0.01, fused=False), "no", [],
                              say=lambda text: None)
        made.watch.observe = lambda step, **values: seen.append((values["loss"], values["grad_norm"])) or []
        return made

    generator = torch.Generator().manual_seed(0)
    losses, norms = torch.rand(6, 3, generator=generator) * 3, torch.rand(6, generator=generator)
    device_window, means = torch.zeros((), dtype=torch.float64), []
    run, resumed = monitor(), None
    for step in range(6):
        step_sum = torch.zeros((), dtype=torch.float64)
        for micro_batch in range(3):
            step_sum += losses[step, micro_batch]
        device_window += step_sum
        means.append((step_sum / 3).float().item())
        for m in filter(None, (run, resumed)):
            for micro_batch in range(3):
                m.add_loss(losses[step, micro_batch])
            assert m.allows_step(norms[step])
            m.step_done()
        if step == 2:  # a checkpoint in the middle of the window; a run resumed from it
            resumed = monitor()
            resumed.load_state_dict(run.state_dict(), step=3)
    # a second checkpoint keeps the window's float64 sum: the device's additions, in the device's order
    assert run.state_dict()["window_loss_sum"] == resumed.state_dict()["window_loss_sum"] == device_window.item()
    expected = device_window.float().item() / 18
    assert run.window()["loss"] == resumed.window()["loss"] == expected
    assert seen[:3] == list(zip(means, norms.tolist()))[:3]
    # each step is watched when it is done: by the run, then by the resumed run
    assert seen[3:] == [values for values in list(zip(means, norms.tolist()))[3:] for _ in range(2)]


def test_the_host_rounds_to_float32_as_the_device_does_at_the_edges():
    from mixprec.health.monitor import _float32

    edges = [1 / 3, -2 / 3, 3.4028235677973366e38, 3.4028235677973366e38 * 1.0000001, 1e39, -1e39, 5e-46, 1e-45,
             -0.0, math.inf, -math.inf, math.nan]
    assert [repr(_float32(v)) for v in edges] == \
        [repr(torch.tensor(v, dtype=torch.float64).float().item()) for v in edges]


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_an_inf_gradient_skips_the_step_and_the_schedule_goes_on(tmp_path, fused, monkeypatch,
                                                                  fresh_accelerate_state):
    seen, adam = _fp16_loop(tmp_path, fused, monkeypatch)
    assert [s for s, _, _ in seen] == [0, 0, 1, 1, 1, 1]  # step 3 counted as skipped
    assert [c for _, c, _ in seen] == [True, True, False, True, True, True]  # the weights did not move at step 3
    assert [lr for _, _, lr in seen] == pytest.approx([1e-4, 2e-4, 3e-4, 4e-4, 5e-4, 6e-4])  # every step counts
    assert adam == {5.0}  # AdamW took 5 steps of 6, fused or not



def test_attribution_looks_at_gradients_on_bad_steps_only(tmp_path, monkeypatch, fresh_accelerate_state):
    """Naming the modules with inf/NaN gradients reads every parameter's gradient: it runs on the bad step only,
    never on the 5 healthy ones."""
    calls, original = [], health.Monitor._nonfinite_modules

    def counted(self):
        calls.append(self.step + 1)
        return original(self)
    monkeypatch.setattr(health.Monitor, "_nonfinite_modules", counted)
    seen, _ = _fp16_loop(tmp_path, False, monkeypatch)
    assert calls == [3] and [s for s, _, _ in seen] == [0, 0, 1, 1, 1, 1]

# --- end to end ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("health")
    return {"whole": run_recipe(*ARGS, out=root / "whole"),
            "inf": run_recipe(*ARGS, out=root / "inf", faults="inf_grad_at_step=10")}


@pytest.mark.slow
def test_fp16_inf_gradient_is_skipped_end_to_end(fp16_runs):
    whole, inf = steps(fp16_runs["whole"]), steps(fp16_runs["inf"])
    assert inf[10]["grad_norm"] == "inf" and inf[10]["loss_scale"] == 32768.0 and whole[10]["loss_scale"] == 65536.0
    assert [inf[s]["skipped_steps"] for s in (9, 10, 30)] == [0, 1, 1] and whole[30]["skipped_steps"] == 0
    assert [inf[s]["lr"] for s in range(1, 31)] == [whole[s]["lr"] for s in range(1, 31)]  # the schedule goes on
    assert adam_steps(fp16_runs["inf"].out / "checkpoints" / "step_0000030") == {29.0}
    assert adam_steps(fp16_runs["whole"].out / "checkpoints" / "step_0000030") == {30.0}
    assert fp16_runs["inf"].summary()["skipped_steps"] == 1 and events(fp16_runs["inf"]) == []  # one overflow: normal


@pytest.mark.slow
def test_fp16_skipped_steps_are_counted_without_health_checks_and_across_a_resume(fp16_runs, tmp_path):
    """--no-health_checks drops the per-step read, not the count: the GradScaler's skipped steps are counted on
    the device, logged at each logging step, kept by a checkpoint and in summary.json, as with the checks."""
    args = [*ARGS, "--no-health_checks"]
    run = run_recipe(*args, out=tmp_path / "a", launcher="python", faults="inf_grad_at_step=10")
    assert steps(run)[10]["loss_scale"] == 32768.0  # the step overflowed
    counted = {s: r["skipped_steps"] for s, r in steps(run).items()}
    assert counted == {s: r["skipped_steps"] for s, r in steps(fp16_runs["inf"]).items()}
    assert run.summary()["skipped_steps"] == 1 and events(run) == [] and "[health]" not in run.stdout
    resumed = run_recipe(*args, "--resume_from_checkpoint", tmp_path / "a" / "checkpoints" / "step_0000010",
                         out=tmp_path / "b", launcher="python")
    assert [r["skipped_steps"] for r in resumed.train_records()] == [1] * 20
    assert resumed.summary()["skipped_steps"] == 1


@pytest.mark.slow
def test_nan_loss_halts_and_the_last_checkpoint_resumes(fp16_runs, tmp_path):
    out = tmp_path / "halted"
    halted = run_recipe(*ARGS, "--on_nan", "halt", out=out, launcher="python",
                        faults="nan_loss_at_step=12", check=False)
    assert halted.returncode == health.HALT_EXIT_CODE, halted.stderr[-2000:]
    (line,) = [x for x in halted.stderr.splitlines() if x.startswith("error: ")]
    assert "halted at step 12 (nan_loss)" in line and "lower the learning rate" in line
    assert "switch to bf16" in line and "--resume_from_checkpoint latest" in line
    (event,) = events(halted)
    assert event["step"] == 12 and event["event"] == "nan_loss" and event["value"] == "nan"
    assert max(r["step"] for r in halted.train_records()) == 11
    assert (out / "checkpoints" / "latest").read_text() == "step_0000010"
    assert not (out / "checkpoints" / "step_0000015").exists() and not (out / "model.safetensors").exists()
    assert halted.summary()["status"] == "halted" and halted.summary()["halted_at_step"] == 12
    resumed = run_recipe(*ARGS, "--on_nan", "halt", "--resume_from_checkpoint", "latest", out=out, launcher="python")
    assert "resumed from" in resumed.stdout and "at step 10" in resumed.stdout
    assert resumed.comparable() == fp16_runs["whole"].comparable()  # as if it had never stopped
    assert resumed.summary()["val_loss"] == fp16_runs["whole"].summary()["val_loss"]


@pytest.mark.slow
def test_bf16_inf_gradient_is_skipped_and_diagnosed(tmp_path):
    run = run_recipe("--mixed_precision", "bf16", "--max_steps", "14", "--warmup_steps", "40", "--log_every", "1",
                     out=tmp_path / "r", launcher="python", faults="inf_grad_at_step=10")
    by_step = steps(run)
    assert by_step[10]["grad_norm"] == "inf" and by_step[10]["skipped_steps"] == 1
    assert by_step[10]["lr"] < by_step[11]["lr"] < by_step[12]["lr"]  # the schedule goes on
    assert all(math.isfinite(r["loss"]) for r in run.train_records()) and math.isfinite(run.summary()["val_loss"])
    (event,) = events(run)
    assert event["event"] == "nonfinite_grad" and event["step"] == 10 and event["modules"] == "net.0"
    assert "[health] step 10: nonfinite_grad" in run.stdout and "--max_grad_norm" in run.stdout
    assert adam_steps(tmp_path / "r" / "checkpoints" / "step_0000014") == {13.0}


@pytest.mark.slow
def test_an_init_scale_far_too_high_and_a_loss_that_does_not_move(tmp_path):
    args = ["--mixed_precision", "fp16", "--init_scale", 2.0 ** 40, "--max_steps", "40", "--lr", "1e-9",
            "--max_skipped_steps", "5", "--min_loss_scale", "1e9", "--flat_loss_window", "20",
            "--flat_loss_tolerance", "0.05", "--log_every", "10", "--checkpointing_steps", "8"]
    run = run_recipe(*args, out=tmp_path / "r", launcher="python")
    seen = events(run)
    kinds = [e["event"] for e in seen]
    assert kinds.count("skipped_steps") >= 2 and "loss_scale_low" in kinds and "loss_flat" in kinds
    first = seen[kinds.index("skipped_steps")]
    # not the scale it backed off to (2**40 halved 5 times still overflows) but one the unscaled gradients fit
    assert first["step"] == 5 and first["cause"] == "init_scale_too_high" and first["fix"] == "--init_scale 65536"
    assert run.summary()["skipped_steps"] >= 10
    flat = seen[kinds.index("loss_flat")]
    assert flat["cause"] == "lr_too_low" and flat["step"] >= 20  # --lr 1e-9 cannot move the weights
    # killed at step 12 and resumed from step 8: the streak and the window that span the checkpoint carry on
    killed = run_recipe(*args, out=tmp_path / "k", launcher="python", faults="kill_at_step=12",
                        check=False)
    assert killed.returncode != 0
    resumed = run_recipe(*args, "--resume_from_checkpoint", "latest", out=tmp_path / "k", launcher="python")
    assert "at step 8" in resumed.stdout and events(resumed) == seen


def test_finding_the_forward_order_leaves_the_model_as_it_was():
    """The order of modules (for naming where an overflow starts) comes from one forward pass before training:
    it must not move batch-norm statistics or the model's mode."""
    info = {"task": "image_classification", "image_shape": [1, 16, 16], "num_classes": 10, "mean": [0.3], "std": [0.3]}
    model = models.build("cnn", info, {"widths": [8, 16], "blocks": [1, 1]}).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    order = health.forward_order(model, {"inputs": torch.randint(0, 256, (2, 1, 16, 16), dtype=torch.uint8)})
    assert order and model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_label_probe_tells_real_labels_from_shuffled_ones_and_leaves_the_model_as_it_was():
    """mixprec.health.coherence: the label-dependent gradient is larger with the rows' labels than shuffled; the
    model's weights, .grad, modes and the random state are left as they were."""
    from mixprec.health import coherence

    gen = torch.Generator().manual_seed(3)
    centres = torch.randn(4, 20, generator=gen) * 2
    labels = torch.randint(0, 4, (1024,), generator=gen)
    x = centres[labels] + torch.randn(1024, 20, generator=gen)
    shuffled = labels[torch.randperm(1024, generator=gen)]
    torch.manual_seed(0)
    model = models.build("mlp", {"num_features": 20, "num_classes": 4}, {"hidden": [64, 32]}).train()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.get_rng_state()

    def batches(y):
        return ({"inputs": x[i:i + 32], "labels": y[i:i + 32]} for i in range(0, 1024, 32))

    real, rows = coherence.label_ratio(model, batches(labels), 1024, 1.5)
    assert real >= 1.5 and rows == 256  # clear at the first look
    unrelated, rows = coherence.label_ratio(model, batches(shuffled), 1024, 1.5)
    assert unrelated < 1.2 and rows == 1024
    assert torch.equal(torch.get_rng_state(), state) and model.training
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())
    tokens = {"inputs": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8, dtype=torch.long)}
    assert not coherence.classification(tokens)  # a language model's labels: not probed
