"""A session's history as its trace records it, rewinds applied (R-FORK-2; pure).

A ``rewind`` record says: the history is again what it was at ``to_seq``. The records
between ``to_seq`` and the rewind stay in the trace — nothing recorded is ever erased —
but they are cut from the history: the model context (:func:`~greenroom.protocols.
transcript.rebuild`) and the task state (:func:`~greenroom.protocols.task.fold`) are
folded from :func:`live_records`, never from the raw records.

Invariants:

* a rewind cuts only records before it (``to_seq`` < its own ``seq``), and only those
  still live: the live records after a rewind are the live records at ``to_seq``, then the
  rewind itself;
* a record is live or cut for good: a later rewind never brings back what an earlier one
  cut (fork at such a seq to go back to it: R-FORK-1).

A trace file is one model context (R-COMPACT-8): a successful ``compaction_end`` starts
the next. A rewind to a record of an earlier context starts the next file too, as its first
record: that file's context is the one the session had at ``to_seq``, which
:func:`context_at` folds from the session's whole trace.
"""

from __future__ import annotations

from collections.abc import Sequence

from greenroom.protocols.outputs import CompactionEnd, Output, Rewind

__all__ = ["context_at", "cut_by", "live_records"]


def live_records(records: Sequence[Output]) -> list[Output]:
    """``records`` (a trace, in ``seq`` order) without those a later ``rewind`` cut; the
    rewinds themselves stay (they are facts of the history). Without a rewind, a copy of
    ``records``."""
    if not any(isinstance(r, Rewind) for r in records):
        return list(records)
    live: list[Output] = []
    for record in records:
        if isinstance(record, Rewind):
            to_seq = record.to_seq
            live = [r for r in live if (r.seq or 0) <= to_seq]
        live.append(record)
    return live


def cut_by(records: Sequence[Output], seq: int) -> Rewind | None:
    """The rewind that cut the record ``seq`` from the history of ``records``, or None
    when that record is live (or not among them)."""
    for record in records:
        if isinstance(record, Rewind) and record.to_seq < seq < (record.seq or 0):
            # Only a cut of a record still live counts: an earlier rewind may have cut it.
            earlier = [r for r in records if (r.seq or 0) < (record.seq or 0)]
            if any(r.seq == seq for r in live_records(earlier)):
                return record
    return None


def context_at(records: Sequence[Output], seq: int | None = None) -> list[Output]:
    """The records of the model context the session had at record ``seq`` (None: its
    last), from ``records``, the session's trace across its files in ``seq`` order: the
    records since the last successful compaction, or since the last rewind (then the
    context it went back to, and the rewind), without what a rewind cut."""
    context: list[Output] = []
    for record in records:
        if seq is not None and (record.seq or 0) > seq:
            break
        if isinstance(record, CompactionEnd) and record.status == "ok":
            context = [record]
        elif isinstance(record, Rewind):
            context = [*context_at(records, record.to_seq), record]
        else:
            context.append(record)
    return context
