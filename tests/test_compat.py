"""Canaries: the upstream behaviours that mixprec/compat works around, shown on the versions of the dependency
ranges (accelerate 1.15.0 and 1.16.0). They run in a new interpreter, not this one (the workarounds change module
state in this one): the canaries that only look run in one interpreter together (SHARED, each after Accelerate's
state is reset, those that import mixprec last, a failure reported with its own traceback); the launcher and
teardown canaries, which end processes, run in their own. When an upgrade changes a behaviour, its canary fails:
drop or change the workaround, then the canary.
Where the two accelerate versions differ, the canary branches on the installed one: 1.16's one-process launcher
passes SIGTERM on and SIGKILLs the trainer 5 s later, which compat.outlive_launcher keeps from cutting a slow
preemption checkpoint short (tests/test_preemption.py, the slower-than-the-launcher's-patience test)."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import REPO, base_env


# name: code run in the shared interpreter; `answer(...)` records its result, TMP is a folder of its own
SHARED = {
    "fp16_on_cpu": """
        from accelerate import Accelerator
        a = Accelerator(mixed_precision="fp16", cpu=True)
        answer(a.scaler is None, a.native_amp)
    """,
    "autocast_forward": """
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
    """,
    "micro_batch_counter": """
        import torch
        from accelerate import Accelerator
        a = Accelerator(cpu=True, gradient_accumulation_steps=3)
        model = a.prepare(torch.nn.Linear(2, 2))
        a.step = 5
        a.save_state(TMP + "/ckpt")
        a.step = 0
        a.load_state(TMP + "/ckpt")
        answer(a.step)
    """,
    "deepspeed_engages": """
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
        finally:
            importlib.metadata.version = real
    """,
    # these import mixprec: last
    "zero_master_fields": """
        import inspect
        from deepspeed.runtime.fp16 import fused_optimizer
        from deepspeed.runtime.zero import stage3, stage_1_and_2
        from mixprec.compat.deepspeed_patches import ZERO_MASTER_FIELDS
        sources = [inspect.getsource(m) for m in (stage_1_and_2, stage3, fused_optimizer)]
        answer(*[f"self.{name} =" in source for name, source in zip(ZERO_MASTER_FIELDS, sources)])
    """,
    "full_disk": """
        import os, subprocess, torch
        disk = TMP + "/disk"
        os.makedirs(disk)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", disk], capture_output=True).returncode:
            answer("no-tmpfs")
        else:
            try:
                with open(disk + "/fill", "wb") as f:
                    f.write(b"0" * (1024 * 1024 - 8192))
                torch.save({"w": torch.zeros(300_000)}, disk + "/x.pt")
                answer("saved")
            except OSError as err:
                answer("OSError", err.errno)
            except RuntimeError as err:
                from mixprec.compat import storage_failure
                answer("RuntimeError", storage_failure(err) is not None, str(err).splitlines()[0][:80])
            finally:
                subprocess.run(["umount", "-l", disk], check=False)
    """,
    "zero3_registration": """
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
        from transformers.integrations import deepspeed as hf_deepspeed
        hf_deepspeed.unset_hf_deepspeed_config()  # the canaries after this one see no ZeRO-3
    """,
    "safetensors_mode": """
        import os, torch
        from safetensors.torch import save_file
        from mixprec import compat
        before = os.umask(0o022)
        try:
            path = os.path.join(TMP, "x.safetensors")
            save_file({"a": torch.zeros(2)}, path)
            written = oct(os.stat(path).st_mode & 0o777)
            compat.umask_modes(TMP)
            answer(written, oct(os.stat(path).st_mode & 0o777))
        finally:
            os.umask(before)
    """,
    "peak_lrs": """
        import torch
        from mixprec import compat
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.1 * (step + 1))
        answer("base_lrs" in sched.state_dict(), compat.peak_lrs(sched))
        compat.set_peak_lrs(sched, [2.0])
        opt.step(); sched.step()
        answer(compat.peak_lrs(sched), opt.param_groups[0]["lr"])
    """,
}

RUNNER = """
import json, os, sys, textwrap, traceback
from accelerate.state import AcceleratorState, GradientState
checks, root, results = json.loads(sys.argv[1]), sys.argv[2], {}
for name, code in checks.items():
    AcceleratorState._reset_state(reset_partial_state=True)  # as a new process would have it
    GradientState._reset_state()
    answers, folder = [], os.path.join(root, name)
    os.makedirs(folder)
    try:
        exec(textwrap.dedent(code), {"answer": lambda *values: answers.extend(map(str, values)), "TMP": folder})
        results[name] = {"answer": " ".join(answers)}
    except BaseException:
        results[name] = {"error": traceback.format_exc()}
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict:
    """Every canary of SHARED, in turn, in one new interpreter (no mixprec workaround applied)."""
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(SHARED), str(tmp_path_factory.mktemp("shared"))],
                          capture_output=True, text=True, env=base_env(), cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    return json.loads(line.removeprefix("RESULTS "))


