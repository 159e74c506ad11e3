"""Canaries: the upstream behaviours that mixprec/compat works around, shown on the versions of the dependency
ranges (accelerate 1.15.0 and 1.16.0). Each runs in a fresh interpreter (the workarounds change module state in
this one). When an upgrade changes a behaviour, its canary fails: drop or change the workaround, then the canary.
Where the two accelerate versions differ, the canary branches on the installed one: 1.16's one-process launcher
passes SIGTERM on and SIGKILLs the trainer 5 s later, which compat.outlive_launcher keeps from cutting a slow
preemption checkpoint short (tests/test_preemption.py, the slower-than-the-launcher's-patience test)."""
import os
import signal
import subprocess
import sys
import textwrap
import time


from helpers import REPO, base_env


def fresh(code: str) -> str:
    """Run `code` in a new interpreter (no mixprec workaround applied); what it printed with `answer(...)`
    (libraries print lines of their own)."""
    prelude = "def answer(*values):\n    print('ANSWER', *values)\n"
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          env=base_env(), cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return " ".join(line.removeprefix("ANSWER ") for line in proc.stdout.splitlines() if line.startswith("ANSWER "))


def test_the_installed_versions_are_inside_the_tested_ranges():
    """pyproject.toml's ranges are what these canaries (and the suite) run on: CI runs the newest set and the
    oldest (ci/oldest.txt)."""
    import re
    import tomllib
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    outside = []
    for requirement in declared:
        name, spec = re.match(r"([A-Za-z0-9_.-]+)(.*)", requirement.replace(" ", "")).groups()
        installed = version(name).split("+")[0]
        if spec and installed not in SpecifierSet(spec):
            outside.append(f"{name} {installed} not in {spec}")
    assert not outside
    oldest = dict(line.split("==") for line in (REPO / "ci" / "oldest.txt").read_text().split()
                  if "==" in line and not line.startswith("#"))
    lower = {name: re.search(r">=([\d.]+)", spec).group(1) for name, spec in
             (re.match(r"([A-Za-z0-9_.-]+)(.*)", r.replace(" ", "")).groups() for r in declared) if ">=" in spec}
    assert set(lower) <= set(oldest), "every lower end is installed by the oldest lane"
    assert {n: Version(oldest[n]) for n in lower} == {n: Version(v) for n, v in lower.items()}


def test_accelerate_trains_fp16_on_a_cpu_in_fp32_without_a_word():
    out = fresh("""
        from accelerate import Accelerator
        a = Accelerator(mixed_precision="fp16", cpu=True)
        answer(a.scaler is None, a.native_amp)
    """)
    assert out.split() == ["True", "False"]


def test_prepare_puts_an_autocast_forward_on_the_instance_that_an_outer_autocast_cannot_switch_off():
    out = fresh("""
        import torch
        from accelerate import Accelerator
        a = Accelerator(mixed_precision="bf16", cpu=True)
        inner = torch.nn.Linear(4, 4)
        model = a.prepare(torch.nn.Sequential(inner))
        seen = []
        inner.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        with torch.autocast("cpu", enabled=False):
            model(torch.randn(2, 4))
        answer("forward" in model.__dict__, seen[0])
    """)
    assert out.split() == ["True", "torch.bfloat16"]


def test_accelerate_engages_deepspeed_only_off_the_cpu_and_needs_transformers_and_gloo_named():
    out = fresh("""
        import importlib.metadata, inspect
        import accelerate.state as state
        from accelerate.utils import DeepSpeedPlugin
        source = inspect.getsource(state)
        answer('parse_flag_from_env("ACCELERATE_USE_CPU")' in source,
              'os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and not cpu' in source)
        real = importlib.metadata.version
        def version(name):
            if name == "transformers":
                raise importlib.metadata.PackageNotFoundError(name)
            return real(name)
        importlib.metadata.version = version
        try:
            DeepSpeedPlugin(zero_stage=2).set_deepspeed_weakref()  # what Accelerator does with the plugin
            answer("no-need")
        except importlib.metadata.PackageNotFoundError:
            answer("needs-transformers")
    """)
    assert out.split() == ["True", "True", "needs-transformers"]


def test_load_state_restores_the_micro_batch_counter(tmp_path):
    out = fresh(f"""
        import torch
        from accelerate import Accelerator
        a = Accelerator(cpu=True, gradient_accumulation_steps=3)
        model = a.prepare(torch.nn.Linear(2, 2))
        a.step = 5
        a.save_state({str(tmp_path / 'ckpt')!r})
        a.step = 0
        a.load_state({str(tmp_path / 'ckpt')!r})
        answer(a.step)
    """)
    assert out.split() == ["5"]


