"""Benchmarks: each prints a table and writes JSON, every figure a ratio to a baseline
measured in the same run (``dscache bench store``, ``dscache bench ttft``)."""
