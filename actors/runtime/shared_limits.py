"""Limits that several hosts hold together: the seam a cluster plugs into a host
(R-SHARE-1, R-SHARE-4 across hosts).

A host alone admits its requests at its own admission points
(:mod:`~greenroom.actors.runtime.admission`) and counts its principals' spending from its
own ledger (:mod:`~greenroom.actors.runtime.accounting`). Hosts that share a
:class:`SharedLimits` — a cluster's, made by :func:`greenroom.actors.cluster.open_cluster_host`
— admit every request to one endpoint and credential at one point for all of them, and
count a principal's spending over all of them. ``Host.open(shared=…)`` takes it; without
it nothing of a single host changes.
"""

from __future__ import annotations

from typing import Protocol

from greenroom.actors.runtime.accounting import SharedSpending
from greenroom.actors.runtime.admission import SharedEndpoints

__all__ = ["SharedLimits"]


class SharedLimits(SharedEndpoints, SharedSpending, Protocol):
    """The endpoints' admission (:class:`~greenroom.actors.runtime.admission.
    SharedEndpoints`) and the principals' spending (:class:`~greenroom.actors.runtime.
    accounting.SharedSpending`) of hosts that hold their limits together."""
