"""Context parallelism: page owners and lanes (layout), per-rank node metadata (meta),
owner-preserving allocation (alloc) and MIN-reduced agreement over ranks (group, acks)."""
