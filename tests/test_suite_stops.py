"""The suite stops when told to: SIGINT or SIGTERM to pytest (as `timeout` and CI runners send them, to pytest
alone) ends it within seconds, its pytest-xdist workers and what their tests started included."""
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from helpers import REPO, base_env, live_processes


@pytest.mark.skipif(not os.environ.get("MIXPREC_SUITE_STOPS_MARK"), reason="run by the test below only")
def test_a_long_child_process():
    subprocess.run([sys.executable, "-c", "import time; time.sleep(600)", os.environ["MIXPREC_SUITE_STOPS_MARK"]],
                   timeout=900)


def running(mark: str) -> list[int]:
    return [pid for pid, cmdline, _ in live_processes() if mark in cmdline]


@pytest.mark.skipif(not os.environ.get("MIXPREC_SUITE_STOPS_MARK"), reason="run by the test below only")
def test_a_test_that_hangs():
    time.sleep(600)


@pytest.mark.skipif(not os.environ.get("MIXPREC_SUITE_STOPS_MARK"), reason="run by the test below only")
def test_the_test_after_it():
    pass


@pytest.mark.skipif(not os.environ.get("MIXPREC_SUITE_STOPS_MARK"), reason="run by the test below only")
def test_a_child_process_ends_on_sighup():
    code = "import signal; print(signal.getsignal(signal.SIGHUP) == signal.SIG_DFL)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
    assert signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, signal.SIG_IGN)  # this worker outlives a hangup


@pytest.mark.slow
def test_under_nohup_the_processes_tests_start_still_end_on_sighup():
    """`nohup pytest` starts pytest with SIGHUP ignored, which every process it starts would inherit (a launcher
    sent SIGHUP by tests/test_preemption.py would then live on): tests/conftest.py keeps pytest and its workers
    alive through a hangup (a handler in each) without passing the ignore on."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "2",
                           f"{__file__}::test_a_child_process_ends_on_sighup"], cwd=REPO, capture_output=True,
                          text=True, env=base_env({"MIXPREC_SUITE_STOPS_MARK": "nohup"}), timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
def test_a_hung_test_fails_at_the_per_test_timeout_and_the_suite_goes_on():
    """pyproject.toml's `timeout` (pytest-timeout): here lowered to 3 s for a test that sleeps 600 s."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "0", "--timeout", "3",
                           f"{__file__}::test_a_test_that_hangs", f"{__file__}::test_the_test_after_it"], cwd=REPO,
                          capture_output=True, text=True, env=base_env({"MIXPREC_SUITE_STOPS_MARK": "timeout"}),
                          timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "Timeout (>3.0s)" in proc.stdout and "1 failed, 1 passed" in proc.stdout, proc.stdout[-2000:]
    assert time.monotonic() - started < 120


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_pytest_stops_with_its_workers_and_their_children(sig):
    mark = f"suite-stops-{uuid.uuid4().hex}"
    suite = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "2",
                              f"{__file__}::test_a_long_child_process"], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, env=base_env({"MIXPREC_SUITE_STOPS_MARK": mark}))
    try:
        deadline = time.monotonic() + 120
        while not running(mark) and time.monotonic() < deadline:  # the test's child has started
            time.sleep(0.2)
        assert running(mark), suite.stdout.read().decode()[-2000:] if suite.poll() is not None else "not started"
        os.kill(suite.pid, sig)
        suite.wait(60)
        deadline = time.monotonic() + 30
        while running(mark) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running(mark), f"left running after {sig!r}"
    finally:
        suite.kill()
        for pid in running(mark):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_recipe_run_past_its_limit_fails_with_each_processs_stack_and_leaves_nothing_running(tmp_path):
    """tests/helpers.py's run_recipe: a 2-process launch that does not end fails its test at run_recipe's own
    limit with the stacks of the launcher and of both workers (which torchrun starts in sessions of their own),
    and none of the three is left."""
    from helpers import CONFIGS, free_port, run_recipe

    mark = f"recipe-past-its-limit-{uuid.uuid4().hex}"
    script = tmp_path / "hangs.py"
    script.write_text("import time\ntime.sleep(600)\n")
    with pytest.raises(pytest.fail.Exception) as failed:
        run_recipe(mark, script=script, timeout=20, config=CONFIGS / "multi_cpu.yaml",
                   launch_args=("--num_processes", 2, "--main_process_port", free_port()))
    message = str(failed.value)
    assert "did not end in 20 s" in message and message.count("== process ") == 3, message[:3000]
    assert message.count("nanosleep") >= 2, message[:3000]  # where each worker waits: py-spy's stack or the kernel's
    assert not running(mark)


def test_a_recipe_run_that_fails_fails_its_test_with_its_output(tmp_path):
    """run_recipe with check (the default): a non-zero exit fails the test, and the message holds the run's
    exit code, stdout and stderr."""
    from helpers import run_recipe

    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('said on stdout')\nsys.exit('said on stderr')\n")
    with pytest.raises(pytest.fail.Exception) as failed:
        run_recipe(launcher="python", script=script)
    assert "exited 1" in str(failed.value) and "said on stdout" in str(failed.value), str(failed.value)
    assert "said on stderr" in str(failed.value)
