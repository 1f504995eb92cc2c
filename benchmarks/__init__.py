"""Side-by-side performance runs of lighthouse-config (``python -m benchmarks.run``); see README.md."""
