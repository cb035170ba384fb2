"""The twin's view of a latency profile: stage times for a given batch, share and TP degree.

This is an adapter, not a second latency model: every number comes from the profile object that
``easerve_runtime.profiles.load_profile`` returns (the one the runtime's sim engine awaits), and
this class only (a) passes the stage's tensor-parallel degree in the profile's own terms, (b)
caches calls, because the twin asks the same question thousands of times per run, and (c) derives
KV capacity from the profile's memory figures.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from easerve_runtime.api import DecodeSpec

if TYPE_CHECKING:
    from easerve_runtime.profiles.hardware import TransferPath

KV_MEMORY_UTILISATION: float = DecodeSpec().kv_memory_fraction
"""Fraction of GPU memory an engine may use for weights + KV (``spec.decode.kvMemoryFraction``'s
default, vLLM's gpu_memory_utilization)."""


class LatencyProfile(Protocol):
    """What the twin needs from ``easerve_runtime.profiles.Profile`` (see docs/profiles.md)."""

    def encode_s(self, batch: int, sm_share: float = 1.0) -> float: ...

    def prefill_s(self, tokens: int, sm_share: float = 1.0) -> float: ...

    def decode_step_s(self, batch: int, context_tokens: float) -> float:
        """``context_tokens``: KV tokens cached across the whole batch (a total, not a mean)."""
        ...

    def transfer_s(self, nbytes: int, *, path: TransferPath = "embedding") -> float: ...

    def kv_bytes(self, tokens: int) -> int: ...

    def embedding_bytes(self, tokens: int) -> int: ...


def _params(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _tp_kw(fn: Any) -> str | None:
    params = _params(fn)
    for name in ("tp", "tensor_parallel"):
        if name in params:
            return name
    return None


@dataclass(frozen=True)
class StageScales:
    """Multipliers on the profile's stage times: a twin calibrated against what a running deployment
    measures (the autopilot's live calibration, docs/adapt.md). 1.0 everywhere is the profile as is."""

    encode: float = 1.0
    prefill: float = 1.0
    decode: float = 1.0

    def __post_init__(self) -> None:
        for name in ("encode", "prefill", "decode"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"StageScales.{name}: must be a finite number > 0, got {v}")


class StageModel:
    """Cached stage latencies from one profile (times ``scales``, when given)."""

    def __init__(self, profile: Any, scales: StageScales | None = None) -> None:
        self.profile = profile
        self.scales = scales or StageScales()
        self._encode: dict[tuple[int, float], float] = {}
        self._prefill: dict[tuple[int, int, float, int], float] = {}
        self._transfer: dict[tuple[str, int], float] = {}
        self._kv: dict[int, int] = {}
        self._prefill_tp = _tp_kw(profile.prefill_s)
        self._decode_tp = _tp_kw(profile.decode_step_s)
        self._prefill_seqs = "sequences" in _params(profile.prefill_s)
        self.request_path_s = float(getattr(profile, "request_path_s", 0.0) or 0.0)
        """Each request reaches the first stage this long after it arrives (the serving path outside
        the engines, measured; 0 unless the profile says): a delay, no worker busy for it."""
        self.decode_overhead_s = float(getattr(profile, "decode_overhead_s", 0.0) or 0.0)
        """What each served decode-loop iteration costs beyond the step (host bookkeeping, admission,
        streaming; measured, 0 unless the profile says): charged with the step, so on a shared GPU it
        time-slices too (the served loop waits for the GPU at each of its syncs)."""
        self.decode_row_overhead_s = float(getattr(profile, "decode_row_overhead_s", 0.0) or 0.0)
        """What each served decode-loop iteration costs per running sequence on top (fanning its
        token out to the request's stream; the host's CPU sets it; measured, 0 unless the profile
        says): charged with the step, as ``decode_overhead_s`` is."""
        self.mixed_iteration = str(getattr(profile, "mixed_iteration", "fused") or "fused")
        """How the engine's aggregated loop runs prefill beside decode (``fused`` or ``sequential``)."""
        mps = getattr(profile, "mps_constants", None)
        self.mps_constants: dict[str, float] | None = dict(mps) if mps else None
        """The MPS twin's constants fitted on this card (``sim.mpsshare``); None: the module's (the H200's)."""
        self.total_sms = int(
            getattr(profile, "sms", 0)
            or getattr(profile, "sm_count", 0)
            or getattr(profile, "total_sms", 0)
            or 132
        )

    # -- encode ---------------------------------------------------------------------------
    def aggregated_loop(self) -> StageModel:
        """This model as the engine's aggregated worker pays it: encode and prefill times the
        profile's ``engine.aggregated`` ratios (measured on a served low-load run), through the same
        ``StageScales`` the live calibration uses; ``self`` where the profile carries none."""
        agg = getattr(self.profile, "aggregated_loop", None)
        if not agg:
            return self
        s = self.scales
        return StageModel(self.profile, StageScales(s.encode * float(agg["encode_over_profile"]),
                                                    s.prefill * float(agg["prefill_over_profile"]), s.decode))

    def encode_s(self, items: int, share: float = 1.0) -> float:
        key = (items, share)
        v = self._encode.get(key)
        if v is None:
            v = self._encode[key] = float(self.profile.encode_s(items, share)) * self.scales.encode if items > 0 else 0.0
        return v

    def encode_host_s(self, items: int) -> float:
        """Of ``encode_s(items)``, the seconds on the host's CPU (CPU preprocessing): they take no SM
        share and hold no GPU (``Profile.encode_host_share``; 0 unless the profile measured them)."""
        share = getattr(self.profile, "encode_host_share", None)
        return float(share(items)) * self.encode_s(items) if share is not None and items > 0 else 0.0

    # -- prefill --------------------------------------------------------------------------
    def prefill_s(self, tokens: int, tp: int = 1, share: float = 1.0, sequences: int = 1) -> float:
        """One prefill batch of ``tokens`` total tokens over ``sequences`` prompts (inf at share 0)."""
        key = (tokens, tp, share, sequences)
        v = self._prefill.get(key)
        if v is None:
            if share <= 0.0:
                v = math.inf
            else:
                kw: dict[str, int] = {}
                if self._prefill_tp:
                    kw[self._prefill_tp] = tp
                if self._prefill_seqs:
                    kw["sequences"] = sequences
                v = float(self.profile.prefill_s(tokens, min(share, 1.0), **kw)) * self.scales.prefill
            self._prefill[key] = v
        return v

    def local_prefill_s(self, tokens: int, share: float, sequences: int = 1, tp: int = 1) -> float:
        """The local worker on encode GPUs: ``tp`` of them, each at the given SM share."""
        return self.prefill_s(tokens, tp, share, sequences)

    def min_tp(self) -> int:
        """Smallest TP degree at which the backbone fits (weights + KV reserve)."""
        for tp in (1, 2, 4, 8):
            if self.fits(tp):
                return tp
        raise ValueError("spec.engine.profile: the backbone fits no TP degree in {1, 2, 4, 8}")

    # -- decode ---------------------------------------------------------------------------
    def decode_step_s(self, batch: int, context_total: float, tp: int = 1) -> float:
        """One decode step of ``batch`` sequences holding ``context_total`` KV tokens in all."""
        if self._decode_tp:
            v = float(self.profile.decode_step_s(batch, context_total, **{self._decode_tp: tp}))
        else:
            v = float(self.profile.decode_step_s(batch, context_total))
        return v * self.scales.decode

    # -- bytes ----------------------------------------------------------------------------
    def transfer_s(self, nbytes: int, *, path: TransferPath = "embedding") -> float:
        key = (path, nbytes)
        v = self._transfer.get(key)
        if v is None:
            v = self._transfer[key] = float(self.profile.transfer_s(nbytes, path=path))
        return v

    def kv_bytes(self, tokens: int) -> int:
        v = self._kv.get(tokens)
        if v is None:
            v = self._kv[tokens] = int(self.profile.kv_bytes(tokens))
        return v

    def embedding_bytes(self, tokens: int) -> int:
        return int(self.profile.embedding_bytes(tokens))

    def kv_capacity_bytes(self, tp: int, memory_fraction: float = KV_MEMORY_UTILISATION) -> float:
        """KV bytes a worker of ``tp`` GPUs can hold next to its weights (≤ 0: does not fit), when
        the engine may use ``memory_fraction`` of each GPU (``spec.decode.kvMemoryFraction``)."""
        budget = getattr(self.profile, "kv_budget_bytes", None)
        if callable(budget):
            if memory_fraction == KV_MEMORY_UTILISATION:
                return float(budget(tp))
            return float(budget(tp, memory_fraction))
        mem = getattr(self.profile, "gpu_memory_bytes", None)
        weights = getattr(self.profile, "weight_bytes", None)
        if not mem or weights is None:
            return math.inf
        return tp * mem * memory_fraction - weights

    def fits(self, tp: int) -> bool:
        """The backbone fits on ``tp`` GPUs with room for KV (the profile's own rule when it has one)."""
        fits = getattr(self.profile, "fits", None)
        if callable(fits):
            return bool(fits(tp))
        return self.kv_capacity_bytes(tp) >= self.kv_bytes(16384)
