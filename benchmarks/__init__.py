"""Benchmarks of our strategies against their Lightning/torch anchors (run: ``python -m benchmarks.run_all``)."""
