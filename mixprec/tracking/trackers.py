"""Experiment trackers through Accelerate: W&B and TensorBoard, guarded so that training never depends on them.

`accelerator_kwargs(cfg.tracking)` gives the Accelerator its `log_with`: Accelerate's own `WandBTracker` and
`TensorBoardTracker`, subclassed. The Recorder binds them to the run folder and starts them with
`accelerator.init_trackers`; records reach them through `accelerator.log`; `accelerator.end_training`
finishes them. Accelerate runs all of this on the global main process only: one W&B run per job.

Every call into a tracker is guarded: the first exception (no network, a full disk, a bad key, a bug)
prints one warning and turns that tracker off. Training goes on and metrics.jsonl stays the record.

W&B goes online when the user is logged in (WANDB_API_KEY, or a key in ~/.netrc from `wandb login`) and
the server answers; otherwise it logs offline, says why in one line, and prints the `wandb sync` command
at the end. A W&B run that fails to start online falls back to offline, with a warning.

What can be known without writing is checked before the run folder is touched, and refused in one line (exit 2):
`accelerator_kwargs` imports each tracker's package and applies the WANDB_* variables to W&B's own settings;
`check_folder` looks at each tracker's folder in the run folder (not a file, not a broken link, writable).
"""
from __future__ import annotations

import importlib.util
import netrc
import os
import secrets
import shlex
import socket
import string
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import yaml
from accelerate.tracking import TensorBoardTracker, WandBTracker
from tqdm.auto import tqdm

from ..errors import UsageError

if TYPE_CHECKING:
    from ..config.sections import TrackingSettings

TRACKERS = {"none": (), "wandb": ("wandb",), "tensorboard": ("tensorboard",), "all": ("wandb", "tensorboard")}
WANDB_MODES = ("online", "offline", "disabled", "dryrun", "shared", "run")  # what wandb.Settings accepts
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def say(text: str) -> None:
    tqdm.write(text)  # stdout, without breaking a progress bar


def warn(text: str) -> None:
    tqdm.write(f"warning: {text}", file=sys.stderr)


def _short(err: BaseException) -> str:
    from ..errors import advice

    text = " ".join(str(err).split()) or "no message"
    said = advice(err)  # what to do about an errno, not the errno alone
    return f"{type(err).__name__}: {text[:300]}" + (f"; {said}" if said else "")


def accelerator_kwargs(tracking: TrackingSettings) -> dict:
    """`log_with` for the Accelerator, from --report_to. A tracker whose package is missing or does not import,
    or a WANDB_* variable that W&B refuses, is a UsageError."""
    names = TRACKERS[tracking.report_to]
    for name in names:
        _check_package(tracking.report_to, name)
    forced = os.environ.get("WANDB_MODE", "")
    if "wandb" in names and forced and forced not in WANDB_MODES:  # wandb.init would refuse it (case-sensitive)
        raise UsageError(f"WANDB_MODE={os.environ['WANDB_MODE']!r} is not a W&B mode: set it to one of "
                         f"{', '.join(WANDB_MODES)}, or unset it")
    if "wandb" in names:
        _check_wandb_settings(os.environ)
    classes = {"wandb": WandB, "tensorboard": TensorBoard}
    return {"log_with": [classes[name](tracking) for name in names]} if names else {}


IMPORTS = {"wandb": "wandb", "tensorboard": "torch.utils.tensorboard"}  # what each tracker's start imports


def _check_package(report_to: str, name: str) -> None:
    if importlib.util.find_spec(name) is None:
        raise UsageError(f"--report_to {report_to} needs the '{name}' package, which is not installed: "
                         f"pip install -r requirements.txt, or pass --report_to none")
    try:
        importlib.import_module(IMPORTS[name])
    except Exception as err:  # noqa: BLE001 - a broken install raises anything
        raise UsageError(f"--report_to {report_to} needs the '{name}' package, which is installed but does not "
                         f"import ({_short(err)}): pip install -r requirements.txt, or pass --report_to none") from None


def _check_wandb_settings(env) -> None:
    """Each WANDB_* variable applied to W&B's own settings, as wandb.init applies them after the folder opened."""
    import wandb

    for name in sorted(k for k in env if k.startswith("WANDB_")):
        try:
            wandb.Settings().update_from_env_vars({name: env[name]})
        except Exception as err:  # noqa: BLE001 - pydantic's ValidationError, W&B's own UsageError
            errors = getattr(err, "errors", None)
            reason = errors()[0]["msg"] if callable(errors) else " ".join(str(err).split())
            secret = any(word in name for word in ("KEY", "TOKEN", "SECRET", "PASSWORD"))
            shown = name if secret else f"{name}={env[name]!r}"
            raise UsageError(f"W&B refuses {shown} ({reason[:200]}): fix it or unset it") from None


