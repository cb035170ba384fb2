"""The systems ``gpu_serve.py`` deploys, by name: the fixed ones, and any point of HAS's space.

Names (``--systems``):

- ``easerve``, ``easerve-own-process``, ``dynamo-style``, ``aggregated``: the fixed systems of
  ``SYSTEMS`` (``gpu_serve.py``'s docstring says what each runs).
- ``aggregated@TOKENS``: the aggregated baseline at that token budget (its sweep).
- ``easerve:ALLOC:bB:sS[:cpu]``: EAServe at one point (allocation, B, s) of HAS's space
  (``easerve_operator.tuning.space``), e.g. ``easerve:e1p1d1:b4:s0.5``. Everything else is the
  ``easerve`` system's (Poisson-gap dispatch, 50 ms max age, GPU preprocessing, as every run up to
  13 served it, or ``:cpu``: ``spec.encode.preprocessing: cpu``); B, s and the SM split are set by
  HAS's own ``space.apply_candidate`` (``System.candidate``).
- ``dynamo-style:ALLOC``: the Dynamo-style baseline on another allocation (its allocation
  sweep), e.g. ``dynamo-style:e1p2d1``; B = 1 eager, s = 1, no split, CPU preprocessing.
- ``...+mpsNN`` after an ``easerve`` or ``dynamo-style`` name: the same system under an MPS daemon
  of its own, its encode and prefill processes capped at NN % of the SMs
  (``EASERVE_MPS_SHARES``), decode uncapped; e.g. ``easerve:e1p0d1:b6:s0+mps70``. Not for
  ``aggregated``: one process per GPU has nothing to share the GPU with.

``ALLOC`` reads ``e<N>p<N>d<N>``: encode, prefill and decode workers, with ``tp<K>`` after the
prefill or decode count for a tensor-parallel pool (``e2p1tp2d1tp4``). ``gpuBudget`` is what the
allocation spans; on a host with fewer GPUs they wrap (``Topology.placed``), so on one H200 the
budget is a free parameter: every pod time-slices that one GPU.

Each point has ONE spelling (``s0.5``, not ``s0.50``; ``p1``, not ``p1tp1``): results are keyed
by name, and two spellings of one configuration would split its points. A bad name is refused
with a message that names the part that is wrong; what the spec model thinks of a name's spec
(e.g. TP 2 on the torch engine) is checked by ``gpu_serve.py`` before any GPU time is spent.
An allocation is HAS's own ``space.Alloc``, so a candidate and its name convert both ways.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from easerve_operator.tuning.space import Alloc, Candidate
from easerve_runtime.engines.kv_ipc import ENV as KV_IPC_ENV
from easerve_runtime.workers.launcher import MPS_SHARES_ENV

MPS_CAPPED = ("encode", "local-prefill", "prefill")
"""The stages ``+mpsNN`` caps: everything but decode (and the frontend, which runs no kernels)."""

SYSTEMS: dict[str, dict[str, Any]] = {
    "easerve": {
        "allocation": {"encode": {"replicas": 1}, "prefill": {"replicas": 0}, "decode": {"replicas": 1}},
        "encode": {"batchBound": 8, "dispatch": "poisson-gap", "maxAgeMs": 50, "preprocessing": "gpu"},
        "offload": {"ratio": 0.0},
        "smPartition": {"mode": "dynamic", "backend": "green-context"},
        "env": {},
    },
    "dynamo-style": {
        "allocation": {"encode": {"replicas": 1}, "prefill": {"replicas": 1}, "decode": {"replicas": 1}},
        "encode": {"batchBound": 1, "dispatch": "eager", "preprocessing": "cpu"},
        "offload": {"ratio": 1.0},
        "smPartition": {"mode": "none"},
        "env": {},
    },
    "aggregated": {"mode": "aggregated", "env": {}},
}
SYSTEMS["easerve-own-process"] = {  # easerve with its local prefill in a process of its own (the layout
    # before the one-process encode + local prefill): the A/B of spec.smPartition.localPrefill
    **SYSTEMS["easerve"],
    "smPartition": {**SYSTEMS["easerve"]["smPartition"], "localPrefill": "own-process"},
}

POINT_SYSTEMS = ("easerve", "dynamo-style")
"""The systems that take ``:ALLOC`` (EAServe also ``:bB:sS``): the ones HAS's space parametrises."""

