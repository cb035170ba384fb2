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
from typing import Any, Protocol

KV_MEMORY_UTILISATION = 0.9
"""Fraction of GPU memory an engine may use for weights + KV (vLLM's gpu_memory_utilization)."""


class LatencyProfile(Protocol):
    """What the twin needs from ``easerve_runtime.profiles.Profile`` (see docs/profiles.md)."""

    def encode_s(self, batch: int, sm_share: float = 1.0) -> float: ...

    def prefill_s(self, tokens: int, sm_share: float = 1.0) -> float: ...

    def decode_step_s(self, batch: int, context_tokens: float) -> float: ...

    def transfer_s(self, nbytes: int) -> float: ...

    def kv_bytes(self, tokens: int) -> int: ...

    def embedding_bytes(self, tokens: int) -> int: ...


def _tp_kw(fn: Any) -> str | None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    for name in ("tp", "tensor_parallel"):
        if name in params:
            return name
    return None


class StageModel:
    """Cached stage latencies from one profile."""

    def __init__(self, profile: Any) -> None:
        self.profile = profile
        self._encode: dict[tuple[int, float, int], float] = {}
        self._prefill: dict[tuple[int, int, float], float] = {}
        self._transfer: dict[int, float] = {}
        self._kv_per_token = int(profile.kv_bytes(1))
        self._emb_per_token = int(profile.embedding_bytes(1))
        self._prefill_tp = _tp_kw(profile.prefill_s)
        self._decode_tp = _tp_kw(profile.decode_step_s)
        self._encode_tp = _tp_kw(profile.encode_s)
        self.total_sms = int(getattr(profile, "sm_count", 0) or getattr(profile, "total_sms", 0) or 132)

    # -- encode ---------------------------------------------------------------------------
    def encode_s(self, items: int, share: float = 1.0, tp: int = 1) -> float:
        key = (items, share, tp)
        v = self._encode.get(key)
        if v is None:
            if tp != 1 and self._encode_tp:
                v = float(self.profile.encode_s(items, share, **{self._encode_tp: tp}))
            else:
                v = float(self.profile.encode_s(items, share))
            self._encode[key] = v
        return v

    # -- prefill --------------------------------------------------------------------------
    def prefill_s(self, tokens: int, tp: int = 1, share: float = 1.0) -> float:
        key = (tokens, tp, share)
        v = self._prefill.get(key)
        if v is None:
            if share <= 0.0:
                v = math.inf
            elif self._prefill_tp:
                v = float(self.profile.prefill_s(tokens, share, **{self._prefill_tp: tp}))
            else:
                v = float(self.profile.prefill_s(tokens, share))
            self._prefill[key] = v
        return v

    def local_prefill_s(self, tokens: int, share: float) -> float:
        """The local worker on an encode GPU: one GPU at the given SM share."""
        return self.prefill_s(tokens, 1, share)

    # -- decode ---------------------------------------------------------------------------
    def decode_step_s(self, batch: int, context: float, tp: int = 1) -> float:
        if self._decode_tp:
            return float(self.profile.decode_step_s(batch, context, **{self._decode_tp: tp}))
        return float(self.profile.decode_step_s(batch, context))

    # -- bytes ----------------------------------------------------------------------------
    def transfer_s(self, nbytes: int) -> float:
        v = self._transfer.get(nbytes)
        if v is None:
            v = float(self.profile.transfer_s(nbytes))
            self._transfer[nbytes] = v
        return v

    def kv_bytes(self, tokens: int) -> int:
        return self._kv_per_token * tokens

    def embedding_bytes(self, tokens: int) -> int:
        return self._emb_per_token * tokens

    def kv_capacity_tokens(self, tp: int) -> int:
        """KV tokens a worker of ``tp`` GPUs can hold next to its weights (0: does not fit)."""
        mem = getattr(self.profile, "gpu_memory_bytes", None)
        weights = getattr(self.profile, "weight_bytes", None)
        if not mem or weights is None or self._kv_per_token <= 0:
            return 10**9
        free = tp * mem * KV_MEMORY_UTILISATION - weights
        return max(0, int(free // self._kv_per_token))

    def fits(self, tp: int) -> bool:
        """The backbone fits on ``tp`` GPUs with room for at least one long sequence."""
        return self.kv_capacity_tokens(tp) >= 16384
