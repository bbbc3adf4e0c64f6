"""`python -m harness.distill`: train the embedded shared-weights draft."""

from harness.distill.main import cli

cli()
