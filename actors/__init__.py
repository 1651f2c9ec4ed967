"""greenroom.actors: the actor tree (I/O and concurrency)."""
