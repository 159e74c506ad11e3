"""Tracking: the run's record (metrics.jsonl, config.yaml, summary.json, metrics.png) and the experiment
trackers (W&B, TensorBoard) behind `--report_to`.

- `record`: `Recorder`, the loop's single sink for records, and the files of the record.
- `trackers`: Accelerate's W&B and TensorBoard trackers, guarded so that a failing tracker never stops training.
- `plots`: metrics.png, the curves of a run (`python -m mixprec.tracking.plots RUN_DIR` redraws them).
- `plot_process`: the helper process that draws metrics.png beside the run's end.

The names below load on first use, so that `python -m mixprec.tracking.plots` (the helper) imports neither
torch nor Accelerate.
"""
import importlib

_WHERE = {"MetricsLog": "record", "Recorder": "record", "draw": "record", "environment": "record",
          "write_json": "record", "write_yaml": "record", "accelerator_kwargs": "trackers",
          "check_folder": "trackers", "PlotProcess": "plot_process"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
