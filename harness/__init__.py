"""specbench-harness: benchmark speculative decoding draft models, exactly and honestly."""

__version__ = "0.1.0"
