"""Runs a script (argv[1:]) and writes to $FIRST_IMPORTS, as JSON, where each of a few packages was first
imported: {"package": [the functions on the stack, innermost last]}; a package never imported is absent.
`importlib.util.find_spec` (whether a package is installed, without importing it) does not count."""
import atexit
import json
import os
import runpy
import sys
import traceback

WATCHED = ("datasets", "deepspeed", "matplotlib")
seen = {}


class Watch:
    def find_spec(self, name, path=None, target=None):
        if name in WATCHED and name not in seen:
            stack = [f"{frame.filename}:{frame.name}" for frame in traceback.extract_stack()[:-1]]
            if not any("importlib" in frame and frame.endswith("util>:find_spec") for frame in stack):
                seen[name] = stack
        return None


def write() -> None:
    with open(os.environ["FIRST_IMPORTS"], "w") as f:
        json.dump(seen, f)


sys.meta_path.insert(0, Watch())
sys.argv = sys.argv[1:]
atexit.register(write)  # an exit function: the recipe ends its process without the interpreter's teardown
runpy.run_path(sys.argv[0], run_name="__main__")
