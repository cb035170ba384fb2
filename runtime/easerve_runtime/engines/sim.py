"""SimEngine: the engine protocol driven by a measured latency profile, on a machine with no GPU.

Each call awaits the latency that ``profiles.spec_profile(spec)`` predicts for the
batch (so a worker's event loop sees exactly the busy periods a GPU would impose, and queues and
batches form as they would), then returns deterministic outputs:

- embeddings of the profile's true byte size (``embedding_bytes(tokens)``), so the envelope
  transfer over Dynamo's TCP request plane costs what it would cost on the wire;
- tokens derived from a seeded hash of (request seed, position), so two runs of the same
  workload produce the same text and tests can check it;
- the KV handoff is charged as ``transfer_s(kv_bytes)`` but not materialised (hundreds of MB
  per request for a 34B model would only measure this laptop's memcpy).

Two environment knobs exist for fast CPU tests, both documented in docs/runtime.md and both
default to faithful behaviour:

- ``EASERVE_SIM_SPEEDUP`` (default 1.0) divides every modelled latency;
- ``EASERVE_SIM_BYTES_SCALE`` (default 1.0) scales the materialised embedding bytes (the shape
  still reports the true token count).

A third plays hardware that differs from its profile, which is what the autopilot's live
calibration exists for (docs/adapt.md): ``EASERVE_SIM_COST_SCALE`` (default none), for example
``decode=2`` or ``encode=1.5,decode=2``, multiplies one stage's modelled latency. The profile,
and so the twin and every profile-derived metric, stay as they are.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from easerve_runtime.api import DeploymentMode, EPDDeploymentSpec
from easerve_runtime.engines.base import (
    DecodeSequence,
    Embedding,
    EncodeInput,
    MediaPart,
    PrefillInput,
    PrefillOutput,
)
from easerve_runtime.workload.media import encoder_items, is_anyres, items_tokens

VOCAB_SIZE = 32_000
EMBED_DTYPE = "bfloat16"
EMBED_ITEMSIZE = 2


COST_STAGES = ("encode", "prefill", "decode")
MAX_DEBT_S = 0.05
"""The most overrun (wall seconds) a stage carries into its next sleeps: a few of its sleeps'
lateness on a busy host, not a stall's."""


def _positive(name: str, raw: str, text: str) -> float:
    """``text`` as a positive finite float, or an error that names the variable ``name=raw``."""
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: {text!r} is not a number") from None
    if not v > 0 or math.isinf(v):
        raise ValueError(f"{name}={raw!r}: must be a positive finite number")
    return v


def env_cost_scale(name: str = "EASERVE_SIM_COST_SCALE") -> dict[str, float]:
    """``stage=factor`` pairs, comma-separated, from the environment; an error names the variable."""
    raw = os.environ.get(name, "").strip()
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in raw.split(","))):
        stage, sep, val = part.partition("=")
        stage = stage.strip()
        if not sep or stage not in COST_STAGES:
            raise ValueError(f"{name}={raw!r}: expected stage=factor pairs, stage one of {', '.join(COST_STAGES)}")
        out[stage] = _positive(name, raw, val)
    return out


