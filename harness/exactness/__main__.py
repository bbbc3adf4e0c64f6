"""`python -m harness.exactness`: the statistical check of the output law."""

from harness.exactness.main import cli

cli()
