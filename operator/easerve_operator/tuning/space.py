"""The discretised configuration space that every search method shares.

A configuration is ``(allocation, B, s)``. HAS, Random and Coordinate all search the SAME
space (so their comparison is about search, not about what they may pick), and the exhaustive
evaluation in ``benchmarks/has_convergence.py`` enumerates it point by point:

- allocations: encode workers at TP 1; prefill and decode TP from {1, 2, 4, 8} where the model
  fits (``min_tp``); at least one encode and one decode worker; at least one remote prefill
  worker, except in the all-local allocations (below); by default only allocations that use
  the whole GPU budget (a leftover GPU is never worse as one more encode worker, which also
  hosts one more local prefill worker);
- all-local allocations: prefill replicas 0, when local prefill is allowed and the encode GPUs
  host at least one local prefill worker (one spans ``local_tp`` encode GPUs, the backbone's
  TP). Every prefill then runs on the encode GPUs. On one or two GPUs this is the only layout
  there is (E1 P0 D1), and at larger budgets it trades the remote prefill pool's GPUs for more
  encode and decode workers. Their prefill TP is the smallest feasible one: no worker runs at
  it, but Stage 1 scales local capacity from C_P at that TP (α's reference), and one canonical
  value keeps each layout in the space once. "Whole budget" for them means as many
  ``local_tp`` encode pods as fit (a leftover GPU cannot be an encode worker without a local
  prefill partner while s < 1);
- B: the integers 1..``max_batch``;
- s: multiples of ``s_step`` in [0, 1] when local prefill is allowed and the allocation has
  enough encode GPUs to host a local prefill worker, else only 1.0; only 0.0 for the all-local
  allocations (there is no remote prefill worker to offload to: the spec refuses s > 0 there).

``apply_candidate`` turns a point into a full ``EPDDeploymentSpec`` copied from the user's spec,
so a result can be written straight into ``status.tuning`` or a YAML file.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from easerve_runtime.api import (
    Allocation,
    EPDDeploymentSpec,
    OffloadSpec,
    PartitionMode,
    StageAllocation,
    cross_field_errors,
)

TP_OPTIONS: tuple[int, ...] = (1, 2, 4, 8)
DEFAULT_MAX_BATCH = 16
DEFAULT_S_STEP = 0.1


@dataclass(frozen=True, order=True)
class Alloc:
    """A GPU allocation across the three pools (hashable, orderable; encode is always TP 1)."""

    encode: int
    prefill: int
    prefill_tp: int
    decode: int
    decode_tp: int

    @property
    def gpus(self) -> int:
        return self.encode + self.prefill * self.prefill_tp + self.decode * self.decode_tp

    def allocation(self) -> Allocation:
        return Allocation(
            encode=StageAllocation(replicas=self.encode, tensor_parallel=1),
            prefill=StageAllocation(replicas=self.prefill, tensor_parallel=self.prefill_tp),
            decode=StageAllocation(replicas=self.decode, tensor_parallel=self.decode_tp),
        )

    @property
    def label(self) -> str:
        return self.allocation().label()

    @classmethod
    def from_allocation(cls, a: Allocation) -> Alloc:
        return cls(
            encode=a.encode.replicas,
            prefill=a.prefill.replicas,
            prefill_tp=a.prefill.tensor_parallel,
            decode=a.decode.replicas,
            decode_tp=a.decode.tensor_parallel,
        )

    def to_dict(self) -> dict[str, int]:
        return {
            "encode": self.encode,
            "prefill": self.prefill,
            "prefill_tp": self.prefill_tp,
            "decode": self.decode,
            "decode_tp": self.decode_tp,
        }

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> Alloc:
        return cls(**{k: int(d[k]) for k in ("encode", "prefill", "prefill_tp", "decode", "decode_tp")})


def round_s(s: float) -> float:
    """Canonical float for an offload ratio (grid arithmetic leaves 0.30000000000000004)."""
    return round(float(s), 6)


@dataclass(frozen=True, order=True)
class Candidate:
    """One point (allocation, B, s) of the space."""

    alloc: Alloc
    batch_bound: int
    offload_ratio: float

    def key(self) -> tuple[Alloc, int, float]:
        return (self.alloc, self.batch_bound, round_s(self.offload_ratio))

    def is_baseline(self) -> bool:
        """B = 1 and s = 1: no micro-batching and every prefill remote (Dynamo-style's mechanisms,
        ``stage2.fallback_candidate``'s first choice). The ranking prefers it in a tie
        (``selection.select_best``)."""
        return self.batch_bound == 1 and round_s(self.offload_ratio) == 1.0

    def to_dict(self) -> dict[str, object]:
        return {
            "allocation": self.alloc.label,
            "alloc": self.alloc.to_dict(),
            "batch_bound": self.batch_bound,
            "offload_ratio": round_s(self.offload_ratio),
        }


def feasible_tps(min_tp: int, options: tuple[int, ...] = TP_OPTIONS) -> tuple[int, ...]:
    """TP degrees at which the model fits (``min_tp`` from the profile's weight bytes)."""
    if min_tp < 1:
        raise ValueError(f"min_tp must be >= 1, got {min_tp}")
    return tuple(t for t in options if t >= min_tp)


def local_workers(encode: int, local_prefill: bool, local_tp: int) -> int:
    """Local prefill workers that ``encode`` encode GPUs host: one per encode pod of ``local_tp``
    GPUs when local prefill is allowed; none unless the pods divide evenly
    (``easerve_runtime.topology`` refuses leftovers). The one copy of this rule: the space's s
    grid, its all-local allocations and Stage 1's capacities all read it."""
    return encode // local_tp if local_prefill and encode % local_tp == 0 else 0


def enumerate_allocations(
    gpu_budget: int,
    min_tp: int,
    *,
    full_only: bool = True,
    tp_options: tuple[int, ...] = TP_OPTIONS,
    local_prefill: bool = False,
    local_tp: int = 1,
) -> list[Alloc]:
    """Every feasible allocation under ``gpu_budget`` (sorted, no duplicates; may be empty).

    ``full_only`` keeps allocations that use the whole budget; leftover GPUs always go to
    encode (TP 1), so every prefill/decode layout appears exactly once. With ``local_prefill``
    the all-local allocations (prefill replicas 0, encode in pods of ``local_tp``) are added too;
    see the module docstring.
    """
    if gpu_budget < 1:
        raise ValueError(f"gpu_budget must be >= 1, got {gpu_budget}")
    if local_tp < 1:
        raise ValueError(f"local_tp must be >= 1, got {local_tp}")
    tps = feasible_tps(min_tp, tp_options)
    out: set[Alloc] = set()
    for tp_d in tps:
        for n_d in range(1, gpu_budget // tp_d + 1):
            for tp_p in tps:
                for n_p in range(1, gpu_budget // tp_p + 1):
                    left = gpu_budget - n_p * tp_p - n_d * tp_d
                    if left < 1:
                        continue
                    encodes = [left] if full_only else range(1, left + 1)
                    for n_e in encodes:
                        out.add(Alloc(n_e, n_p, tp_p, n_d, tp_d))
            if not local_prefill:
                continue
            left = gpu_budget - n_d * tp_d
            hosts = [n for n in range(1, left + 1) if local_workers(n, local_prefill, local_tp) > 0]
            for n_e in hosts[-1:] if full_only else hosts:
                out.add(Alloc(n_e, 0, tps[0], n_d, tp_d))
    return sorted(out)


def s_grid(step: float, lo: float = 0.0, hi: float = 1.0) -> tuple[float, ...]:
    """Multiples of ``step`` inside [lo, hi] (inclusive, with float slack)."""
    if not 0 < step <= 1:
        raise ValueError(f"s_step must be in (0, 1], got {step}")
    k_lo = math.ceil(lo / step - 1e-9)
    k_hi = math.floor(hi / step + 1e-9)
    return tuple(round_s(min(1.0, k * step)) for k in range(max(0, k_lo), k_hi + 1) if k * step <= 1 + 1e-9)


def snap_s(s: float, step: float) -> float:
    """Nearest grid value to ``s`` in [0, 1]."""
    return round_s(min(1.0, max(0.0, round(s / step) * step)))


@dataclass(frozen=True)
class SearchSpace:
    """The shared discretised space (see module docstring)."""

    allocations: tuple[Alloc, ...]
    max_batch: int = DEFAULT_MAX_BATCH
    s_step: float = DEFAULT_S_STEP
    local_prefill: bool = True
    local_tp: int = 1

    def __post_init__(self) -> None:
        if self.local_tp < 1:
            raise ValueError(f"local_tp must be >= 1, got {self.local_tp}")
        if not self.allocations:
            raise ValueError("the search space has no feasible allocation")
        for a in self.allocations:
            if a.encode < 1 or a.decode < 1:
                raise ValueError(f"allocation {a.label}: at least one encode and one decode worker")
            if a.prefill == 0 and self.n_local(a) == 0:
                raise ValueError(
                    f"allocation {a.label} has no prefill worker at all: no remote prefill and no local "
                    f"prefill (local_prefill={self.local_prefill}, local_tp={self.local_tp})"
                )
        if not 1 <= self.max_batch <= 256:
            raise ValueError(f"max_batch must be in [1, 256], got {self.max_batch}")
        s_grid(self.s_step)

    def batch_values(self) -> tuple[int, ...]:
        return tuple(range(1, self.max_batch + 1))

    def n_local(self, a: Alloc) -> int:
        """Local prefill workers allocation ``a`` can host (``local_workers``)."""
        return local_workers(a.encode, self.local_prefill, self.local_tp)

    def s_values(self, a: Alloc | None = None) -> tuple[float, ...]:
        """The s grid (of allocation ``a``: only 1.0 when it cannot host local prefill, only 0.0
        when it has no remote prefill worker)."""
        if a is not None and a.prefill == 0:
            return (0.0,)
        if not self.local_prefill or (a is not None and self.n_local(a) == 0):
            return (1.0,)
        return s_grid(self.s_step)

    def nearest_s(self, a: Alloc, s: float) -> float:
        """``s`` if allocation ``a`` admits it, else the value of ``a``'s s grid nearest to it (the
        larger on a tie). A search moving to another allocation keeps its s where it can: 1.0 on
        an allocation without local prefill, 0.0 on an all-local one."""
        grid = self.s_values(a)
        s = round_s(s)
        return s if s in grid else min(grid, key=lambda v: (abs(v - s), -v))

    def points(self) -> Iterator[Candidate]:
        for a in self.allocations:
            for b in self.batch_values():
                for s in self.s_values(a):
                    yield Candidate(a, b, s)

    @property
    def size(self) -> int:
        return sum(len(self.batch_values()) * len(self.s_values(a)) for a in self.allocations)

    def contains(self, c: Candidate) -> bool:
        return (
            c.alloc in self.allocations
            and 1 <= c.batch_bound <= self.max_batch
            and round_s(c.offload_ratio) in self.s_values(c.alloc)
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "allocations": [a.label for a in self.allocations],
            "max_batch": self.max_batch,
            "s_step": self.s_step,
            "local_prefill": self.local_prefill,
            "local_tp": self.local_tp,
            "size": self.size,
        }


def space_for(
    spec: EPDDeploymentSpec,
    min_tp: int,
    *,
    max_batch: int = DEFAULT_MAX_BATCH,
    s_step: float = DEFAULT_S_STEP,
    local_prefill: bool = True,
    full_only: bool = True,
    local_tp: int = 1,
    tp_options: tuple[int, ...] = TP_OPTIONS,
) -> SearchSpace:
    """The space for a deployment spec: its GPU budget and the model's ``min_tp``.

    ``tp_options``: the TP degrees the engine can run (the torch engine has no tensor parallelism
    yet, so a space that is to be deployed on it passes ``(1,)``: a TP-2 pool would be refused).

    Raises ``ValueError`` naming ``spec.gpuBudget`` and the smallest budget that would fit when
    no allocation does (e.g. 2 GPUs with local prefill off: each stage then needs its own).
    """
    allocs = enumerate_allocations(
        spec.gpu_budget, min_tp, full_only=full_only, local_prefill=local_prefill, local_tp=local_tp,
        tp_options=tp_options,
    )
    if not allocs:
        tp = min(feasible_tps(min_tp, tp_options), default=min_tp)
        why = f"{1 + 2 * tp} GPUs with a remote prefill worker (1 encode, prefill and decode at TP {tp})"
        if local_prefill:
            why += f", or {local_tp + tp} all-local ({local_tp} encode GPU(s) hosting local prefill, decode at TP {tp})"
        else:
            why += "; local prefill is off, so there is no all-local layout"
        raise ValueError(f"spec.gpuBudget={spec.gpu_budget}: no allocation fits: the smallest needs {why}")
    return SearchSpace(
        tuple(allocs), max_batch=max_batch, s_step=s_step, local_prefill=local_prefill, local_tp=local_tp
    )


def apply_candidate(spec: EPDDeploymentSpec, c: Candidate) -> EPDDeploymentSpec:
    """A copy of ``spec`` running candidate ``c`` (allocation, encode B, offload s).

    s = 1 means no local prefill, so the SM partition is switched off; s < 1 keeps the user's
    partition mode, or turns on ``dynamic`` if the user had none (local prefill must share the
    encode GPU under some partition). The copy is re-checked against the spec's cross-field
    rules, so an impossible candidate fails loudly instead of being silently deployed.
    """
    s = round_s(c.offload_ratio)
    if s >= 1.0:
        part = spec.sm_partition.model_copy(update={"mode": PartitionMode.NONE.value})
    elif spec.sm_partition.mode == PartitionMode.NONE:
        part = spec.sm_partition.model_copy(update={"mode": PartitionMode.DYNAMIC.value})
    else:
        part = spec.sm_partition
    out = spec.model_copy(
        update={
            "allocation": c.alloc.allocation(),
            "encode": spec.encode.model_copy(update={"batch_bound": c.batch_bound}),
            "offload": OffloadSpec(ratio=s),
            "sm_partition": part,
        }
    )
    errs = cross_field_errors(out)
    if errs:
        raise ValueError(f"candidate {c.alloc.label} B={c.batch_bound} s={s}: {errs[0]}")
    return out
