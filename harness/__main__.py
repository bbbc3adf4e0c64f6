"""`python -m harness`: one cell, or a sweep with -m (harness.cli.main)."""

from harness.cli.main import cli

cli()
