"""After encode: route each request (remote or local prefill), pick the remote, group per destination.

One object per encode worker decides for the live encode worker (``workers/encode.py``) and the
twin's (``sim/stages.py``). For a finished micro-batch, in request order:

1. the deficit router (``spec.offload.ratio``) says REMOTE or LOCAL (an encode worker without a
   local prefill worker sends everything remote);
2. a REMOTE request goes to the remote prefill instance with the fewest requests *this encode
   worker* has sent it and not yet seen prefilled, counting the ones already assigned in this
   micro-batch (ties rotate, ``LeastOutstanding``);
3. requests are grouped per destination, in order, so the caller sends ONE envelope each.

Load accounting is per encode worker and ends at the request's first token (prefill done), because
that is what a live encode worker can observe without asking anyone: it sees the first token go by
on the envelope's stream. Counting until the request finishes (decode included) would balance
prefill on decode's backlog; counting across all encode workers would need shared state the pods
do not have. The caller reports ``prefilled(dest)`` when a request's prefill ends (first token,
or an error before it).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from easerve_runtime.policies.router import DeficitRouter, LeastOutstanding, Route

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

LOCAL = "local"
"""The destination key of the local prefill worker (on this encode GPU)."""


@dataclass
class RoutingPlan(Generic[T, K]):
    """Where a micro-batch's requests go.

    ``groups``: destination (a remote key, or :data:`LOCAL`) -> its requests, in batch order and in
    first-use order of the destinations; ``unroutable``: REMOTE requests with no remote candidate.
    """

    groups: dict[K | str, list[T]] = field(default_factory=dict)
    unroutable: list[T] = field(default_factory=list)


class PostEncodeRouter(Generic[K]):
    """Deficit REMOTE/LOCAL split, least-outstanding remote pick, grouping per destination."""

    def __init__(self, ratio: float, has_local: bool) -> None:
        if not has_local and ratio < 1.0:
            raise ValueError(
                f"spec.offload.ratio is {ratio} but this encode worker has no local prefill worker"
            )
        self.has_local = has_local
        self.deficit = DeficitRouter(ratio if has_local else 1.0)
        self.outstanding: dict[K, int] = {}
        self._picker = LeastOutstanding()
        self.remote_count = 0
        self.local_count = 0

    def route(self, items: Sequence[T], remotes: Sequence[K]) -> RoutingPlan[T, K]:
        """Route a finished micro-batch ``items`` among the live remote prefill ``remotes``."""
        plan: RoutingPlan[T, K] = RoutingPlan()
        for item in items:
            if self.deficit.decide() == Route.LOCAL:
                self.local_count += 1
                plan.groups.setdefault(LOCAL, []).append(item)
                continue
            if not remotes:
                plan.unroutable.append(item)
                continue
            dest = self._picker.pick(remotes, self.outstanding)
            self.outstanding[dest] = self.outstanding.get(dest, 0) + 1
            self.remote_count += 1
            plan.groups.setdefault(dest, []).append(item)
        return plan

    def prefilled(self, dest: K | str, n: int = 1) -> None:
        """``n`` requests sent to ``dest`` finished prefill (or failed before it)."""
        if dest == LOCAL:
            return
        key: K = dest  # type: ignore[assignment]
        left = self.outstanding.get(key, 0) - n
        if left > 0:
            self.outstanding[key] = left
        else:
            self.outstanding.pop(key, None)

    @property
    def ratio(self) -> float:
        return self.deficit.ratio
