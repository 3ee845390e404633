"""The benchmarks: run each from the repository root as a module, ``python -m bench.bench_match
--quick``; what they share is in :mod:`bench.fixtures`."""
