"""mixprec: mixed-precision training recipes with Hugging Face Accelerate.

The recipes live in recipes/ (train.py is the loop); this package holds everything else, one module per
concern. Importing it imports nothing heavy: `mixprec.config` answers --help and bad flags before torch loads.
"""
