"""KV events: what each tier of a cache stores and drops, as page hashes any process can
compute from token ids (``hashing``), published for routers and other consumers."""
