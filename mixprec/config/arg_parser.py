"""The training flags' parser: argparse, with a bad flag said in one line (mixprec.errors.UsageError, exit 2)
and the flag meant where one is close, or where transformers, TRL or transformers' example scripts use another
name for it (the table of mixprec.config.hints)."""
from __future__ import annotations

import argparse
import difflib
import sys

from . import hints
from ..errors import UsageError


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line and exit code 2 (argparse also prints the usage), with the flag
    meant where one is close; and no abbreviations (`--max_step 100` is not taken for --max_steps)."""

    def __init__(self, **kwargs):
        super().__init__(**{"allow_abbrev": False, **kwargs})

    def parse_args(self, args=None, namespace=None):
        argv = self.hf_booleans(list(sys.argv[1:] if args is None else args))
        parsed, unrecognized = self.parse_known_args(argv, namespace)
        if unrecognized:
            self.unrecognized(argv, unrecognized)
        return parsed

    def hf_booleans(self, argv: list[str]) -> list[str]:
        """A boolean flag of ours given a value as transformers' HfArgumentParser takes it (`--health_checks false`,
        `--completion_only_loss=False`, `--use_peft true`): the flag, or its --no- form."""
        flags = {o for action in self._actions if isinstance(action, argparse.BooleanOptionalAction)
                 for o in action.option_strings if not o.startswith("--no-")}
        out, i = [], 0
        while i < len(argv):
            name, eq, value = argv[i].partition("=")
            if eq and name in flags and value.lower() in hints.TRUE | hints.FALSE:
                word, i = value.lower(), i + 1
            elif not eq and name in flags and i + 1 < len(argv) and argv[i + 1].lower() in hints.TRUE | hints.FALSE:
                word, i = argv[i + 1].lower(), i + 2
            else:
                out.append(argv[i])
                i += 1
                continue
            out.append(name if word in hints.TRUE else f"--no-{name[2:]}")
        return out

    def unrecognized(self, argv: list[str], words: list[str]):
        """Their flags (hints.explain: `--save_steps 100` is transformers' --checkpointing_steps, the 100 its
        value), then the others with the flag that is close, in one line."""
        said, left = hints.explain(argv, words)
        meant = []
        if left:
            options = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
            typed_flags = (w.split("=")[0] for w in left if w.startswith("--"))
            close = {typed: difflib.get_close_matches(typed, options, n=1, cutoff=0.75) for typed in typed_flags}
            meant = [f"{typed}: did you mean {match[0]}?" for typed, match in close.items() if match]
            said.append(f"unrecognized arguments: {' '.join(left)}")
        raise UsageError(f"{'; '.join(said)} ({'; '.join([*meant, 'see --help'])})")

    def error(self, message):
        said = hints.fraction(message)  # `--warmup_steps 0.1`: transformers' fraction of the run
        raise UsageError(f"{message} ({said + '; ' if said else ''}see --help)")
