"""`python -m harness.bench`: our loop against HF generate() on the same pair."""

from harness.bench.main import cli

cli()
