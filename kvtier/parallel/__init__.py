"""Context parallelism: page owners and lanes (layout), per-rank node metadata (meta), the
owner-preserving check (alloc), MIN-reduced decisions over ranks (group) and per-page
readiness of fetches (acks)."""