_ALLOC = re.compile(r"e(\d+)p(\d+)(?:tp(\d+))?d(\d+)(?:tp(\d+))?")
_ALLOC_HELP = ("the allocation reads e<N>p<N>d<N>, with tp<K> after the prefill or decode count for a "
               "tensor-parallel pool (e.g. e1p1d1, e2p0d1, e1p1tp2d1)")


def token(a: Alloc) -> str:
    """The ``ALLOC`` part of a name for allocation ``a`` (its one spelling)."""
    def tp(k: int) -> str:
        return f"tp{k}" if k != 1 else ""

    return f"e{a.encode}p{a.prefill}{tp(a.prefill_tp)}d{a.decode}{tp(a.decode_tp)}"


@dataclass(frozen=True)
class System:
    """A parsed system name: a base of ``SYSTEMS`` and what the name configures on top of it."""

    base: str
    tokens: int | None = None
    """``aggregated@TOKENS``: the token budget."""
    layout: Alloc | None = None
    """``easerve:`` / ``dynamo-style:``: the allocation, as HAS's space holds it."""
    batch_bound: int | None = None
    offload: float | None = None
    preprocessing: str | None = None
    """``easerve:`` points: ``spec.encode.preprocessing`` when it is not the base's (``:cpu``)."""
    mps: int | None = None
    """``+mpsNN``: under MPS, the encode and prefill processes' SM cap in percent."""
    kv_ipc: bool | None = None
    """The KV handoff between processes on one GPU (``engines.kv_ipc``): None, the runtime's default
    (CUDA IPC since run 28); ``+kvipc`` True (``EASERVE_KV_IPC=1``, as run 28 named it); ``+hostkv``
    False (``EASERVE_KV_IPC=0``: through host memory, as every run before 28 served it)."""
    max_queued: int | None = None
    """``+qNN``: the frontend's admission bound fixed at NN (``spec.limits.maxQueuedRequests``); None:
    sized from the profile's capacity (``policies.admission``). Past saturation that bound decides
    how long an admitted request waits for its first token (run 31)."""

    @property
    def name(self) -> str:
        """The one spelling of this system (``parse(s.name) == s``)."""
        return (self._name + (f"+mps{self.mps}" if self.mps is not None else "")
                + {None: "", True: "+kvipc", False: "+hostkv"}[self.kv_ipc]
                + (f"+q{self.max_queued}" if self.max_queued is not None else ""))

    @property
    def _name(self) -> str:
        if self.tokens is not None:
            return f"{self.base}@{self.tokens}"
        if self.layout is None:
            return self.base
        if self.base == "dynamo-style":
            return f"{self.base}:{token(self.layout)}"
        tail = f":{self.preprocessing}" if self.preprocessing else ""
        return f"{self.base}:{token(self.layout)}:b{self.batch_bound}:s{_s(self.offload or 0.0)}{tail}"

    @property
    def env(self) -> dict[str, str]:
        env = dict(SYSTEMS[self.base]["env"])
        if self.mps is not None:
            env[MPS_SHARES_ENV] = ",".join(f"{st}={self.mps}" for st in MPS_CAPPED)
        if self.kv_ipc is not None:
            env[KV_IPC_ENV] = "1" if self.kv_ipc else "0"
        return env

    @property
    def preprocess(self) -> str:
        """Where this system's encoder preprocesses (``spec.encode.preprocessing``): the name's, else
        its base's, else the spec's default (the aggregated worker's encoder: the GPU)."""
        return self.preprocessing or SYSTEMS[self.base].get("encode", {}).get("preprocessing", "gpu")

    @property
    def cpu_preprocessing(self) -> bool:
        """Image decode and processor on the CPU (the Dynamo-style encode, or ``:cpu``): the twin
        then times encode with the CPU-preprocessing profile's points."""
        return self.preprocess == "cpu"

    @property
    def slug(self) -> str:
        """The name as a file and Kubernetes name part (lowercase letters, digits and dashes)."""
        return self.name.replace("@", "-tb").replace(":", "-").replace(".", "p").replace("+", "-")

    def placement(self, token_budget: int, gpus: int) -> dict[str, Any]:
        """The spec fields that make this system (beside model, engine, decode, SLO, discovery)."""
        s = SYSTEMS[self.base]
        if s.get("mode") == "aggregated":  # no E/P/D knobs: the aggregated mode refuses them
            return {"mode": "aggregated", "aggregated": {"tokenBudget": self.tokens or token_budget}, "gpuBudget": gpus}
        out = {
            "gpuBudget": sum(v["replicas"] for v in s["allocation"].values()),
            "allocation": s["allocation"],
            "encode": {**s["encode"], "preprocessing": self.preprocess},
            "offload": s["offload"],
            "smPartition": s["smPartition"],
        }
        if self.layout is not None:
            out.update(gpuBudget=self.layout.gpus, allocation=self.layout.allocation().wire())
        if self.max_queued is not None:
            out["limits"] = {"maxQueuedRequests": self.max_queued}
        return out

    @property
    def candidate(self) -> Candidate | None:
        """An ``easerve:`` point as HAS's candidate: ``gpu_serve.spec_doc`` applies it with HAS's own
        ``space.apply_candidate`` (B, s and what s implies for the SM split), not a copy of that rule."""
        if self.layout is None or self.batch_bound is None or self.offload is None:
            return None
        return Candidate(self.layout, self.batch_bound, self.offload)


