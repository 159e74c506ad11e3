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


def test_the_installed_versions_are_those_these_canaries_describe():
    from importlib.metadata import version

    assert version("accelerate") in ("1.15.0", "1.16.0") and version("deepspeed") == "0.19.8"


def test_accelerate_asks_importlib_for_lomo_on_every_step_and_imports_deepspeed_to_unwrap():
    out = fresh("""
        import sys, inspect, torch
        import accelerate.optimizer as opt
        from accelerate.utils import extract_model_from_parallel
        answer(hasattr(opt.is_lomo_available, "cache_info"), "is_lomo_available()" in inspect.getsource(opt.AcceleratedOptimizer.step))
        extract_model_from_parallel(torch.nn.Linear(2, 2))
        answer("deepspeed" in sys.modules)
    """)
    assert out.split() == ["False", "True", "True"]  # uncached, called in step; unwrap imported DeepSpeed


def test_accelerate_asks_inspect_for_the_signature_of_zero_grad_on_every_call():
    out = fresh("""
        import inspect, torch
        import accelerate.optimizer as opt
        from accelerate import Accelerator
        calls = []
        real = inspect.signature
        opt.inspect = type("Spy", (), {"signature": staticmethod(lambda f: calls.append(f) or real(f))})
        model = torch.nn.Linear(2, 2)
        acc_opt = Accelerator(cpu=True).prepare(torch.optim.AdamW(model.parameters()))
        for _ in range(3):
            acc_opt.zero_grad(set_to_none=True)
        answer(len(calls))
    """)
    assert out == "3"  # once per call: compat.skip_per_step_overheads asks once per optimizer


def test_zero_grad_without_the_per_call_signature_does_what_accelerates_does():
    out = fresh("""
        import inspect, torch
        from accelerate import Accelerator
        from mixprec import compat
        compat.skip_per_step_overheads(deepspeed=False)
        asked, real = [], inspect.signature
        inspect.signature = lambda f, *a, **k: (getattr(f, "__name__", "") == "zero_grad" and asked.append(f)) or real(f, *a, **k)

        class NoArg(torch.optim.SGD):  # an optimizer whose zero_grad takes no set_to_none
            def zero_grad(self):
                for group in self.param_groups:
                    for p in group["params"]:
                        p.grad = None

        acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
        model = torch.nn.Linear(2, 2)
        adamw, noarg = acc.prepare(torch.optim.AdamW(model.parameters()), NoArg(model.parameters(), lr=0.1))
        def grads():
            model(torch.ones(1, 2)).sum().backward()
        grads(); acc.gradient_state._set_sync_gradients(False); adamw.zero_grad()
        answer(model.weight.grad is not None)            # inside an accumulation window: nothing happens
        acc.gradient_state._set_sync_gradients(True); adamw.zero_grad(set_to_none=False)
        answer(model.weight.grad is not None and bool((model.weight.grad == 0).all()))  # zeroed, kept
        grads(); adamw.zero_grad()
        answer(model.weight.grad is None)                # set_to_none defaults to True
        grads(); noarg.zero_grad()
        answer(model.weight.grad is None)
        try:
            noarg.zero_grad(set_to_none=True)
        except ValueError as err:
            answer("not supported" in str(err))
        answer(len(asked))  # once for each optimizer, not on each of the 4 calls that clear gradients
    """)
    assert out.split() == ["True", "True", "True", "True", "True", "2"]


DIVISIONS = """
        import torch
        from torch.overrides import TorchFunctionMode

        class Divisions(TorchFunctionMode):
            count = 0

            def __torch_function__(self, func, types, args=(), kwargs=None):
                if getattr(func, "__name__", "") in ("__truediv__", "div", "div_", "__itruediv__"):
                    Divisions.count += 1
                return func(*args, **(kwargs or {}))
"""


def test_accelerate_divides_the_loss_by_a_window_of_one_micro_batch():
    out = fresh(DIVISIONS + """
        from accelerate import Accelerator
        acc = Accelerator(cpu=True)
        loss = torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum()
        with Divisions():
            acc.backward(loss)
        answer(acc.gradient_accumulation_steps, Divisions.count)
    """)
    assert out.split() == ["1", "1"]  # loss / 1: compat.skip_per_step_overheads leaves it out


def test_backward_without_the_division_by_one_gives_accelerates_gradients_bit_for_bit():
    out = fresh(DIVISIONS + """
        from accelerate import Accelerator
        from mixprec import compat
        compat.skip_per_step_overheads(deepspeed=False)

        def grads(steps, scale, through_accelerate):
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 3)
            loss = model(torch.randn(5, 4)).pow(2).mean() * 1.37
            if through_accelerate:
                acc = Accelerator(cpu=True, gradient_accumulation_steps=steps)
                acc.scaler = torch.amp.GradScaler("cpu", init_scale=scale) if scale else None
                with Divisions():
                    acc.backward(loss)
            else:  # what accelerate 1.15 does: loss / steps, scaled by the GradScaler
                ((loss / steps) * (scale or 1)).backward()
            return model.weight.grad.clone()

        for steps, scale in ((1, None), (1, 1024.0), (2, None), (2, 1024.0)):
            before = Divisions.count
            same = torch.equal(grads(steps, scale, True), grads(steps, scale, False))
            answer(steps, scale, same, Divisions.count - before)
    """)
    # no division without accumulation; Accelerate's own backward (one division) with it; the same bits always
    assert out.split() == ["1", "None", "True", "0", "1", "1024.0", "True", "0",
                           "2", "None", "True", "1", "2", "1024.0", "True", "1"]


