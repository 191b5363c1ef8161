"""OpenAI-compatible HTTP server over the reference engine (``kvtier serve``): routes, the
engine thread, request validation, the Prometheus exporter. Needs the ``server`` extra."""
