"""Test hooks for recipe processes. Python imports this module at start-up when this folder is on PYTHONPATH
(tests/helpers.py `hooks_env`). Two tools, each off unless its environment variables are set:

- faults (MIXPREC_TEST_FAULTS): the wrappers of tests/faults.py, put on the recipe's modules as they load;
- the write audit (MIXPREC_AUDIT_ROOT, MIXPREC_AUDIT_DIR): in a process started by a distributed launcher
  (RANK is set), every file operation under MIXPREC_AUDIT_ROOT is appended to MIXPREC_AUDIT_DIR/rank-<RANK>.jsonl:
  Python-level opens for writing, renames, mkdir, remove, rmtree (audit hooks), and torch.save / safetensors
  save_file, which write from C++ and Rust (wrapped when those modules load)."""
import importlib.abc
import importlib.machinery
import json
import os
import sys

ROOT, LOG_DIR, RANK = (os.environ.get(k) for k in ("MIXPREC_AUDIT_ROOT", "MIXPREC_AUDIT_DIR", "RANK"))
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
EVENTS = {"os.rename": "rename", "os.mkdir": "mkdir", "os.remove": "remove", "shutil.rmtree": "rmtree"}

PATCHES = {}  # module name -> function(module), applied right after the module loads

if os.environ.get("MIXPREC_TEST_FAULTS"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
    import faults as _faults  # noqa: E402

    _injected = _faults.Faults(os.environ["MIXPREC_TEST_FAULTS"])
    for _name in _faults.TARGETS:
        PATCHES[_name] = lambda module: _faults.patch_module(_injected, module)

if ROOT and LOG_DIR and RANK is not None:
    _log = open(os.path.join(LOG_DIR, f"rank-{RANK}.jsonl"), "a", buffering=1)
    _root = os.path.realpath(ROOT)

    def _record(op, path):
        if isinstance(path, (str, bytes, os.PathLike)):
            path = os.path.realpath(os.fsdecode(path))
            if path == _root or path.startswith(_root + os.sep):
                _log.write(json.dumps({"rank": int(RANK), "op": op, "path": os.path.relpath(path, _root)}) + "\n")

    def _hook(event, args):
        if event == "open" and args[2] is not None and args[2] & WRITE_FLAGS:
            _record("write", args[0])
        elif event in EVENTS:
            _record(EVENTS[event], args[0])

    sys.addaudithook(_hook)

    def _wrap(module, name):
        original = getattr(module, name)

        def wrapper(obj, f, *args, **kwargs):
            _record("write", f)
            return original(obj, f, *args, **kwargs)

        setattr(module, name, wrapper)

    PATCHES["torch.serialization"] = lambda module: _wrap(module, "save")
    PATCHES["safetensors.torch"] = lambda module: _wrap(module, "save_file")


class _Finder(importlib.abc.MetaPathFinder):
    """Runs PATCHES[name](module) right after module `name` is executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module, run=run):
                run(module)
                PATCHES[fullname](module)

            spec.loader.exec_module = exec_module
        return spec


if PATCHES:
    sys.meta_path.insert(0, _Finder())