def _s(s: float) -> str:
    return f"{round(float(s), 6):g}"


def _refuse(system: str, why: str) -> ValueError:
    return ValueError(f"--systems: {system!r}: {why}")


def point(base: str, layout: Alloc, batch_bound: int | None = None, offload: float | None = None,
          preprocessing: str | None = None) -> System:
    """The system that deploys ``layout`` (and, for ``easerve``, B, s and, when not the base's, the
    preprocessing); checked as a parsed name is."""
    if preprocessing == SYSTEMS[base].get("encode", {}).get("preprocessing"):
        preprocessing = None
    return parse(System(base, None, layout, batch_bound, offload, preprocessing).name)


def parse(system: str) -> System:
    """``system`` as a ``System``; a ``ValueError`` naming the wrong part for a name it refuses."""
    head, plus, tail = system.rpartition("+")
    if plus:
        inner = parse(head)
        if inner.base not in POINT_SYSTEMS:
            raise _refuse(system, f"{inner.base} runs one process per GPU: +{tail} has nothing to change")
        q = re.fullmatch(r"q(\d+)", tail)
        if q is not None:
            if inner.max_queued is not None or int(q.group(1)) < 1 or str(int(q.group(1))) != q.group(1):
                raise _refuse(system, "+qNN (the admission bound, NN >= 1) comes once, last")
            return replace(inner, max_queued=int(q.group(1)))
        if inner.max_queued is not None:
            raise _refuse(system, "+qNN comes last")
        if tail in ("kvipc", "hostkv"):
            if inner.kv_ipc is not None:
                raise _refuse(system, "the KV path (+kvipc or +hostkv) is named twice")
            return replace(inner, kv_ipc=tail == "kvipc")
        m = re.fullmatch(r"mps(\d+)", tail)
        if m is None or not 1 <= int(m.group(1)) <= 100 or str(int(m.group(1))) != m.group(1):
            raise _refuse(system, f"{tail!r}: a part after + is mpsNN, NN the encode and prefill SM cap in "
                                  "percent (1-100), kvipc, hostkv or qNN")
        if inner.mps is not None or inner.kv_ipc is not None:
            raise _refuse(system, "+mpsNN comes once, before +kvipc or +hostkv")
        return replace(inner, mps=int(m.group(1)))
    base, at, tokens = system.partition("@")
    base, colon, rest = base.partition(":")
    if base not in SYSTEMS:
        raise ValueError(f"--systems: {base!r} is not one of {', '.join(SYSTEMS)}")
    if at:
        if colon or SYSTEMS[base].get("mode") != "aggregated":
            raise _refuse(system, "only aggregated takes @TOKENS (its token budget)")
        if not tokens.isdigit() or int(tokens) < 1 or str(int(tokens)) != tokens:
            raise _refuse(system, f"{tokens!r}: the token budget after @ must be a positive integer")
        return System(base, tokens=int(tokens))
    if not colon:
        return System(base)
    if base not in POINT_SYSTEMS:
        raise _refuse(system, f"{base} has no configurations to name: only {' and '.join(POINT_SYSTEMS)} take :ALLOC")
    parts = rest.split(":")
    want = 3 if base == "easerve" else 1
    pre = None
    if base == "easerve" and len(parts) == 4:
        if parts[3] != "cpu":
            raise _refuse(system, f"{parts[3]!r}: the one part after :sS is ':cpu' (CPU preprocessing; GPU is the default)")
        pre = parts.pop()
    if len(parts) != want:
        form = "easerve:ALLOC:bB:sS (e.g. easerve:e1p1d1:b4:s0.5)" if want == 3 else "dynamo-style:ALLOC (e.g. dynamo-style:e1p2d1)"
        raise _refuse(system, f"expected {form}: {want} part(s) after {base}:, got {len(parts)}")
    layout = _layout(system, parts[0])
    if base == "dynamo-style":
        if layout.prefill < 1:
            raise _refuse(system, f"{parts[0]!r}: the Dynamo-style baseline prefills remotely (s = 1): "
                                  "it needs a prefill worker (p1 or more)")
        return System(base, layout=layout)
    b, s = _batch(system, parts[1]), _offload(system, parts[2])
    if layout.prefill == 0 and s != 0.0:
        raise _refuse(system, f"{parts[2]!r}: with no prefill worker (p0) every prefill is local: s must be 0")
    return System(base, layout=layout, batch_bound=b, offload=s, preprocessing=pre)


