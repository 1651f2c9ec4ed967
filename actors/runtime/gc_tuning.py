"""Cyclic garbage collector settings for a busy host: an explicit opt-in.

A streaming host allocates a handful of short-lived objects per model event (the chunk,
the decoded event, the partial output, the batch lists). CPython's cyclic collector starts
a young collection every 700 net allocations and, every 100 of those, a full one that
visits every live tracked object of the process: with a thousand sessions open, each full
collection walks their histories and the imported libraries' objects again, and at a
thousand concurrent streams the collector ends up a large share of the client's CPU.

:func:`tuned_gc` (``Host.open(gc_tuning=True)``; ``greenroom serve``, where it is on unless
``--no-gc-tuning``: a process greenroom owns) raises the thresholds to :data:`GC_THRESHOLDS`
while the host is open and restores the process's previous thresholds when the last tuned
host closes. The trade-off is memory: garbage
that is part of a reference cycle lives until the next young collection, up to
``GC_THRESHOLDS[0]`` net allocations later, so a process's peak may grow by some
megabytes. Objects without cycles are freed by reference counting as before. A host
opened by a library user never changes these settings unless asked to: they are
process-wide.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

GC_THRESHOLDS = (50_000, 20, 100)
"""Young-generation threshold in net allocations, then how many young collections per
middle one and middle ones per full one. CPython's defaults are (700, 10, 10)."""

_tuned_hosts = 0
_saved: tuple[int, int, int] | None = None


@contextmanager
def tuned_gc(enabled: bool = True) -> Iterator[None]:
    """While inside (and ``enabled``), the collector runs with :data:`GC_THRESHOLDS`.
    Nested and concurrent uses share one saved setting: the first to enter saves the
    process's thresholds, the last to leave restores them."""
    global _tuned_hosts, _saved
    if not enabled:
        yield
        return
    if _tuned_hosts == 0:
        _saved = gc.get_threshold()
        gc.set_threshold(*GC_THRESHOLDS)
    _tuned_hosts += 1
    try:
        yield
    finally:
        _tuned_hosts -= 1
        if _tuned_hosts == 0 and _saved is not None:
            gc.set_threshold(*_saved)
            _saved = None


__all__ = ["GC_THRESHOLDS", "tuned_gc"]
