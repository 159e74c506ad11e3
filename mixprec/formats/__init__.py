"""Number formats and their rounding, below everything that uses them (training, the precision report, the
precision diff):

- simulate: bf16 / fp16 / fp8 numerics with fp32 kernels (for CPUs without native 16-bit arithmetic);
- fp8: float8 E4M3 / E5M2 round trips with tensorwise, delayed and rowwise scaling; which Linear layers
  Accelerate's fp8 backend converts.
"""
