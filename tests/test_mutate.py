"""scripts/mutate.py: a mutation the tests catch is reported killed, one they miss survived, one that no longer
fits the code stale; the working tree is never touched."""
import importlib.util
import subprocess
import sys

import pytest

from helpers import REPO, snapshot

SCRIPT = REPO / "scripts" / "mutate.py"


def load():
    spec = importlib.util.spec_from_file_location("mutate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutate"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_mutation_fits_the_code():
    """Each edit's old text is in its file exactly once (else the list in docs/testing.md is out of date)."""
    for name, mutation in load().MUTATIONS.items():
        for file, old, new in mutation.edits:
            assert (REPO / file).read_text().count(old) == 1 and old != new, (name, file, old)


@pytest.mark.slow
def test_a_killed_mutation_through_the_command_leaves_the_working_tree_as_it_was():
    before = snapshot(REPO / "mixprec")
    run = subprocess.run([sys.executable, str(SCRIPT), "no-cpu-flag"], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines() == ["no-cpu-flag: killed", "1 of 1 killed"]
    assert snapshot(REPO / "mixprec") == before


@pytest.mark.slow
def test_survived_and_stale_verdicts(monkeypatch, capsys):
    mutate = load()
    tests = ("tests/test_gpu_request.py", "-k", "which_launches")
    monkeypatch.setitem(mutate.MUTATIONS, "docstring", mutate.Mutation(
        (("mixprec/devices/hardware.py", '"""What the recipe runs on:', '"""What this recipe runs on:'),), tests, "nothing"))
    monkeypatch.setitem(mutate.MUTATIONS, "gone", mutate.Mutation(
        (("mixprec/devices/hardware.py", "text that is not there", ""),), tests, "nothing"))
    assert mutate.main(["docstring", "gone", "--no-baseline"]) == 1
    survived, stale, total = capsys.readouterr().out.splitlines()
    assert survived == "docstring: survived" and total == "0 of 2 killed"
    assert stale.startswith("gone: stale: mixprec/devices/hardware.py: the text to replace occurs 0 times")
