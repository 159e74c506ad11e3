"""A resume takes the run's settings from the run: `--resume_from_checkpoint latest --output_dir RUN` with a new
length alone continues a run started with other flags; typed flags are the changes the resume contract judges."""
import pytest

from helpers import assert_one_line_error, run_recipe

FIRST = ["--max_steps", "10", "--checkpointing_steps", "10", "--mixed_precision", "no", "--seed", "5", "--lr", "0.002"]


@pytest.mark.slow
def test_latest_alone_continues_with_the_runs_settings_and_typed_flags_are_judged(tmp_path):
    out = tmp_path / "run"
    run_recipe(*FIRST, out=out, launcher="python")
    changed = run_recipe("--resume_from_checkpoint", "latest", "--seed", "6", out=out, launcher="python",
                         check=False)
    assert_one_line_error(changed, "seed")  # typed: a change the contract refuses
    more = run_recipe("--resume_from_checkpoint", "latest", "--max_steps", "14", out=out, launcher="python")
    assert "resume: settings from" in more.stdout and "lr 0.002, seed 5" in more.stdout
    assert more.summary()["steps"] == 14 and more.config()["config"]["seed"] == 5
    again = run_recipe(*FIRST[2:], "--max_steps", "16", "--resume_from_checkpoint", "latest", out=out,
                       launcher="python")  # the first command again (a requeue), longer
    assert again.summary()["steps"] == 16
