#!/usr/bin/env python
"""Precision doctor: what fp16 and bf16 would do to this model, measured on its real weights and gradients.

    python recipes/precision_report.py                                      # the lesson's MLP, fresh weights
    python recipes/precision_report.py --resume_from_checkpoint runs/NAME   # a trained run's weights
    python recipes/precision_report.py --config recipes/configs/mlp.yaml --num_batches 16 --init_scale 1024

It takes the same --config, --model, --model_args, --dataset, --batch_size, --init_scale (the loss scale
to judge) and --seed as recipes/train.py; --resume_from_checkpoint loads weights from a run folder, a
checkpoint folder, a .safetensors file, or `latest` in --output_dir. Its own flags: --num_batches N (default 8),
--fp8_sqnr_threshold DB (default 20).

It prints, and writes to --output_dir (default reports/<model>-<dataset>-<date>-<time>) as
precision_report.json and gradient_histogram.png: the fp16/bf16 round-trip error of every parameter; what
fp16 does to the real gradients without and with loss scaling (flushed to zero, subnormal, overflow),
with the lesson's 1e-6 ... 1e-9 demonstration on the model's own gradient values; the model under fp16
and bf16 autocast against fp32; activations that overflow fp16, layer by layer; fp8 readiness per Linear
layer (E4M3 / E5M2 with tensorwise, delayed and rowwise scaling: simulated fp8 numerics, not fp8 speed),
with the layers to keep out of fp8 as --fp32_modules and as fp8_accelerate_config.yaml; memory for fp32,
fp16, bf16 and int8; and a verdict: bf16 is safe / fp16 with --init_scale X / keep these layers in fp32:
--fp32_modules ... (the flag recipes/train.py takes).
"""
from __future__ import annotations

import sys

from mixprec.devices import threads

threads.quiet_waiting()  # as recipes/train.py: before torch loads, idle OpenMP threads sleep instead of spinning

import torch  # noqa: E402

from mixprec import doctor, precision
from mixprec.devices import hardware  # noqa: E402
from mixprec.run_folder.checkpointing import write_atomic  # noqa: E402
from mixprec.run_folder import run_loading as inputs  # noqa: E402
from mixprec.doctor import fp8, render  # noqa: E402
from mixprec.errors import exit_on_usage_error  # noqa: E402
from mixprec.evaluation import loss_fn  # noqa: E402  # the recipe's own loss: the report judges what training computes


@exit_on_usage_error
def main(argv: list[str] | None = None) -> dict:
    cfg, own, weights, settings_from = inputs.parse(sys.argv[1:] if argv is None else argv, __doc__)
    device, model, batches = inputs.prepare(cfg, weights, own.num_batches)
    out = inputs.output_dir(cfg)
    meta = {"model": cfg.model, "model_args": cfg.model_args, "dataset": cfg.dataset, "settings_from": settings_from,
            "weights": inputs.weights_label(cfg, cfg.seed, weights),
            "num_parameters": sum(p.numel() for p in model.parameters()), "num_batches": len(batches),
            "batch_size": cfg.batch_size, "chosen_loss_scale": cfg.init_scale, "device": hardware.device_name(device),
            "torch": torch.__version__}

    report = {"meta": meta, **doctor.analyze(model, batches, loss_fn, device, cfg.init_scale,
                                             precision.native_bf16(device.type), fp8_threshold=own.fp8_sqnr_threshold)}
    report["fp8"].update(fp8.ready_to_run(cfg, report["fp8"], out / fp8.CONFIG_FILE))
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "precision_report.json", out / "gradient_histogram.png"]
    render.write_json(report, written[0])
    render.plot(report, written[1])
    if "accelerate_config" in report["fp8"]:
        written.append(out / fp8.CONFIG_FILE)
        write_atomic(written[-1], report["fp8"]["accelerate_config"])
    print(render.console(report))
    if cfg.fp32_modules:  # never silent: the report judges every layer as autocast runs it
        print(f"\nnot applied here: fp32_modules {','.join(cfg.fp32_modules)} (the report judges every layer as autocast "
              f"runs it; its verdict says which to keep in fp32; recipes/precision_diff.py applies them)")
    print(f"\nwrote {', '.join(map(str, written))}")
    return report


if __name__ == "__main__":
    main()
