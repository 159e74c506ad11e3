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


def test_a_checkpoint_from_before_a_dataset_setting_existed_resumes(tmp_path):
    """A key added to model_args or dataset_args since a checkpoint was written (text_classification's
    checkpoint_labels), at its default None, is no change; set, or a recorded key changed, is refused."""
    from mixprec.errors import UsageError
    from mixprec.run_folder.resume import compare

    saved = {"dataset_args": {"block_size": 16}, "lr": 1e-3}
    now = {"dataset_args": {"block_size": 16, "checkpoint_labels": None}, "lr": 1e-3}
    assert compare(saved, now, [], tmp_path) == {}
    for changed in ({"block_size": 16, "checkpoint_labels": ["pos", "neg"]}, {"block_size": 32, "checkpoint_labels": None}):
        with pytest.raises(UsageError, match="dataset_args"):
            compare(saved, {**now, "dataset_args": changed}, [], tmp_path)
