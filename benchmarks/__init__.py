"""Benchmarks of lightning_parallel's strategies against their Lightning/torch anchors (``python -m benchmarks.run_all``)."""
