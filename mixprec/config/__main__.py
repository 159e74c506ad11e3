"""`python -m mixprec.config > docs/configuration.md`: the settings' reference."""
from . import reference_markdown

print(reference_markdown(), end="")
