"""SM-partition policies: which share of a GPU's SMs the primary tenant gets, and why.

Two policies share one vocabulary, an *SM ladder* (a few SM counts, Hopper-aligned to steps of
8 SMs), and one contract: the caller passes in what it observed, the policy answers a split
``(primary_sms, partner_sms)`` that always sums to the GPU's SM count. Nothing here reads a
clock, a GPU or a file: the partition controller (``easerve_runtime.partition``), the encode
worker and the discrete-event twin all drive these same objects.

- :class:`PartitionTable` is the profiled knee table (EAServe §3.4): for each SM level, the
  largest micro-batch whose encode latency stays within ``(1 + epsilon)`` of the full-GPU
  latency. It is built once (``easerve profile-partition``) and loaded from a ConfigMap.
- :class:`EncodeBatchSplit` (EAServe §3.4) re-splits per micro-batch: the smallest level whose
  supported batch covers the micro-batch goes to encode, the complement to local prefill.
  Small batches release SMs to prefill; large ones reclaim them.
- :class:`BandwidthThrottle` (HorizonServe §4.4, Eq. 1) caps the shared stage by memory-bandwidth
  pressure: ``S_aggr`` with no downstream activity, else
  ``snap(S_min + rho * (S_cap - S_min))`` with ``rho = clamp(B_hat / B_sat, 0, 1)`` and
  ``B_hat`` the EWMA (gamma = 0.4) of the NVML memory-activity signal; during co-running the
  cap moves only when the target moves at least one ladder step away from the current cap,
  so a noisy signal does not make the split oscillate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

HOPPER_SM_STEP = 8
"""Green-context partitions on Hopper come in multiples of 8 SMs (one GPC slice of TPC pairs)."""

TABLE_SCHEMA_VERSION = 1
DEFAULT_EPSILON = 0.1
DEFAULT_GAMMA = 0.4


def align_sms(sms: int, total_sms: int, step: int = HOPPER_SM_STEP) -> int:
    """Round ``sms`` down to a multiple of ``step`` (at least one step), or to ``total_sms`` itself.

    The full GPU is always a valid level even when ``total_sms`` (132 on an H200) is not a multiple
    of the step: it means "no partition", not a green context of 132.
    """
    if sms >= total_sms:
        return total_sms
    return max(step, (sms // step) * step)


def default_ladder(total_sms: int, levels: int = 5, step: int = HOPPER_SM_STEP) -> tuple[int, ...]:
    """``levels`` SM counts spread evenly up to the full GPU, each a multiple of ``step``.

    132 SMs, 5 levels -> (32, 56, 80, 104, 132)-like ladders; the top level is always the full GPU.
    """
    if levels < 1:
        raise ValueError(f"levels must be >= 1, got {levels}")
    if total_sms < step:
        raise ValueError(f"total_sms ({total_sms}) must be at least one step ({step})")
    out = {total_sms}
    for i in range(1, levels):
        out.add(align_sms(round(total_sms * i / levels), total_sms, step))
    return tuple(sorted(out))


@dataclass(frozen=True)
class PartitionLevel:
    """One rung of the knee table: ``sms`` SMs sustain micro-batches up to ``max_batch`` (0: none)."""

    sms: int
    max_batch: int


@dataclass(frozen=True)
class PartitionTable:
    """The knee table: per SM level, the largest batch within (1+epsilon) of full-GPU latency.

    ``latency_s`` keeps the raw profile (``{sms: {batch: seconds}}``) so the twin can build its
    SM-share curves from the same numbers the encode worker uses.
    """

    total_sms: int
    levels: tuple[PartitionLevel, ...]
    epsilon: float = DEFAULT_EPSILON
    encoder: str = ""
    gpu: str = ""
    backend: str = ""
    latency_s: Mapping[int, Mapping[int, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("levels: a partition table needs at least one level")
        sms = [lv.sms for lv in self.levels]
        if sms != sorted(set(sms)):
            raise ValueError(f"levels: SM counts must be strictly increasing, got {sms}")
        if sms[-1] != self.total_sms:
            raise ValueError(
                f"levels: the last level must be the full GPU ({self.total_sms} SMs), got {sms[-1]}"
            )
        if sms[0] <= 0:
            raise ValueError(f"levels: SM counts must be positive, got {sms[0]}")
        if self.epsilon < 0:
            raise ValueError(f"epsilon: must be >= 0, got {self.epsilon}")

    @classmethod
    def from_latencies(
        cls,
        total_sms: int,
        latency_s: Mapping[int, Mapping[int, float]],
        epsilon: float = DEFAULT_EPSILON,
        **meta: str,
    ) -> PartitionTable:
        """Build the table from a profile ``{sms: {batch: seconds}}`` that includes the full GPU.

        A level supports batch ``b`` when every profiled batch up to ``b`` is within (1+epsilon) of
        the full GPU: a level that is too slow at batch 4 is not trusted at batch 8 because batch 8
        happened to be close (so coverage is monotone, as the split rule needs).
        """
        if total_sms not in latency_s:
            raise ValueError(
                f"latency_s: needs the full-GPU level ({total_sms} SMs), got {sorted(latency_s)}"
            )
        full = latency_s[total_sms]
        batches = sorted(full)
        if not batches:
            raise ValueError("latency_s: the full-GPU level has no batches")
        levels: list[PartitionLevel] = []
        for sms in sorted(latency_s):
            row = latency_s[sms]
            max_batch = 0
            for b in batches:
                if b not in row:
                    raise ValueError(f"latency_s[{sms}]: missing batch {b} (profiled at full GPU)")
                if sms != total_sms and row[b] > (1.0 + epsilon) * full[b]:
                    break
                max_batch = b
            levels.append(PartitionLevel(sms=sms, max_batch=max_batch))
        frozen = {int(s): {int(b): float(t) for b, t in r.items()} for s, r in latency_s.items()}
        return cls(total_sms=total_sms, levels=tuple(levels), epsilon=epsilon, latency_s=frozen, **meta)

    @property
    def ladder(self) -> tuple[int, ...]:
        return tuple(lv.sms for lv in self.levels)

    def level_for(self, batch: int) -> PartitionLevel:
        """The smallest level whose supported batch covers ``batch``; the full GPU when none does."""
        if batch < 0:
            raise ValueError(f"batch: must be >= 0, got {batch}")
        for lv in self.levels:
            if lv.max_batch >= batch and (batch > 0 or lv.max_batch > 0):
                return lv
        return self.levels[-1]

    def to_dict(self) -> dict[str, Any]:
        """The JSON the encode worker loads from its ConfigMap (camelCase like the rest of the wire)."""
        return {
            "schemaVersion": TABLE_SCHEMA_VERSION,
            "encoder": self.encoder,
            "gpu": self.gpu,
            "backend": self.backend,
            "totalSMs": self.total_sms,
            "epsilon": self.epsilon,
            "levels": [{"sms": lv.sms, "maxBatch": lv.max_batch} for lv in self.levels],
            "latencyMs": {
                str(s): {str(b): round(t * 1e3, 4) for b, t in sorted(r.items())}
                for s, r in sorted(self.latency_s.items())
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PartitionTable:
        """Parse :meth:`to_dict` output; errors name the offending field."""
        version = data.get("schemaVersion")
        if version != TABLE_SCHEMA_VERSION:
            raise ValueError(f"schemaVersion: expected {TABLE_SCHEMA_VERSION}, got {version!r}")
        for key in ("totalSMs", "levels"):
            if key not in data:
                raise ValueError(f"{key}: required")
        try:
            levels = tuple(
                PartitionLevel(sms=int(lv["sms"]), max_batch=int(lv["maxBatch"])) for lv in data["levels"]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"levels: each entry needs integer sms and maxBatch ({exc})") from exc
        lat = {
            int(s): {int(b): float(ms) / 1e3 for b, ms in row.items()}
            for s, row in (data.get("latencyMs") or {}).items()
        }
        return cls(
            total_sms=int(data["totalSMs"]),
            levels=levels,
            epsilon=float(data.get("epsilon", DEFAULT_EPSILON)),
            encoder=str(data.get("encoder", "")),
            gpu=str(data.get("gpu", "")),
            backend=str(data.get("backend", "")),
            latency_s=lat,
        )


@dataclass(frozen=True)
class Split:
    """A decision: primary (encode / shared stage) SMs, partner SMs, and the ladder index."""

    primary_sms: int
    partner_sms: int
    level: int


class EncodeBatchSplit:
    """EAServe's per-micro-batch split: smallest covering level to encode, the rest to local prefill.

    ``min_partner_sms`` keeps the complement from dropping below something the partner can run on
    (0 by default: at the full-GPU level the partner simply waits for the micro-batch to finish).
    """

    def __init__(self, table: PartitionTable) -> None:
        self.table = table

    def decide(self, batch: int) -> Split:
        lv = self.table.level_for(batch)
        return Split(
            primary_sms=lv.sms,
            partner_sms=self.table.total_sms - lv.sms,
            level=self.table.ladder.index(lv.sms),
        )

    def idle(self) -> Split:
        """No micro-batch in flight: the partner may use the whole GPU."""
        return Split(primary_sms=0, partner_sms=self.table.total_sms, level=-1)


def snap(value: float, ladder: Sequence[int]) -> int:
    """The ladder value nearest ``value`` (ties go to the larger: protect the shared stage)."""
    if not ladder:
        raise ValueError("ladder: empty")
    return min(ladder, key=lambda s: (abs(s - value), -s))


class Ewma:
    """``x_hat <- gamma * x + (1 - gamma) * x_hat``; the first sample initialises it."""

    def __init__(self, gamma: float = DEFAULT_GAMMA) -> None:
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma: must be in (0, 1], got {gamma}")
        self.gamma = gamma
        self.value: float | None = None

    def update(self, x: float) -> float:
        if not math.isfinite(x):
            raise ValueError(f"sample: must be finite, got {x}")
        self.value = x if self.value is None else self.gamma * x + (1.0 - self.gamma) * self.value
        return self.value


class BandwidthThrottle:
    """HorizonServe Eq. 1: the shared stage's SM cap from downstream activity and bandwidth pressure.

    ``ladder`` is the co-running ladder from ``S_min`` to ``S_cap`` (sorted; Hopper-aligned by the
    caller); ``s_aggr`` is the no-downstream cap (``S_cap < S_aggr <= total_sms``); ``b_sat`` is the
    pressure (same units as the NVML signal, percent) at which the cap reaches ``S_cap``.
    Hysteresis: while co-running, the cap changes only when the unsnapped target is at least
    ``step`` SMs (default: the ladder's smallest spacing) away from the current cap.
    """

    def __init__(
        self,
        ladder: Iterable[int],
        s_aggr: int,
        total_sms: int,
        b_sat: float,
        gamma: float = DEFAULT_GAMMA,
        step: float | None = None,
    ) -> None:
        lad = tuple(sorted(set(int(s) for s in ladder)))
        if not lad:
            raise ValueError("ladder: needs at least one SM level")
        if lad[0] <= 0:
            raise ValueError(f"ladder: SM counts must be positive, got {lad[0]}")
        if not lad[-1] < s_aggr <= total_sms:
            raise ValueError(
                f"s_aggr: must satisfy S_cap ({lad[-1]}) < s_aggr <= total_sms ({total_sms}), got {s_aggr}"
            )
        if b_sat <= 0:
            raise ValueError(f"b_sat: must be > 0, got {b_sat}")
        self.ladder = lad
        self.s_min, self.s_cap = lad[0], lad[-1]
        self.s_aggr = s_aggr
        self.total_sms = total_sms
        self.b_sat = b_sat
        self.ewma = Ewma(gamma)
        spacing = [b - a for a, b in zip(lad, lad[1:], strict=False)]
        self.step = float(step) if step is not None else float(min(spacing) if spacing else 0)
        self.current = s_aggr
        self.changed_at: float | None = None

    def observe(self, memory_activity: float) -> float:
        """Feed one NVML memory-activity sample (percent); returns the new EWMA ``B_hat``."""
        return self.ewma.update(memory_activity)

    @property
    def rho(self) -> float:
        b_hat = self.ewma.value or 0.0
        return min(1.0, max(0.0, b_hat / self.b_sat))

    def target(self, downstream_active: bool) -> float:
        """Eq. 1 before snapping (``S_aggr`` when nothing downstream runs)."""
        if not downstream_active:
            return float(self.s_aggr)
        return self.s_min + self.rho * (self.s_cap - self.s_min)

    def decide(self, downstream_active: bool, now: float) -> Split:
        """Pick the cap for the next shared-stage step; ``now`` records when it last changed."""
        raw = self.target(downstream_active)
        if not downstream_active:
            new = self.s_aggr
        elif self.current not in self.ladder or abs(raw - self.current) >= self.step:
            # entering co-running from S_aggr applies at once; within the ladder, hysteresis
            new = snap(raw, self.ladder)
        else:
            new = self.current
        if new != self.current:
            self.current = new
            self.changed_at = now
        level = self.ladder.index(new) if new in self.ladder else len(self.ladder)
        return Split(primary_sms=new, partner_sms=self.total_sms - new, level=level)