def test_accelerate_counts_a_micro_batch_with_a_generator_and_parses_a_version_and_the_environment_per_step():
    out = fresh("""
        import inspect, torch
        import accelerate.accelerator as accelerator_module
        import accelerate.state as state
        from accelerate import Accelerator
        versions, flags = [], []
        real_flag = state.parse_flag_from_env
        if hasattr(accelerator_module, "is_torch_version"):  # 1.15's clip_grad_norm_; 1.16 no longer asks
            real_version = accelerator_module.is_torch_version
            accelerator_module.is_torch_version = lambda *a: versions.append(a) or real_version(*a)
        state.parse_flag_from_env = lambda *a, **k: flags.append(a) or real_flag(*a, **k)
        acc = Accelerator(cpu=True)
        model = torch.nn.Linear(2, 2)
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(3):
            with acc.accumulate(model):
                acc.backward(model(torch.ones(1, 2)).sum())
                acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
        answer(inspect.isgeneratorfunction(Accelerator.accumulate.__wrapped__),
               inspect.isgeneratorfunction(Accelerator.autocast.__wrapped__), len(versions), len(flags))
    """)
    # a generator (and an ExitStack) per micro-batch for accumulate and autocast; is_torch_version per clip
    # (accelerate 1.15 only); three environment reads (such as ACCELERATE_USE_FSDP) per step:
    # compat.skip_per_step_overheads takes shorter paths past them
    from mixprec.compat.launcher import accelerate_version

    assert out.split() == ["True", "True", "0" if accelerate_version() >= (1, 16) else "3", "9"]


def test_the_one_process_paths_train_to_the_same_bits_as_accelerates_own():
    out = fresh("""
        import collections, torch
        import accelerate, accelerate.optimizer
        from accelerate.state import AcceleratorState, GradientState
        from mixprec import compat
        compat.skip_per_step_overheads(deepspeed=False)
        owners = {"accumulate": accelerate.Accelerator, "autocast": accelerate.Accelerator,
                  "backward": accelerate.Accelerator,
                  "clip_grad_norm_": accelerate.Accelerator, "step": accelerate.optimizer.AcceleratedOptimizer}
        upstream_calls = collections.Counter()
        for name, owner in owners.items():
            real = getattr(owner, f"_mixprec_upstream_{name}")
            def counted(*args, _real=real, _name=name, **kwargs):
                upstream_calls[_name] += 1
                return _real(*args, **kwargs)
            setattr(owner, f"_mixprec_upstream_{name}", counted)
        patched = {name: getattr(owner, name) for name, owner in owners.items()}

        def train(window, fp16, upstream, init_scale=2.0 ** 10):
            for name, owner in owners.items():  # Accelerate's own methods, or the one-process paths
                setattr(owner, name, getattr(owner, f"_mixprec_upstream_{name}") if upstream else patched[name])
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
            torch.manual_seed(0)
            acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=window,
                                         mixed_precision="fp16" if fp16 else "no")
            if fp16:
                compat.fp16_on_cpu(acc, {"init_scale": init_scale})
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
            model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))
            norms, skipped = [], []
            for _ in range(6):
                x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
                with acc.accumulate(model):
                    with acc.autocast():
                        loss = torch.nn.functional.cross_entropy(model(x), y)
                    acc.backward(loss)
                    if acc.sync_gradients:
                        norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
                    opt.step()  # on every micro-batch: inside a window, Accelerate's step and zero_grad do nothing
                    opt.zero_grad()
                    if acc.sync_gradients:
                        skipped.append(acc.optimizer_step_was_skipped)
            return [p.detach().clone() for p in model.parameters()], norms, skipped, acc.step

        for window, fp16, scale in ((1, False, None), (2, False, None), (1, True, 2.0 ** 10), (2, True, 2.0 ** 10),
                                    (1, True, 2.0 ** 19)):
            upstream_calls.clear()
            ours = train(window, fp16, False, scale)
            taken = sorted(upstream_calls)
            theirs = train(window, fp16, True, scale)
            same = all(torch.equal(a, b) for a, b in zip(ours[0], theirs[0])) and repr(ours[1:]) == repr(theirs[1:])
            skips = "".join("s" if s else "." for s in ours[2])
            answer(f"{window}/{'fp16' if fp16 else 'fp32'}:{same}:{'+'.join(taken) or 'none'}:{skips}")
    """)
    # the same weights, gradient norms, skipped steps and micro-batch counter; Accelerate's own code only where a
    # path needs it: backward with accumulation (the division), step with a GradScaler (which finds the skipped
    # steps: an init scale of 2**19 overflows fp16 in the first and third steps)
    assert out.split() == ["1/fp32:True:none:......", "2/fp32:True:backward:...", "1/fp16:True:step:......",
                           "2/fp16:True:backward+step:...", "1/fp16:True:step:s.s..."]


def test_the_shorter_paths_are_decorators_and_give_none_to_as_like_accelerates():
    code = """
        import torch
        from accelerate import Accelerator
        from mixprec import compat
        if PATCHED:
            compat.skip_per_step_overheads(deepspeed=False)
        acc = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
        model = torch.nn.Linear(2, 2)

        @acc.autocast()
        def dtype():
            return model(torch.ones(1, 2)).dtype

        @acc.accumulate(model)
        def sync():
            return acc.sync_gradients

        with acc.autocast() as entered:
            inside = torch.is_autocast_enabled("cpu")
        answer(dtype(), dtype(), sync(), sync(), sync(), entered, inside, torch.is_autocast_enabled("cpu"))
    """
    ours, theirs = fresh("PATCHED = True\n" + textwrap.dedent(code)), fresh("PATCHED = False\n" + textwrap.dedent(code))
    assert ours == theirs == "torch.bfloat16 torch.bfloat16 False True False None True False"


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
