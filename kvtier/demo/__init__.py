"""``kvtier demo``: the multi-turn chat workload through every tier (``run``), its summary table
(``table``) and the content oracle that compares cached runs with cold ones (``oracle``)."""