def one_process_launch(tmp_path, sig: int) -> dict:
    """Start `accelerate launch` with one process whose child notes SIGTERM and ignores it, send `sig` to the
    launcher and report what became of the child: its SIGTERM, whether it outlived the launcher, and how long
    the launcher took to exit."""
    import psutil

    script, alive, got = (tmp_path / f"{name}-{sig.name}" for name in ("child.py", "alive", "got"))
    script.write_text(textwrap.dedent(f"""
        import pathlib, signal, time
        signal.signal(signal.SIGTERM, lambda *a: pathlib.Path({str(got)!r}).write_text("SIGTERM"))
        for _ in range(600):
            pathlib.Path({str(alive)!r}).touch()
            time.sleep(0.1)
    """))
    launcher = subprocess.Popen(["accelerate", "launch", "--num_processes", "1", "--cpu", str(script)],
                                env=base_env(), cwd=tmp_path, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not alive.exists() and time.monotonic() < deadline:  # the child has started
        time.sleep(0.1)
    (child,) = psutil.Process(launcher.pid).children()
    started = time.monotonic()
    os.kill(launcher.pid, sig)
    code = launcher.wait(60)
    took = time.monotonic() - started
    alive.unlink(missing_ok=True)
    time.sleep(1)
    orphaned = alive.exists()  # the child is still writing
    if child.is_running():
        child.kill()
    return {"orphaned": orphaned, "got": got.read_text() if got.exists() else None, "took": took, "code": code}


def test_the_one_process_launcher_orphans_its_trainer_or_kills_it_after_a_grace(tmp_path):
    """SIGUSR1 and SIGHUP kill `accelerate launch` and orphan its one child; the recipe's PR_SET_PDEATHSIG
    request (compat.stop_with_launcher) is what stops a trainer then. SIGTERM and SIGINT do the same on 1.15;
    1.16 passes SIGTERM on and SIGKILLs the child 5 s later, however far its checkpoint is
    (compat.outlive_launcher ends that launcher first)."""
    from mixprec.compat.launcher import KILLS_AFTER_GRACE, accelerate_version

    grace = accelerate_version() >= KILLS_AFTER_GRACE
    for sig in (signal.SIGUSR1, signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        seen = one_process_launch(tmp_path, sig)
        if grace and sig in (signal.SIGTERM, signal.SIGINT):
            assert not seen["orphaned"] and seen["got"] == "SIGTERM", (sig, seen)  # SIGKILLed after SIGTERM
            assert seen["took"] >= 4.5 and seen["code"] == 128 + sig, (sig, seen)  # after the 5 s grace
        else:
            assert seen["orphaned"] and seen["got"] is None, (sig, seen)


def test_a_process_of_several_ends_with_mains_exit_code_its_output_and_exit_functions():
    """compat.teardown: no canary can show the rare teardown abort on demand; this shows what the workaround
    keeps when it skips the teardown (WORLD_SIZE > 1): main's exit code, its output, the atexit functions."""
    main = textwrap.dedent("""
        import atexit, sys
        from mixprec.compat.teardown import end_process
        def main():
            atexit.register(lambda: print("exit function ran"))
            print("trained", end="")  # no newline: flushed by end_process
            {ending}
        end_process(main)
    """)
    endings = {"return": 0, "sys.exit(75)": 75, "sys.exit('error: stopped')": 1, "raise RuntimeError('boom')": 1}
    for world_size in ("1", "2"):
        for ending, code in endings.items():
            proc = subprocess.run([sys.executable, "-c", main.format(ending=ending)], capture_output=True, text=True,
                                  env=base_env({"WORLD_SIZE": world_size}), cwd=REPO, timeout=60)
            assert proc.returncode == code, (world_size, ending, proc.stderr)
            assert proc.stdout.startswith("trained") and "exit function ran" in proc.stdout, (world_size, proc.stdout)
            if "boom" in ending:
                assert "Traceback" in proc.stderr and "RuntimeError: boom" in proc.stderr
            if "stopped" in ending:
                assert proc.stderr.strip() == "error: stopped"


def test_deepspeeds_zero_optimizers_keep_their_master_weights_in_the_fields_compat_reads():
    """compat.zero_master_dtype reads these internal fields (DeepSpeed has no public way to ask)."""
    out = fresh("""
        import inspect
        from deepspeed.runtime.fp16 import fused_optimizer
        from deepspeed.runtime.zero import stage3, stage_1_and_2
        from mixprec.compat.deepspeed_patches import ZERO_MASTER_FIELDS
        sources = [inspect.getsource(m) for m in (stage_1_and_2, stage3, fused_optimizer)]
        answer(*[f"self.{name} =" in source for name, source in zip(ZERO_MASTER_FIELDS, sources)])
    """)
    assert out.split() == ["True", "True", "True"]


def test_a_schedulers_peak_rates_are_base_lrs_in_its_state_dict():
    """compat.set_peak_lrs changes `base_lrs` through state_dict/load_state_dict; the next step uses it."""
    out = fresh("""
        import torch
        from mixprec import compat
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.1 * (step + 1))
        answer("base_lrs" in sched.state_dict(), compat.peak_lrs(sched))
        compat.set_peak_lrs(sched, [2.0])
        opt.step(); sched.step()
        answer(compat.peak_lrs(sched), opt.param_groups[0]["lr"])
    """)
    assert out.split() == ["True", "[0.5]", "[2.0]", "0.4"]


def test_transformers_builds_models_inside_zero_init_under_zero3_even_with_zero3_init_flag_false():
    """Accelerate registers its ZeRO-3 config with transformers whatever zero3_init_flag says, and transformers
    then builds every model in deepspeed.zero.Init (empty, partitioned parameters): compat.whole_weights_under_zero3
    hides the registration while a transformers model loads."""
    out = fresh("""
        from accelerate.utils import DeepSpeedPlugin
        from transformers import BertConfig, BertModel
        from transformers.integrations import is_deepspeed_zero3_enabled
        from mixprec import compat
        plugin = DeepSpeedPlugin(zero_stage=3, zero3_init_flag=False)
        plugin.set_deepspeed_weakref()  # what Accelerator(...) does when it selects the plugin
        config = BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                            intermediate_size=8)
        with compat.whole_weights_under_zero3():
            whole = BertModel._from_config(config).embeddings.word_embeddings.weight.numel()
        answer(plugin.is_zero3_init_enabled(), is_deepspeed_zero3_enabled(), whole)
    """)
    assert out.split() == ["False", "True", "256"]
