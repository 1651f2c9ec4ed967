"""greenroom.protocols: pure typed data and sans-IO logic; no I/O, no trio."""
