"""Subprocess harnesses for tests and benchmarks: a real `titan serve` / `titan router` on a free local
port. Not part of the installed package; tests reach it through pytest's `pythonpath`, benchmarks
through benchmarks/common.py."""