def check_folder(tracking: TrackingSettings, out: Path) -> None:
    """Read-only, before the run folder is touched: each tracker's folder in `out` is a folder or can be made
    there (a file or a broken link in its place, or a folder that cannot be written, is a UsageError)."""
    for name in TRACKERS[tracking.report_to]:
        path = out / name
        if path.is_symlink() and not path.exists():
            problem = "a broken link"
        elif path.exists() and not path.is_dir():
            problem = "a file, not a folder"
        elif path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
            problem = "a folder that cannot be written"
        else:
            continue
        raise UsageError(f"--report_to {tracking.report_to}: '{path}', where {name} writes, is {problem}: move it "
                         f"away or fix its permissions, choose another --output_dir, or pass --report_to none")


def tracker_values(record: dict) -> dict:
    """metrics.jsonl names -> tracker names: train/<name> per optimizer step, eval/<name> per evaluation
    (val_loss -> eval/loss), event/<name> for events; `epoch` stays `epoch`, `step` becomes the x axis."""
    kind = "event" if "event" in record else "eval" if any(k.startswith("val_") for k in record) else "train"
    values = {}
    for key, value in record.items():
        if key in ("step", "reported_at") or not isinstance(value, (int, float, str)):
            continue
        if key == "epoch":
            values["epoch"] = value
            continue
        name = key[4:] if kind == "eval" and key.startswith("val_") else key
        values[f"{kind}/{name}"] = int(value) if isinstance(value, bool) else value
    if "reported_at" in record:  # logged at that step: the step it is about goes with it
        values["event/step"] = record["step"]
    return values


class Guarded:
    """Mixed into Accelerate's tracker classes: each call is guarded, the first failure warns and turns the
    tracker off. Subclasses override the `_start`, `_store_config`, `_log`, `_store_summary`, `_finish` steps."""

    title = "tracker"
    main_process_only = True
    off = False

    def bind(self, out: Path, resume_step: int | None, state: dict) -> None:
        """The run folder, the step a resumed run continues after (None for a new run), and what the
        checkpoint remembered (`Recorder.checkpoint_state`)."""

    def _guard(self, what: str, fn, *args, **kwargs):
        if self.off:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - whatever a tracker raises, training goes on
            self.off = True
            warn(f"{self.title} failed {what} ({_short(err)}); it is off for the rest of this run, "
                 f"training goes on and metrics.jsonl keeps the record")
            return None

    # what Accelerate calls
    def start(self):
        self._guard("to start", self._start)

    def store_init_configuration(self, values: dict):
        self._guard("to store the config", self._store_config, values)

    def log(self, values: dict, step: int | None = None, **kwargs):
        self._guard(f"to log step {step}", self._log, values, step, **kwargs)

    def finish(self):
        self._guard("to finish", self._finish)

    # what the Recorder calls
    def store_summary(self, summary: dict):
        self._guard("to store the summary", self._store_summary, summary)

    # the steps, by default Accelerate's own
    def _start(self):
        super().start()

    def _store_config(self, values: dict):
        super().store_init_configuration(values)

    def _log(self, values: dict, step: int | None, **kwargs):
        super().log(values, step=step, **kwargs)

    def _store_summary(self, summary: dict):
        pass

    def _finish(self):
        super().finish()


class TensorBoard(Guarded, TensorBoardTracker):
    """Event files in <output_dir>/tensorboard. A resumed run purges the events its crashed predecessor
    wrote after the checkpoint, so the curves read like one run."""

    title = "TensorBoard"

    def __init__(self, tracking: TrackingSettings):
        super().__init__("tensorboard", ".")  # the folder is bound later, when the run folder is known

    def bind(self, out, resume_step, state):
        self.logging_dir_param = str(out)
        self.init_kwargs = {"purge_step": resume_step + 1} if resume_step is not None else {}

    def _start(self):
        super()._start()
        say(f"TensorBoard: {self.logging_dir} (view: tensorboard --logdir {shlex.quote(self.logging_dir)})")

    def _store_config(self, values: dict):  # as text: add_hparams wants flat scalars and makes a second run
        self._text("config", values)

    def _store_summary(self, summary: dict):
        self._text("summary", summary)

    def _text(self, tag: str, values: dict):
        text = yaml.safe_dump(values, sort_keys=False, default_flow_style=False)
        self.writer.add_text(tag, "    " + text.replace("\n", "\n    "))  # indented: a markdown code block
        self.writer.flush()


