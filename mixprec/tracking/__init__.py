"""Tracking: the run's record (metrics.jsonl, config.yaml, summary.json, metrics.png) and the experiment
trackers (W&B, TensorBoard) behind `--report_to`.

- `record`: `Recorder`, the loop's single sink for records, and the files of the record.
- `trackers`: Accelerate's W&B and TensorBoard trackers, guarded so that a failing tracker never stops training.
- `plots`: metrics.png, the curves of a run (`python -m mixprec.tracking.plots RUN_DIR` redraws them).
"""
from .record import MetricsLog, Recorder, draw, environment, write_json, write_yaml
from .trackers import accelerator_kwargs, check_folder

__all__ = ["MetricsLog", "Recorder", "accelerator_kwargs", "check_folder", "draw", "environment", "write_json",
           "write_yaml"]