def answer_of(shared: dict, name: str) -> str:
    result = shared[name]
    assert "error" not in result, result.get("error")
    return result["answer"]


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


def test_accelerate_trains_fp16_on_a_cpu_in_fp32_without_a_word(shared):
    out = answer_of(shared, "fp16_on_cpu")
    assert out.split() == ["True", "False"]


def test_prepare_puts_an_autocast_forward_on_the_instance_that_an_outer_autocast_cannot_switch_off(shared):
    out = answer_of(shared, "autocast_forward")
    assert out.split() == ["True", "torch.bfloat16"]


def test_accelerate_engages_deepspeed_only_off_the_cpu_and_needs_transformers_and_gloo_named(shared):
    out = answer_of(shared, "deepspeed_engages")
    assert out.split() == ["True", "True", "needs-transformers"]


def test_load_state_restores_the_micro_batch_counter(shared):
    out = answer_of(shared, "micro_batch_counter")
    assert out.split() == ["5"]


def one_process_launches(tmp_path, signals: list[int]) -> dict:
    """Start one `accelerate launch` with one process per signal, side by side, each child noting SIGTERM and
    ignoring it; send each launcher its signal and report, per signal, what became of the child: its SIGTERM,
    whether it outlived the launcher, how long the launcher took to exit and its exit code."""
    import psutil

    launches = {}
    for sig in signals:
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
        launches[sig] = (launcher, alive, got)
    deadline = time.monotonic() + 120
    while not all(alive.exists() for _, alive, _ in launches.values()) and time.monotonic() < deadline:
        time.sleep(0.1)  # every child has started
    children, started = {}, {}
    for sig, (launcher, _, _) in launches.items():
        (children[sig],) = psutil.Process(launcher.pid).children()
        started[sig] = time.monotonic()
        os.kill(launcher.pid, sig)
    seen = {}
    for sig, (launcher, alive, got) in launches.items():
        code = launcher.wait(60)
        seen[sig] = {"took": time.monotonic() - started[sig], "code": code}
    for sig, (launcher, alive, got) in launches.items():
        alive.unlink(missing_ok=True)
    time.sleep(1)
    for sig, (launcher, alive, got) in launches.items():
        seen[sig].update(orphaned=alive.exists(), got=got.read_text() if got.exists() else None)  # still writing
        if children[sig].is_running():
            children[sig].kill()
    return seen


@pytest.mark.slow  # four launches and a 5 s grace
def test_the_one_process_launcher_orphans_its_trainer_or_kills_it_after_a_grace(tmp_path):
    """SIGUSR1 and SIGHUP kill `accelerate launch` and orphan its one child; the recipe's PR_SET_PDEATHSIG
    request (compat.stop_with_launcher) is what stops a trainer then. SIGTERM and SIGINT do the same on 1.15;
    1.16 passes SIGTERM on and SIGKILLs the child 5 s later, however far its checkpoint is
    (compat.outlive_launcher ends that launcher first). The four launchers run side by side."""
    from mixprec.compat.launcher import KILLS_AFTER_GRACE, accelerate_version

    grace = accelerate_version() >= KILLS_AFTER_GRACE
    signals = [signal.SIGUSR1, signal.SIGHUP, signal.SIGTERM, signal.SIGINT]
    for sig, seen in one_process_launches(tmp_path, signals).items():
        if grace and sig in (signal.SIGTERM, signal.SIGINT):
            assert not seen["orphaned"] and seen["got"] == "SIGTERM", (sig, seen)  # SIGKILLed after SIGTERM
            assert seen["took"] >= 4.5 and seen["code"] == 128 + sig, (sig, seen)  # after the 5 s grace
        else:
            assert seen["orphaned"] and seen["got"] is None, (sig, seen)