def _layout(system: str, part: str) -> Alloc:
    m = _ALLOC.fullmatch(part)
    if m is None:
        raise _refuse(system, f"{part!r}: {_ALLOC_HELP}")
    e, p, ptp, d, dtp = (int(g) if g is not None else 1 for g in m.groups())
    if e < 1:
        raise _refuse(system, f"{part!r}: at least one encode worker (e1 or more)")
    if d < 1:
        raise _refuse(system, f"{part!r}: at least one decode worker (d1 or more)")
    if ptp < 1 or dtp < 1:
        raise _refuse(system, f"{part!r}: a tensor-parallel degree tp<K> must be 1 or more")
    layout = Alloc(e, p, ptp, d, dtp)
    if token(layout) != part:
        raise _refuse(system, f"{part!r}: write {token(layout)!r} (one spelling per allocation)")
    return layout


def _batch(system: str, part: str) -> int:
    if not re.fullmatch(r"b[1-9]\d*", part):
        raise _refuse(system, f"{part!r}: the encode batch bound reads b<B>, B an integer >= 1 (e.g. b4)")
    return int(part[1:])


def _offload(system: str, part: str) -> float:
    try:
        s = float(part[1:]) if part.startswith("s") else None
    except ValueError:
        s = None
    if s is None or not 0.0 <= s <= 1.0:
        raise _refuse(system, f"{part!r}: the offload ratio reads s<S>, 0 <= S <= 1 (e.g. s0.5)")
    if f"s{_s(s)}" != part:
        raise _refuse(system, f"{part!r}: write 's{_s(s)}' (one spelling per offload ratio)")
    return round(s, 6)


def base_of(system: str) -> str:
    """The base of a name without checking it (names in old result files may predate the grammar)."""
    return re.split(r"[@:]", system, maxsplit=1)[0]

