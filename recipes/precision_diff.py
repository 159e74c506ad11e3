#!/usr/bin/env python
"""Precision diff: two precisions from the same initial weights on the same batches, module by module.

    python recipes/precision_diff.py --config recipes/configs/gpt_small.yaml --compare no,bf16
    python recipes/precision_diff.py --compare no,fp16 --fp32_modules net.2 --resume_from_checkpoint runs/NAME
    python recipes/precision_diff.py --config recipes/configs/gpt_tiny.yaml --compare bf16,fp8 --steps 5

It takes recipes/train.py's flags (--config, --model, --model_args, --dataset, --batch_size, --lr, --seed,
--init_scale, --fp32_modules, ...; --resume_from_checkpoint loads weights as the precision report does) and
its own:
    --compare A,B        two of no (fp32), fp16, bf16, fp8; A is the reference (default: no,bf16)
    --steps K            optimizer steps, one batch each (default: 3)
    --simulate MODE      auto (default): bf16/fp16 simulated where the CPU has no native support (matmul
                         inputs rounded to 16 bits, fp32 accumulation), real autocast elsewhere, GPUs
                         included; always; never (real autocast: slow where the CPU emulates it)
    --fp8_recipe R       fp8 (always simulated): tensorwise (default; torchao's default, TransformerEngine's
                         current scaling) or rowwise scales
Both runs train K steps as train.py would (AdamW, schedule, clipping; fp16 with a GradScaler). For every
module that computes (Linear, convolutions, embeddings, norms, attention, the output, the loss) it reports
the relative error and SQNR of its forward output and of its parameters' gradients against A, the error the
module introduces alone (which ranks them), the loss per step and the weight divergence after K steps.
--fp32_modules applies to both runs. Writes diff.json, diff.md (worst modules first) and diff.png to
--output_dir (default reports/diff-<model>-<dataset>-<date>-<time>) and prints the table.
"""
from __future__ import annotations

import sys

from mixprec.devices import threads
from mixprec.errors import exit_on_usage_error
from mixprec.numerics import cli


@exit_on_usage_error
def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    threads.quiet_waiting()  # before torch loads: idle OpenMP threads sleep instead of spinning, as in train.py
    cfg, own, weights, source = cli.parse(argv, __doc__)  # --help and bad flags answer before torch loads
    result, out = cli.run(cfg, own, weights, source, argv)
    paths = cli.write(result, out)
    from mixprec.numerics import render

    print(render.console(result))
    print(f"\nwrote {', '.join(map(str, paths))}")
    return result


if __name__ == "__main__":
    main()
