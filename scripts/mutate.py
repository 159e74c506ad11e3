"""Mutation testing of the modules behind README's guarantees: does a test fail when the product breaks?

    python scripts/mutate.py --list                     # the mutations, their files and tests
    python scripts/mutate.py no-cpu-flag                # one mutation: killed or survived
    python scripts/mutate.py --all                      # every one (minutes: end-to-end runs)

Each mutation is a small list of source edits (file, old text, new text) and the tests that should catch it.
For each, the checkout (tracked and untracked files that git does not ignore, uncommitted edits included) is
copied to a temporary folder; the edits are made there, never in the working tree; the tests run there with
the copy first on PYTHONPATH, so that the recipes they launch import the mutated copy too. First the same tests
run on the unmutated copy (a baseline: a test that fails anyway kills nothing; --no-baseline skips it).

Verdicts: killed (the tests fail on the mutant), survived (they pass: a broken promise nobody would notice),
stale (an edit's old text is not in the file exactly once: the mutation no longer fits the code), error (the
baseline fails, or pytest could not run the tests). Exit code: 0 when every mutation is killed, else 1.
docs/testing.md lists the mutations tried and what survives and why.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    edits: tuple  # (file, old text, new text), each old text found exactly once
    tests: tuple  # pytest arguments: files and -k expressions
    breaks: str  # the promise it breaks


MUTATIONS = {
    "no-cpu-flag": Mutation(
        (("mixprec/devices/hardware.py", 'if argv is None or "--cpu" in argv:', "if argv is None:"),),
        ("tests/test_gpu_request.py", "-k", "which_launches"),
        "`accelerate launch --cpu` with a GPU config trains on the CPU as asked"),
    "gpu-request-ignored": Mutation(
        (("mixprec/precision/__init__.py", "    refuse_missing_gpus()  #", "    pass  #"),),
        ("tests/test_gpu_request.py", "-k", "likely_cause"),
        "a launch that names GPUs where torch sees none stops in one line, exit 2"),
    "resume-drops-fp32-modules": Mutation(
        (("mixprec/run_folder/resume.py", ' "fp32_modules": list(cfg.fp32_modules),\n', "\n"),),
        ("tests/test_fp32_modules.py", "-k", "resume"),
        "a resume with other --fp32_modules is refused"),
    "train-file-not-fingerprinted": Mutation(
        (("mixprec/run_folder/resume.py", "    if not path:\n        return None\n", "    return None\n"),),
        ("tests/test_run_folder.py", "-k", "changed_train_file"),
        "a resume with another --train_file content is refused"),
    "resume-accepts-any-change": Mutation(
        (("mixprec/run_folder/resume.py", "refused = {k: v for k, v in changed.items() if k not in allowed}", "refused = {}"),),
        ("tests/test_run_folder.py", "-k", "refused_with_each_change"),
        "a resume with changed settings is refused unless allowed"),
    "skips-uncounted-without-health-checks": Mutation(
        (("mixprec/health/monitor.py", "self.device_skips += ~torch.isfinite(self.grad_norm)", "pass"),),
        ("tests/test_health.py", "-k", "without_health_checks"),
        "fp16 skipped steps are counted with --no-health_checks"),
    "banner-says-requested": Mutation(
        (("mixprec/precision/__init__.py", "-> effective {info['effective_precision']}", "-> effective {info['requested_precision']}"),),
        ("tests/test_precision.py", "-k", "auto_is_said"),
        "the banner says the effective precision"),
    "fp16-on-cpu-silently-fp32": Mutation(
        (("mixprec/compat/accelerate_patches.py", "    accelerator.native_amp = True\n", ""),
         ("mixprec/compat/accelerate_patches.py", '    accelerator.scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)\n', "")),
        ("tests/test_precision.py", "-k", "fp16_on_cpu"),
        "fp16 on a CPU is real fp16 autocast with a GradScaler"),
    "no-restart-accumulation": Mutation(
        (("mixprec/training/prepared.py", "            compat.restart_accumulation(accelerator)  #", "            pass  #"),),
        ("tests/test_world_size.py", "-k", "accumulation_split"),
        "a resume with another accumulation split trains the same steps"),
    "same-seed-on-another-world-size": Mutation(
        (("mixprec/training/prepared.py", "set_seed((cfg.seed + accelerator.process_index + 1_000_003 * plan.step) % 2**32)",
          "pass"),),
        ("tests/test_world_size.py", "-k", "draws_fresh_dropout_masks"),
        "a resume on another number of processes draws fresh random states (dropout)"),
}


def copy_checkout(dest: Path) -> None:
    """The checkout's files as git sees them (tracked and untracked, not ignored), edits included."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def apply(root: Path, mutation: Mutation) -> str | None:
    """Make the edits in `root`; the reason when one does not fit (its old text not there exactly once)."""
    for file, old, new in mutation.edits:
        path = root / file
        text = path.read_text()
        if text.count(old) != 1:
            return f"{file}: the text to replace occurs {text.count(old)} times, not once: {old!r}"
        path.write_text(text.replace(old, new))
    return None


def run_tests(root: Path, tests: tuple, timeout: int) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-x", *tests]
    try:
        return subprocess.run(cmd, cwd=root, env=env, capture_output=True, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return -1


def verdict(name: str, baseline: bool, timeout: int) -> str:
    mutation = MUTATIONS[name]
    with tempfile.TemporaryDirectory(prefix=f"mutate-{name}-") as tmp:
        root = Path(tmp)
        copy_checkout(root)
        if baseline and run_tests(root, mutation.tests, timeout) != 0:
            return "error: the tests fail (or time out) without the mutation"
        stale = apply(root, mutation)
        if stale:
            return f"stale: {stale}"
        code = run_tests(root, mutation.tests, timeout)
    # pytest: 0 all passed, 1 some failed; anything else (usage, collection, no tests, timeout) is an error
    return {0: "survived", 1: "killed"}.get(code, f"error: pytest exited {code}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutations to run (see --list)")
    parser.add_argument("--all", action="store_true", help="run every mutation")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false",
                        help="do not first run the tests on the unmutated copy")
    parser.add_argument("--timeout", type=int, default=900, help="seconds for each pytest run")
    args = parser.parse_args(argv)
    if args.list:
        for name, m in MUTATIONS.items():
            print(f"{name}: breaks '{m.breaks}'; edits {', '.join(sorted({f for f, _, _ in m.edits}))}; "
                  f"tests {' '.join(m.tests)}")
        return 0
    names = list(MUTATIONS) if args.all else args.names
    unknown = [n for n in names if n not in MUTATIONS]
    if unknown or not names:
        print(f"error: {'unknown mutation ' + ', '.join(unknown) if unknown else 'name a mutation'}: "
              f"choose from {', '.join(MUTATIONS)}, or --all", file=sys.stderr)
        return 2
    results = {}
    for name in names:
        results[name] = verdict(name, args.baseline, args.timeout)
        print(f"{name}: {results[name]}", flush=True)
    killed = sum(r == "killed" for r in results.values())
    print(f"{killed} of {len(results)} killed")
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
