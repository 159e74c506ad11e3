"""A resume takes the run's settings from the run itself: `--resume_from_checkpoint latest --output_dir RUN`
alone continues it. The settings recorded in RUN/config.yaml come below a --config file and the flags typed on
the command line, which are the changes the resume contract judges (mixprec.run_folder.resume). No torch import here."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

NOT_FROM_THE_RUN = {"config", "output_dir", "resume_from_checkpoint", "overwrite_output_dir", "allow_config_change"}
LENGTH = {"max_steps", "num_epochs"}  # typing either sets the run's length anew


def recorded(typed: dict) -> dict:
    """The run's recorded settings that the command line does not type, for `--resume_from_checkpoint latest`
    with an --output_dir holding a readable config.yaml; {} otherwise (the resume then checks as before)."""
    if typed.get("resume_from_checkpoint") != "latest" or not typed.get("output_dir"):
        return {}
    path = Path(typed["output_dir"]) / "config.yaml"
    try:
        saved = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("config") or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        return {}
    if not isinstance(saved, dict):
        return {}
    skip = NOT_FROM_THE_RUN | set(typed) | (LENGTH if LENGTH & set(typed) else set())
    return {k: v for k, v in saved.items() if k not in skip}


def say(taken: dict, defaults: dict, path: Path) -> None:
    """One line naming the settings taken from the run that differ from the defaults (main process only)."""
    differing = {k: v for k, v in taken.items() if defaults.get(k) != v}
    if differing and os.environ.get("RANK", "0") == "0":
        shown = ", ".join(f"{k} {v}" for k, v in differing.items())
        print(f"resume: settings from {path}: {shown} (a flag typed on the command line overrides one)",
              file=sys.stdout, flush=True)
