"""The precision diff: what a precision does to each module of a model (the number formats it simulates are
in mixprec.formats, the `--fp32_modules` policy it applies in mixprec.precision.policy).

- diff: two precisions from the same weights on the same batches, module by module (recipes/precision_diff.py);
- render: the diff as JSON, Markdown, a PNG and a console table.
Nothing here loads with training.
"""
