"""Numerics tools: what a precision does to each module of a model, and per-module precision in training.

- policy: `--fp32_modules` (globs over module names): those modules compute in fp32 under fp16/bf16/fp8;
- simulate: bf16 / fp16 autocast numerics with fp32 kernels (for CPUs without native 16-bit arithmetic);
- fp8: float8 E4M3 / E5M2 round trips with tensorwise, delayed and rowwise scaling; fp8 Linear layers;
- diff: two precisions from the same weights on the same batches, module by module (recipes/precision_diff.py);
- render: the diff as JSON, Markdown, a PNG and a console table.
Only `policy` and `simulate` load with training; the rest loads when a tool asks for it.
"""
