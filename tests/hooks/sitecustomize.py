"""Test hooks for recipe processes. Python imports this module at start-up when this folder is on PYTHONPATH
(tests/helpers.py `hooks_env`). Two tools, each off unless its environment variables are set:

- faults (MIXPREC_TEST_FAULTS): the wrappers of tests/faults.py, put on the recipe's modules as they load;
- the write audit (MIXPREC_AUDIT_ROOT, MIXPREC_AUDIT_DIR): in a process started by a distributed launcher
  (RANK is set), every file operation under MIXPREC_AUDIT_ROOT is appended to MIXPREC_AUDIT_DIR/rank-<RANK>.jsonl:
  Python-level opens for writing, renames, mkdir, remove, rmtree (audit hooks), and torch.save / safetensors
  save_file, which write from C++ and Rust (wrapped when those modules load);
- the teardown log (MIXPREC_TEST_TEARDOWN_DIR): in a process started by a distributed launcher, each call of
  torch.distributed.destroy_process_group and how many DistributedDataParallel wrappers are alive then, and each
  wrapper freed before the process ends (a finalizer), appended to MIXPREC_TEST_TEARDOWN_DIR/rank-<RANK>.jsonl.
  A wrapper alive at the destroy holds the process group's last reference in its Reducer: mixprec/compat/
  teardown.py says why that can hang the process when it is freed."""
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

TEARDOWN_DIR = os.environ.get("MIXPREC_TEST_TEARDOWN_DIR")
if TEARDOWN_DIR and RANK is not None:
    import weakref

    _teardown_log = open(os.path.join(TEARDOWN_DIR, f"rank-{RANK}.jsonl"), "a", buffering=1)
    _wrappers = weakref.WeakSet()
    _destroyed = []

    def _teardown(**record):
        _teardown_log.write(json.dumps({"rank": int(RANK), **record}) + "\n")

    def _on_freed():
        _teardown(event="ddp_freed", after_destroy=bool(_destroyed))

    def _watch_ddp(module):
        cls = module.DistributedDataParallel
        original = cls.__init__

        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            _wrappers.add(self)
            weakref.finalize(self, _on_freed).atexit = False  # freed by the program, not at interpreter exit

        cls.__init__ = __init__

    def _watch_destroy(module):
        original = module.destroy_process_group

        def destroy_process_group(*args, **kwargs):
            _destroyed.append(True)
            _teardown(event="destroy", live_ddp=len(_wrappers))
            return original(*args, **kwargs)

        module.destroy_process_group = destroy_process_group

    PATCHES["torch.nn.parallel.distributed"] = _watch_ddp
    PATCHES["torch.distributed"] = _watch_destroy


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
