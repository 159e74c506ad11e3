"""The training flags' parser: argparse, with a bad flag said in one line (mixprec.errors.UsageError, exit 2)
and the flag meant where one is close or where transformers' example scripts use another name for it."""
from __future__ import annotations

import argparse
import difflib

from ..errors import UsageError

# transformers' example scripts (run_clm_no_trainer.py) name these differently: said when one is typed
THEIR_NAMES = {"--learning_rate": "--lr", "--num_train_epochs": "--num_epochs", "--max_train_steps": "--max_steps",
               "--per_device_train_batch_size": "--batch_size", "--per_device_eval_batch_size": "--eval_batch_size",
               "--num_warmup_steps": "--warmup_steps"}


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line and exit code 2 (argparse also prints the usage), with the flag
    meant where one is close; and no abbreviations (`--max_step 100` is not taken for --max_steps)."""

    def __init__(self, **kwargs):
        super().__init__(**{"allow_abbrev": False, **kwargs})

    def error(self, message):
        hints = []
        if message.startswith("unrecognized arguments:"):
            options = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
            typed_flags = (w.split("=")[0] for w in message.split(":", 1)[1].split() if w.startswith("--"))
            for typed in dict.fromkeys(typed_flags):
                close = difflib.get_close_matches(typed, options, n=1, cutoff=0.75)
                meant = THEIR_NAMES.get(typed) or (close[0] if close else None)
                if meant:
                    hints.append(f"{typed}: did you mean {meant}?")
        raise UsageError(f"{message} ({'; '.join([*hints, 'see --help'])})")
