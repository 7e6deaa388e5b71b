"""rltrain's benchmark suite: ``python -m benchmarks`` (see benchmarks/cli.py and RESULTS.md)."""