def test_a_process_of_several_ends_with_mains_exit_code_its_output_and_exit_functions():
    """compat.teardown: no canary can show the rare teardown abort on demand; this shows what the workaround
    keeps when it skips the teardown (WORLD_SIZE > 1; mixprec.process_end, which one-process runs also take, for
    time): main's exit code, its output, the atexit functions."""
    main = textwrap.dedent("""
        import atexit, os, sys
        from mixprec.process_end import end_process
        class Teardown:
            def __del__(self):
                os.write(1, b"teardown ran")
        kept = Teardown()  # a module global: deleted in the interpreter's teardown only
        if "trace" in sys.argv:
            sys.settrace(lambda *a: None)
        def main():
            atexit.register(lambda: print("exit function ran"))
            print("trained", end="")  # no newline: flushed by end_process
            {ending}
        end_process(main)
        print("then the script went on")  # only where end_process returned (a tracer in one process)
    """)
    endings = {"return": 0, "sys.exit(75)": 75, "sys.exit('error: stopped')": 1, "raise RuntimeError('boom')": 1,
               "raise KeyboardInterrupt": -signal.SIGINT}  # Ctrl-C before the recipe's own handler: as Python
    for world_size in ("1", "2"):
        for ending, code in endings.items():
            proc = subprocess.run([sys.executable, "-c", main.format(ending=ending)], capture_output=True, text=True,
                                  env=base_env({"WORLD_SIZE": world_size}), cwd=REPO, timeout=60)
            assert proc.returncode == code, (world_size, ending, proc.stderr)
            assert proc.stdout.startswith("trained") and "exit function ran" in proc.stdout, (world_size, proc.stdout)
            assert "teardown ran" not in proc.stdout, (world_size, ending)  # skipped: os._exit after the exit functions
            if "boom" in ending:
                assert "Traceback" in proc.stderr and "RuntimeError: boom" in proc.stderr
            if "Keyboard" in ending:  # what Python itself gives (killed by SIGINT), checked without end_process too
                assert "Traceback" in proc.stderr and "KeyboardInterrupt" in proc.stderr
                plain = subprocess.run([sys.executable, "-c", "raise KeyboardInterrupt"], capture_output=True,
                                       timeout=60)
                assert plain.returncode == code
            if "stopped" in ending:
                assert proc.stderr.strip() == "error: stopped"
    for world_size, torn_down in (("1", True), ("2", False)):  # under a tracer one process ends as usual (the
        # tracer writes in the teardown), a process of several does not
        proc = subprocess.run([sys.executable, "-c", main.format(ending="return"), "trace"], capture_output=True,
                              text=True, env=base_env({"WORLD_SIZE": world_size}), cwd=REPO, timeout=60)
        assert proc.returncode == 0 and ("then the script went on" in proc.stdout) == torn_down, (world_size, proc.stdout)


def test_deepspeeds_zero_optimizers_keep_their_master_weights_in_the_fields_compat_reads(shared):
    """compat.zero_master_dtype reads these internal fields (DeepSpeed has no public way to ask)."""
    out = answer_of(shared, "zero_master_fields")
    assert out.split() == ["True", "True", "True"]


def test_a_schedulers_peak_rates_are_base_lrs_in_its_state_dict(shared):
    """compat.set_peak_lrs changes `base_lrs` through state_dict/load_state_dict; the next step uses it."""
    out = answer_of(shared, "peak_lrs")
    assert out.split() == ["True", "[0.5]", "[2.0]", "0.4"]


def test_torch_save_on_a_full_disk_raises_a_runtime_error_that_storage_failure_recognises(shared):
    """torch.save does not raise OSError(ENOSPC) on a full disk: its zip writer's check fails with 'unexpected pos'
    (or 'file write failed'). compat.storage_failure must recognise what it raises, else a full disk during a
    checkpoint is a traceback instead of one line and exit 74. Needs root for its own 1 MB tmpfs."""
    out = answer_of(shared, "full_disk")
    if out == "no-tmpfs":
        pytest.skip("cannot mount a tmpfs here: needs root")
    assert out.startswith("RuntimeError True"), out


def test_transformers_builds_models_inside_zero_init_under_zero3_even_with_zero3_init_flag_false(shared):
    """Accelerate registers its ZeRO-3 config with transformers whatever zero3_init_flag says, and transformers
    then builds every model in deepspeed.zero.Init (empty, partitioned parameters): compat.whole_weights_under_zero3
    hides the registration while a transformers model loads."""
    out = answer_of(shared, "zero3_registration")
    assert out.split() == ["False", "True", "256"]


def test_safetensors_writes_its_files_readable_by_their_owner_only(shared):
    """safetensors 0.8's save_file creates the file 0600 whatever the umask (its temporary file, renamed into
    place): compat.umask_modes gives it the umask's mode, as every other file of a run has. When this canary
    fails (0o644 written), the workaround can go."""
    assert answer_of(shared, "safetensors_mode").split() == ["0o600", "0o644"]
