"""Benchmarks: each measures a kvtier path against a peer (or a limit) run in the same process
and returns the figures and their ratio as a JSON-ready dict."""
