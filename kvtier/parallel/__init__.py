"""Context-parallel layout and collectives: owner pages, per-rank acknowledgements and
MIN-reduced agreement, so every rank makes the same tree decisions."""
