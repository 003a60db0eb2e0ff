"""Benchmarks: ratios measured side by side in one run (`python -m benchmarks.run --quick`)."""