def env_float(name: str, default: float) -> float:
    """A positive float from the environment, with an error that names the variable."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return _positive(name, raw, raw)


def token_at(seed: int, position: int) -> int:
    """The deterministic token at ``position`` of the sequence seeded by ``seed``."""
    h = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % VOCAB_SIZE


def _filler(request_id: str, n: int) -> bytes:
    """``n`` deterministic bytes, cheap to make (a 32-byte digest repeated)."""
    if n <= 0:
        return b""
    d = hashlib.blake2b(request_id.encode(), digest_size=32).digest()
    reps = -(-n // len(d))
    return (d * reps)[:n]


class SimEngine:
    """Implements EncodeEngine, PrefillEngine and DecodeEngine from a latency profile."""

    def __init__(
        self,
        profile: Any,
        *,
        anyres: bool | None = None,
        tp: int = 1,
        speedup: float | None = None,
        bytes_scale: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        self.profile = profile
        self._clock = clock
        self._sleep = sleep
        self.anyres = bool(getattr(profile, "anyres", False)) if anyres is None else anyres
        self.tp = tp
        self.speedup = env_float("EASERVE_SIM_SPEEDUP", 1.0) if speedup is None else float(speedup)
        self.bytes_scale = (
            env_float("EASERVE_SIM_BYTES_SCALE", 1.0) if bytes_scale is None else float(bytes_scale)
        )
        if not self.speedup > 0:
            raise ValueError(f"speedup must be > 0, got {self.speedup}")
        if not self.bytes_scale > 0:
            raise ValueError(f"bytes_scale must be > 0, got {self.bytes_scale}")
        self.cost_scale = env_cost_scale()
        self._debt: dict[str, float] = {}  # per stage: how far its sleeps have overrun (see _wait)

    @classmethod
    def for_spec(cls, spec: EPDDeploymentSpec, stage: str = "encode", **kw: Any) -> SimEngine:
        """The sim engine of one stage of a deployment: its profile, its process's tensor
        parallelism in the topology (a local prefill worker spans the backbone's TP in encode GPUs).

        Anyres tiling follows the profile when it says, else the model name (``workload.media``).
        """
        from easerve_runtime.profiles import spec_profile
        from easerve_runtime.topology import Hardware, plan

        profile = spec_profile(spec)
        hw = Hardware(local_prefill_tp=profile.min_tp()) if spec.has_local_prefill else Hardware()
        topo = plan(spec, hw) if spec.mode != DeploymentMode.OMNI_COLOCATED else None
        tps = [p.tp for pod in topo.pods for p in pod.processes if p.stage == stage] if topo else []
        anyres = getattr(profile, "anyres", None)
        return cls(
            profile,
            anyres=is_anyres(spec.model.name) if anyres is None else bool(anyres),
            tp=tps[0] if tps else 1,
            **kw,
        )

    def _tp_kw(self) -> dict[str, int]:
        return {"tp": self.tp} if self.tp != 1 else {}

    async def _wait(self, seconds: float, stage: str | None = None) -> None:
        """Sleep the modelled latency, paying back what earlier sleeps of this stage overran.

        A GPU's kernels take as long as they take whatever the host is doing; an ``asyncio.sleep``
        returns late when the host's cores are busy (on the 2-core local cluster the encoder ran
        4-20 % over its profile: its sleeps are the shortest). Left alone, that lateness adds to
        every busy period and the stage serves slower than its profile, which is a property of the
        test host, not of the modelled system. So each stage keeps its overrun as a debt, capped
        at `MAX_DEBT_S` (a pause of seconds is not caught up in a burst), and the next sleep is
        that much shorter: over a run the stage is busy for what its profile says. The late return
        itself still delays the request it ends, as it would on a host that slow.

        Only a stage's engine work (``stage`` named: one batch at a time) keeps a debt; the KV
        transfers (no stage) run concurrently, one per request, and each sleeps its own time."""
        if seconds <= 0:
            return
        key = stage or ""
        target = seconds * self.cost_scale.get(key, 1.0) / self.speedup
        if stage is None:
            await (self._sleep or asyncio.sleep)(target)
            return
        debt = self._debt.get(key, 0.0)
        t0 = self._clock()
        await (self._sleep or asyncio.sleep)(max(0.0, target - debt))
        self._debt[key] = min(MAX_DEBT_S, max(0.0, debt + (self._clock() - t0) - target))

    # -- sizes ----------------------------------------------------------------------------
    def part_items_tokens(self, part: MediaPart) -> tuple[int, int]:
        """(encoder batch slots, embedding rows) of one media part: the twin's own accounting."""
        return items_tokens(part.kind, dict(part.media), self.anyres)

    def mm_tokens(self, parts: Sequence[MediaPart]) -> int:
        return sum(self.part_items_tokens(p)[1] for p in parts)

    def batch_items(self, batch: Sequence[EncodeInput]) -> int:
        """Encoder items of a micro-batch (what the partition table is indexed by)."""
        return encoder_items((p for r in batch for p in r.parts), self.anyres)

    # -- EncodeEngine ---------------------------------------------------------------------
    async def encode(self, batch: Sequence[EncodeInput], sm_share: float = 1.0) -> list[Embedding]:
        items = self.batch_items(batch)
        if items:
            await self._wait(self.profile.encode_s(items, sm_share), "encode")
        out = []
        for r in batch:
            tokens = self.mm_tokens(r.parts)
            nbytes = int(self.profile.embedding_bytes(tokens)) if tokens else 0
            hidden = nbytes // (EMBED_ITEMSIZE * tokens) if tokens else 0
            data = _filler(r.request_id, int(nbytes * self.bytes_scale))
            out.append(Embedding(r.request_id, data, (tokens, hidden), EMBED_DTYPE))
        return out

    # -- PrefillEngine --------------------------------------------------------------------
    async def prefill(self, batch: Sequence[PrefillInput], sm_share: float = 1.0) -> list[PrefillOutput]:
        tokens = sum(r.prompt_tokens for r in batch)
        if tokens:
            await self._wait(self.profile.prefill_s(tokens, sm_share, sequences=len(batch), **self._tp_kw()), "prefill")
        return [
            PrefillOutput(r.request_id, token_at(r.seed, 0), int(self.profile.kv_bytes(r.prompt_tokens)))
            for r in batch
        ]

    async def prefill_chunks(
        self, chunks: Sequence[tuple[PrefillInput, int, int]], sm_share: float = 1.0
    ) -> list[PrefillOutput | None]:
        """Chunked prefill (the aggregated worker): ``(request, start, tokens)`` per chunk, charged
        as one prefill of all their tokens; an output for each chunk that completes its prompt."""
        tokens = sum(n for _r, _s, n in chunks)
        if tokens:
            await self._wait(self.profile.prefill_s(tokens, sm_share, sequences=len(chunks), **self._tp_kw()), "prefill")
        return [
            PrefillOutput(r.request_id, token_at(r.seed, 0), int(self.profile.kv_bytes(r.prompt_tokens)))
            if start + n >= r.prompt_tokens
            else None
            for r, start, n in chunks
        ]

    # -- DecodeEngine ---------------------------------------------------------------------
    async def receive_kv(self, kv_bytes: int) -> None:
        if kv_bytes > 0:
            await self._wait(self.profile.transfer_s(kv_bytes, path="kv"))

    async def decode_step(self, batch: Sequence[DecodeSequence]) -> list[int]:
        if not batch:
            return []
        # the profile takes the KV tokens cached across the whole batch (the twin does the same)
        context = sum(s.context_tokens + len(s.generated) for s in batch)
        await self._wait(self.profile.decode_step_s(len(batch), float(context), **self._tp_kw()), "decode")
        return [token_at(s.seed, len(s.generated)) for s in batch]