class WandB(Guarded, WandBTracker):
    """One W&B run in <output_dir>/wandb; its id goes into the checkpoint and a resumed run continues it."""

    title = "W&B"

    def __init__(self, tracking: TrackingSettings):
        super().__init__(tracking.project)  # Accelerate's WandBTracker calls the project `run_name`
        self.cfg, self.run, self.out, self.resume_id, self.mode = tracking, None, None, None, None

    def bind(self, out, resume_step, state):
        self.out, self.resume_id = Path(out), state.get("wandb_run_id") if resume_step is not None else None

    @property
    def run_id(self) -> str | None:
        return self.run.id if self.run is not None else None

    def _start(self):
        import wandb

        mode, why = wandb_mode(os.environ)
        if mode == "disabled":
            say(f"W&B: disabled ({why}): nothing is sent to W&B")
            self.off = True
            return
        # the id is chosen here, so that an offline fallback keeps the id an online attempt may have created
        run_id = self.resume_id or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        kwargs = {"project": self.run_name, "name": self.cfg.run_name or self.out.name, "dir": str(self.out),
                  "tags": self.cfg.tags or None, "job_type": "train", "id": run_id, "resume": "allow",
                  "settings": wandb.Settings(silent=True)}
        try:
            self.run = wandb.init(mode=mode, **kwargs)
        except Exception as err:  # noqa: BLE001
            if mode != "online":
                raise
            warn(f"W&B could not start online ({_short(err)}): logging offline instead")
            mode, why = "offline", "the online start failed"
            wandb.teardown()  # else the failed attempt keeps the run id "in use"
            self.run = wandb.init(mode="offline", **kwargs)
        self.mode = mode
        which = f"run {self.run.id}" + (" (continued from the checkpoint)" if self.resume_id else "")
        if mode == "online":
            say(f"W&B: online ({why}), {which}: {self.run.url}")
        else:
            say(f"W&B: offline ({why}), {which} saved in {Path(self.run.dir).parent}; "
                f"the command to upload it is printed at the end")

    def _log(self, values, step, **kwargs):
        if step is not None and step < self.run.starting_step:
            return  # a resumed online run already holds this step (logged before the crash)
        super()._log(values, step, **kwargs)

    def _store_summary(self, summary: dict):
        self.run.summary.update(summary)

    def finish(self):
        super().finish()
        if self.off and self.run is not None:  # failed during the run: what it holds can still be uploaded
            self._where()

    def _finish(self):
        super()._finish()
        self._where()

    def _where(self):
        if self.mode == "offline":  # every piece of this run (one per resumed job), oldest first
            pieces = shlex.quote(str(Path(self.run.dir).parent.parent)) + f"/offline-run-*-{self.run.id}"
            say(f"W&B: offline run {self.run.id}; upload it with:  wandb sync {pieces}")
        else:
            say(f"W&B: run {self.run.id} at {self.run.url}")


def wandb_mode(env) -> tuple[str, str]:
    """'online', 'offline' or 'disabled', and why, from WANDB_MODE, the credentials and the network."""
    forced = env.get("WANDB_MODE", "")  # as W&B reads it: case-sensitive
    if forced in ("offline", "dryrun", "disabled"):
        return ("disabled" if forced == "disabled" else "offline"), f"WANDB_MODE={forced}"
    if forced == "online":
        return "online", "WANDB_MODE=online"
    url = env.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    host = urlsplit(url).hostname or url
    source = _credentials(env, host)
    if source is None:
        return "offline", f"not logged in: no WANDB_API_KEY and no key for {host} in {_netrc_path(env)}"
    if not any(env.get(name) for name in PROXY_VARS):  # behind a proxy, W&B itself has to try
        problem = unreachable(url)
        if problem:
            return "offline", f"logged in ({source}), but {host} cannot be reached from here: {problem}"
    return "online", f"logged in ({source})"


def _netrc_path(env) -> str:
    return env.get("NETRC") or str(Path.home() / ".netrc")


def _credentials(env, host: str) -> str | None:
    """Where an API key for `host` comes from, or None."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if env.get(name):
            return name
    path = _netrc_path(env)
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return None
    return path if entry and entry[2] else None


def unreachable(url: str, timeout: float = 5.0) -> str | None:
    """None if a TCP connection to the server of `url` opens within `timeout` seconds, else the reason.
    The probe runs in a thread, so that a name lookup without a network cannot hang the run either."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    outcome: list[str | None] = []

    def probe():
        try:
            socket.create_connection((parts.hostname, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as err:
            outcome.append(_short(err))

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 1)
    return outcome[0] if outcome else f"no answer within {timeout + 1:.0f} s"
