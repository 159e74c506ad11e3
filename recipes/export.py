#!/usr/bin/env python
"""Export a finished run again: its transformers export in another dtype, from its final weights or a checkpoint,
a LoRA run merged or not, through the same export and range audit as the end of the run
(mixprec.models.hf_export.export).

    python recipes/export.py runs/NAME --save_dtype fp16
    python recipes/export.py runs/NAME --checkpoint latest --save_dtype fp32 --output_dir exports/NAME-fp32
    python recipes/export.py runs/NAME --merge_lora                  # a LoRA run: the adapters merged in

The run's settings come from its config.yaml, its weights from its model.safetensors (or --checkpoint: a
checkpoint folder, or latest); the model is rebuilt from the run's model and tokenizer folders, which must be as
the run found them. --save_dtype auto|fp32|bf16|fp16 (default: the run's), --merge_lora / --no-merge_lora
(default: the run's). --output_dir (default RUN/hf_model; an adapter without merging: RUN/adapter) is replaced
only if an export of this recipe is there (mixprec_export.json). Bad input is one line, exit code 2, nothing
written; an export the range audit refuses (NaN, inf, overflow) is one line, exit code 1, nothing written.
A saved export is recorded in config.yaml's history, and in summary.json when it replaced the run's own folder.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mixprec.errors import exit_on_usage_error
from mixprec.models import hf_export
from mixprec.run_folder import run_loading


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="the run folder (runs/NAME)")
    parser.add_argument("--checkpoint", help="a checkpoint folder or latest (default: the run's model.safetensors)")
    parser.add_argument("--save_dtype", choices=("auto", *hf_export.DTYPES), help="default: the run's")
    parser.add_argument("--merge_lora", action=argparse.BooleanOptionalAction, help="default: the run's")
    parser.add_argument("--output_dir", type=Path, help="default: RUN/hf_model (RUN/adapter: an unmerged adapter)")
    return parser.parse_args(argv)  # argparse's own usage error: exit code 2, as every bad input


@exit_on_usage_error
def main(argv: list[str] | None = None) -> dict:
    args = parse(sys.argv[1:] if argv is None else argv)
    typed = [*(["--save_dtype", args.save_dtype] if args.save_dtype else []),
             *([] if args.merge_lora is None else ["--merge_lora" if args.merge_lora else "--no-merge_lora"])]
    cfg, summary = run_loading.run_settings(args.run, typed)
    weights, step = run_loading.run_weights(cfg, args.run, args.checkpoint)
    key = "hf_export" if not cfg.use_peft or cfg.merge_lora else "lora_export"
    folder = args.output_dir or args.run / ("hf_model" if key == "hf_export" else "adapter")
    run_loading.check_folder(cfg, args.run, folder, key)
    from accelerate import Accelerator

    model = run_loading.rebuild(cfg, weights, summary.get("effective_precision", cfg.mixed_precision))
    result = hf_export.export(Accelerator(cpu=True), model, cfg, args.run, {key: folder})[key]
    if result["status"] != "saved":
        raise SystemExit(1)  # the audit's line said why; nothing written
    where = run_loading.record_export(args.run, key, result, weights, step)
    print(f"the export holds {weights}; recorded in {where}")
    return result


if __name__ == "__main__":
    main()
