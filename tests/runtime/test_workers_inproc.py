"""The encode -> prefill -> decode chain in one event loop, with Dynamo replaced by direct calls.

This checks the workers' own logic (batching, routing, one envelope per destination, relaying,
token counts, failure propagation) fast and deterministically; the Dynamo path is covered by
test_serve_integration.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from easerve_runtime.api import EPDDeploymentSpec, load_manifest
from easerve_runtime.engines.base import DecodeSequence, EncodeInput, MediaPart, PrefillInput
from easerve_runtime.engines.sim import SimEngine, token_at
from easerve_runtime.metrics import Metrics
from easerve_runtime.policies.envelope import Envelope
from easerve_runtime.policies.router import LeastOutstanding
from easerve_runtime.workers.decode import DecodeWorker
from easerve_runtime.workers.encode import EncodeWorker
from easerve_runtime.workers.pool import StageError
from easerve_runtime.workers.prefill import PrefillWorker
from easerve_runtime.workers.wire import b64d, part_to_wire

SPEC = "tests/runtime/spec_small.yaml"


class FakeProfile:
    """Tiny constant latencies; records what it was asked."""

    anyres = False

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def encode_s(self, batch: int, sm_share: float = 1.0) -> float:
        self.calls.append(("encode", (batch, sm_share)))
        return 0.002

    def prefill_s(self, tokens: int, sm_share: float = 1.0, **kw: Any) -> float:
        self.calls.append(("prefill", (tokens, sm_share, kw.get("sequences"))))
        return 0.002

    def decode_step_s(self, batch: int, context: float, **kw: Any) -> float:
        self.calls.append(("decode", (batch, context)))
        return 0.001

    def transfer_s(self, nbytes: int, *, path: str = "embedding") -> float:
        return 0.0

    def kv_bytes(self, tokens: int) -> int:
        return tokens * 1000

    def embedding_bytes(self, tokens: int) -> int:
        return tokens * 16 * 2


class FakePool:
    """Pool stand-in: instance id -> handler (an async generator function), counts outstanding."""

    def __init__(self, handlers: dict[int, Callable[..., AsyncIterator[Any]]], name: str = "x") -> None:
        self.handlers = handlers
        self.name = name
        self.outstanding: dict[int, int] = {}
        self.sent: list[tuple[int, Any]] = []
        self._picker = LeastOutstanding()

    def instances(self) -> list[int]:
        return sorted(self.handlers)

    def pick(self, exclude: set[int] | None = None, extra: dict[int, int] | None = None) -> int:
        ids = [i for i in self.instances() if not exclude or i not in exclude]
        if not ids:
            raise StageError(f"no live {self.name} instance", retryable=True)
        load = dict(self.outstanding)
        for k, v in (extra or {}).items():
            load[k] = load.get(k, 0) + v
        return self._picker.pick(ids, load)

    async def stream(self, request: Any, instance: int | None = None, weight: int = 1) -> AsyncIterator[Any]:
        iid = instance if instance is not None else self.pick()
        self.sent.append((iid, request))
        self.outstanding[iid] = self.outstanding.get(iid, 0) + weight
        try:
            async for item in self.handlers[iid](request):
                yield item
        except Exception as exc:
            raise StageError(f"{self.name} {iid} failed: {exc}") from exc
        finally:
            self.outstanding[iid] -= weight


def spec(**offload: float) -> EPDDeploymentSpec:
    _, s = load_manifest(SPEC)
    if offload:
        s = s.model_copy(update={"offload": s.offload.model_copy(update=offload)})
    return s


def png_part() -> dict[str, Any]:
    from easerve_runtime.bench.payloads import png

    return part_to_wire(MediaPart("image", png(336, 336), "image/png", {"height": 336, "width": 336}))


async def drive(n: int, s: EPDDeploymentSpec, max_tokens: int = 3, gap: float = 0.0005,
                profile_cost: Any = None) -> dict[str, Any]:
    prof = FakeProfile()
    eng = SimEngine(prof, speedup=1.0, bytes_scale=1.0)
    m = Metrics()
    decode_workers = {10: DecodeWorker(eng, m), 11: DecodeWorker(eng, m)}
    decode_pool = FakePool({k: w.generate for k, w in decode_workers.items()}, "decode")
    remote = PrefillWorker(eng, m, decode_pool, profile_cost=profile_cost)
    local = PrefillWorker(eng, m, decode_pool, stage="local-prefill", profile_cost=profile_cost)
    remote_pool = FakePool({1: remote.generate}, "prefill")
    local_pool = FakePool({2: local.generate}, "local prefill")
    enc = EncodeWorker(s, eng, m, remote_pool, local_pool)
    runs = [enc.run(), remote.run(), local.run(), *(w.run() for w in decode_workers.values())]
    loops = [asyncio.create_task(r) for r in runs]

    async def one(i: int) -> list[dict[str, Any]]:
        req = {"id": f"r{i}", "seed": i, "text_tokens": 10, "max_tokens": max_tokens, "parts": [png_part()]}
        return [item async for item in enc.generate(req)]

    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(gap)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    for t in loops:
        t.cancel()
    return {"results": results, "enc": enc, "remote": remote_pool, "local": local_pool, "prof": prof, "m": m}


def test_chain_tokens_routes_and_envelopes() -> None:
    out = asyncio.run(drive(40, spec()))
    for i, items in enumerate(out["results"]):
        tokens = [x["token"] for x in items if "token" in x]
        assert tokens == [token_at(i, k) for k in range(3)], items
        assert items[-1]["done"] is True and items[-1]["prompt_tokens"] == 10 + 576
    routes = [items[-1]["route"] for items in out["results"]]
    assert abs(routes.count("remote") - 20) <= 1
    # one envelope per destination per micro-batch, and the index matches the requests it carries
    sends = out["remote"].sent + out["local"].sent
    batches = out["m"].encode_batch_size.collect()[0].samples
    n_batches = next(s.value for s in batches if s.name.endswith("_count"))
    assert len(sends) <= 2 * n_batches
    for _iid, msg in sends:
        arrays = Envelope.unpack(b64d(msg["buffer"]), msg["index"])
        assert sorted(arrays) == sorted(r["id"] for r in msg["requests"])
        assert all(a.shape == (576, 16) for a in arrays.values())
    assert sum(len(msg["requests"]) for _, msg in sends) == 40
    # the encoder saw micro-batches, never more than B items
    enc_batches = [c[1][0] for c in out["prof"].calls if c[0] == "encode"]
    assert sum(enc_batches) == 40 and max(enc_batches) <= 8


def test_same_host_blobs_carry_the_envelopes_and_leave_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a blob directory (``easerve serve``), envelopes carry a blob name instead of base64, the
    chain gives the same tokens, and every blob is taken or discarded by the end."""
    from easerve_runtime.workers.blobs import BLOB_DIR_ENV

    monkeypatch.setenv(BLOB_DIR_ENV, str(tmp_path / "blobs"))
    out = asyncio.run(drive(12, spec()))
    for i, items in enumerate(out["results"]):
        assert [x["token"] for x in items if "token" in x] == [token_at(i, k) for k in range(3)], items
    sends = out["remote"].sent + out["local"].sent
    assert sends and all("buffer_blob" in msg and "buffer" not in msg for _, msg in sends)
    assert list((tmp_path / "blobs").iterdir()) == []


def test_prefill_workers_count_their_batches_against_the_profile() -> None:
    """Each prefill worker (remote and local, by stage) counts its batches, their requests, the
    engine's time, the profile's time for the same batches and the queue wait: the served runs'
    ``prefill`` block (``gpu_serve.prefill_breakdown``), set against the twin's own."""
    calls: list[tuple[int, int, float]] = []

    def cost(tokens: int, prompts: int, share: float) -> float:
        calls.append((tokens, prompts, share))
        return 0.001 * prompts

    out = asyncio.run(drive(24, spec(), profile_cost=cost))
    m = out["m"]

    def total(counter: Any, stage: str) -> float:
        return sum(x.value for x in counter.collect()[0].samples
                   if x.name.endswith("_total") and x.labels.get("stage") == stage)

    routes = [items[-1]["route"] for items in out["results"]]
    for stage, route in (("prefill", "remote"), ("local-prefill", "local")):
        assert total(m.prefill_batch_requests, stage) == routes.count(route) > 0
        assert 1 <= total(m.prefill_batches, stage) <= routes.count(route)
        assert total(m.prefill_engine_seconds, stage) > 0 and total(m.prefill_queue_wait_seconds, stage) >= 0
    assert sum(p for _, p, _ in calls) == len(routes)  # every batch priced once, by its prompts
    profiled = total(m.prefill_profile_seconds, "prefill") + total(m.prefill_profile_seconds, "local-prefill")
    assert profiled == pytest.approx(0.001 * len(routes))
    assert all(tokens == prompts * (10 + 576) for tokens, prompts, _ in calls)


def test_all_remote_when_ratio_one() -> None:
    out = asyncio.run(drive(12, spec(ratio=1.0)))
    assert {items[-1]["route"] for items in out["results"]} == {"remote"}
    assert out["local"].sent == []


def test_single_token_requests_skip_decode() -> None:
    out = asyncio.run(drive(5, spec(), max_tokens=1))
    assert all([x for x in items if "token" in x] and items[-1]["done"] for items in out["results"])
    assert not [c for c in out["prof"].calls if c[0] == "decode"]


def test_decode_failure_reaches_the_client() -> None:
    async def run() -> list[list[dict[str, Any]]]:
        prof = FakeProfile()
        eng = SimEngine(prof, speedup=1.0, bytes_scale=1.0)
        m = Metrics()

        async def broken(req: Any) -> AsyncIterator[Any]:
            yield {"token": 1}
            raise ConnectionError("Unavailable: Stream ended before generation completed")

        decode_pool = FakePool({10: broken}, "decode")
        pw = PrefillWorker(eng, m, decode_pool)
        enc = EncodeWorker(spec(ratio=1.0), eng, m, FakePool({1: pw.generate}), None)
        loops = [asyncio.create_task(enc.run()), asyncio.create_task(pw.run())]

        async def one(i: int) -> list[dict[str, Any]]:
            req = {"id": f"r{i}", "seed": i, "text_tokens": 4, "max_tokens": 5, "parts": [png_part()]}
            return [x async for x in enc.generate(req)]

        res = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(3))), 10)
        for t in loops:
            t.cancel()
        return list(res)

    for items in asyncio.run(run()):
        assert "error" in items[-1] and "decode" in items[-1]["error"]


def test_in_process_local_prefill_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``InProcessPool`` (the torch engine's encode process hosting its local prefill): the same
    tokens as over a pool, the envelope handed over as is (no blob even where blobs exist), a
    cancel reaches the worker, nothing stays outstanding; a handler that raises is a StageError
    for every request of its envelope."""
    from easerve_runtime.workers.blobs import BLOB_DIR_ENV
    from easerve_runtime.workers.pool import InProcessPool

    monkeypatch.setenv(BLOB_DIR_ENV, str(tmp_path / "blobs"))

    async def run() -> tuple[list[list[dict[str, Any]]], InProcessPool, list[Any], list[str]]:
        eng = SimEngine(FakeProfile(), speedup=1.0, bytes_scale=1.0)
        m = Metrics()
        decoder = DecodeWorker(eng, m)
        local = PrefillWorker(eng, m, FakePool({10: decoder.generate}, "decode"), stage="local-prefill")
        seen: list[Any] = []
        cancels: list[str] = []
        handler = local.generate

        async def spy(env: Any, context: Any = None) -> AsyncIterator[Any]:
            seen.append(dict(env))
            if "cancel" in env:
                cancels.extend(env["cancel"])
            async for x in handler(env, context):
                yield x

        local.generate = spy  # type: ignore[method-assign]
        pool = InProcessPool(local)
        enc = EncodeWorker(spec(ratio=0.0), eng, m, None, pool)
        loops = [asyncio.create_task(w.run()) for w in (enc, local, decoder)]

        async def one(i: int) -> list[dict[str, Any]]:
            req = {"id": f"r{i}", "seed": i, "text_tokens": 4, "max_tokens": 3, "parts": [png_part()]}
            return [x async for x in enc.generate(req)]

        res = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(6))), 10)
        async for _ in pool.stream({"cancel": ["nobody"]}):
            pass
        for t in loops:
            t.cancel()
        return list(res), pool, seen, cancels

    results, pool, seen, cancels = asyncio.run(run())
    for i, items in enumerate(results):
        assert [x["token"] for x in items if "token" in x] == [token_at(i, k) for k in range(3)], items
        assert items[-1]["done"] and items[-1]["route"] == "local"
    envs = [e for e in seen if "requests" in e]
    assert envs and all("buffer_blob" not in e and "buffer" not in e for e in envs)
    assert cancels == ["nobody"] and pool.outstanding == {}

    async def broken(env: Any, context: Any = None) -> AsyncIterator[Any]:
        yield {"ack": True}
        raise RuntimeError("boom")

    class Broken:
        generate = staticmethod(broken)

    async def fail() -> list[dict[str, Any]]:
        eng = SimEngine(FakeProfile(), speedup=1.0, bytes_scale=1.0)
        enc = EncodeWorker(spec(ratio=0.0), eng, Metrics(), None, InProcessPool(Broken()))
        loop = asyncio.create_task(enc.run())
        req = {"id": "x", "seed": 0, "text_tokens": 4, "max_tokens": 3, "parts": [png_part()]}
        items = [x async for x in enc.generate(req)]
        loop.cancel()
        return items

    items = asyncio.run(asyncio.wait_for(fail(), 10))
    assert "error" in items[-1] and "local prefill failed" in items[-1]["error"] and "boom" in items[-1]["error"]


def test_sim_engine_charges_profile_and_is_deterministic() -> None:
    async def run() -> None:
        prof = FakeProfile()
        eng = SimEngine(prof, speedup=1.0, bytes_scale=0.5)
        parts = (MediaPart("image", b"", "", {"height": 336, "width": 336}),)
        embs = await eng.encode([EncodeInput("a", parts), EncodeInput("b", parts + parts)])
        assert prof.calls[-1] == ("encode", (3, 1.0))
        assert [e.shape for e in embs] == [(576, 16), (1152, 16)]
        assert len(embs[0].data) == 576 * 16 * 2 // 2  # bytes_scale 0.5
        outs = await eng.prefill([PrefillInput("a", 10, 576, seed=7)], sm_share=0.5)
        assert prof.calls[-1] == ("prefill", (586, 0.5, 1))
        assert outs[0].first_token == token_at(7, 0) and outs[0].kv_bytes == 586_000
        seqs = [
            DecodeSequence("a", 100, 4, seed=7, generated=[1]),
            DecodeSequence("b", 50, 4, seed=8, generated=[2]),
        ]
        toks = await eng.decode_step(seqs)
        assert toks == [token_at(7, 1), token_at(8, 1)]
        assert prof.calls[-1] == ("decode", (2, 152.0))  # total cached tokens over the batch

    asyncio.run(run())


def test_sim_env_knobs_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EASERVE_SIM_SPEEDUP", "fast")
    with pytest.raises(ValueError, match="EASERVE_SIM_SPEEDUP"):
        SimEngine(FakeProfile())
    monkeypatch.setenv("EASERVE_SIM_SPEEDUP", "-1")
    with pytest.raises(ValueError, match="EASERVE_SIM_SPEEDUP"):
        SimEngine(FakeProfile())


def test_sim_cost_scale_slows_only_the_stage_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """EASERVE_SIM_COST_SCALE plays hardware slower than its profile: the decode step waits 2x the
    profile's time, encode and prefill the profile's (the waits are recorded, not timed)."""
    import easerve_runtime.engines.sim as sim

    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    monkeypatch.setattr(sim.asyncio, "sleep", sleep)
    monkeypatch.setenv("EASERVE_SIM_COST_SCALE", "decode=2")
    from easerve_runtime.profiles import spec_profile

    _, spec = load_manifest(SPEC)
    prof = spec_profile(spec)
    eng = SimEngine(prof, speedup=1.0, bytes_scale=0.01)
    assert eng.cost_scale == {"decode": 2.0}
    seqs = [DecodeSequence("a", 100, 4, seed=7, generated=[1])]
    asyncio.run(eng.decode_step(seqs))
    asyncio.run(eng.prefill([PrefillInput("p", 100, 0, seed=1)]))
    assert waits == [pytest.approx(2 * prof.decode_step_s(1, 101.0)), pytest.approx(prof.prefill_s(100, 1.0, sequences=1))]
    for bad in ("decode", "gpu=2", "decode=0", "decode=x"):
        monkeypatch.setenv("EASERVE_SIM_COST_SCALE", bad)
        with pytest.raises(ValueError, match="EASERVE_SIM_COST_SCALE"):
            SimEngine(prof)


def test_sim_engine_pays_back_what_a_busy_host_made_its_sleeps_overrun() -> None:
    """A sleep that returns late (a busy host) is paid back from the stage's next sleeps, so the
    stage is busy for what its profile says; a stall is not caught up beyond MAX_DEBT_S. Clock and
    sleep are injected: the host's lateness is played, nothing is timed."""
    import easerve_runtime.engines.sim as sim

    now = [0.0]
    asked: list[float] = []
    late = [0.004]

    async def sleep(s: float) -> None:
        asked.append(s)
        now[0] += s + late[0]

    class SlowerProfile(FakeProfile):  # steps longer than the host's lateness
        def decode_step_s(self, batch: int, context: float, **kw: Any) -> float:
            return 0.02

    prof = SlowerProfile()
    eng = SimEngine(prof, speedup=2.0, bytes_scale=0.01, clock=lambda: now[0], sleep=sleep)
    step = prof.decode_step_s(1, 101.0) / 2.0
    seqs = [DecodeSequence("a", 100, 4, seed=7, generated=[1])]

    async def steps(n: int) -> None:
        for _ in range(n):
            await eng.decode_step(seqs)

    asyncio.run(steps(10))
    assert asked[0] == pytest.approx(step)
    assert asked[1:] == [pytest.approx(step - 0.004)] * 9  # each pays back the one before's overrun
    assert now[0] == pytest.approx(10 * step + 0.004)  # ten steps busy for ten profile steps, plus the last's lateness
    # another stage carries no debt of decode's
    asked.clear()
    asyncio.run(eng.prefill([PrefillInput("p", 100, 0, seed=1)]))
    assert asked == [pytest.approx(prof.prefill_s(100, 1.0, sequences=1) / 2.0)]
    # a stall (one sleep 2 s late) is paid back only up to MAX_DEBT_S
    asked.clear()
    late[0] = 2.0
    asyncio.run(steps(1))
    late[0] = 0.0
    t0 = now[0]
    asyncio.run(steps(100))
    assert sum(asked[1:]) == pytest.approx(100 * step - sim.MAX_DEBT_S)
    assert now[0] - t0 == pytest.approx(100 * step - sim.MAX_DEBT_S)


def test_partition_link_reads_the_controllers_split(tmp_path: Path) -> None:
    from easerve_runtime.partition.record import (
        ControlRecord,
        ControlRecordFile,
        DemandFile,
        PolicyCode,
        control_path,
        demand_path,
    )
    from easerve_runtime.workers.partition_link import PartitionLink

    enc, pre = PartitionLink(3, "primary", tmp_path), PartitionLink(3, "partner", tmp_path)
    assert enc.share(4) == 1.0  # no controller yet: the whole GPU
    assert DemandFile(demand_path(3, "primary", tmp_path)).read().batch == 4
    ctl = ControlRecordFile(control_path(3, tmp_path), writer=True)
    ctl.write(ControlRecord(primary_sms=96, partner_sms=36, total_sms=132, policy=PolicyCode(1), level=3))
    assert enc.share(8) == pytest.approx(96 / 132)
    assert pre.share(1) == pytest.approx(36 / 132)
    enc.idle()
    assert DemandFile(demand_path(3, "primary", tmp_path)).read().active is False


def test_encode_worker_passes_the_granted_share(tmp_path: Path) -> None:
    from easerve_runtime.partition.record import ControlRecord, ControlRecordFile, PolicyCode, control_path
    from easerve_runtime.workers.partition_link import PartitionLink

    ctl = ControlRecordFile(control_path(0, tmp_path), writer=True)
    ctl.write(ControlRecord(primary_sms=66, partner_sms=66, total_sms=132, policy=PolicyCode(1), level=1))

    async def run() -> FakeProfile:
        prof = FakeProfile()
        eng = SimEngine(prof, speedup=1.0, bytes_scale=1.0)
        m = Metrics()
        dec = DecodeWorker(eng, m)
        pw = PrefillWorker(eng, m, FakePool({10: dec.generate}))
        enc = EncodeWorker(spec(ratio=1.0), eng, m, FakePool({1: pw.generate}), None)
        enc.partition = PartitionLink(0, "primary", tmp_path)
        loops = [asyncio.create_task(x) for x in (enc.run(), pw.run(), dec.run())]
        req = {"id": "r", "seed": 1, "text_tokens": 4, "max_tokens": 2, "parts": [png_part()]}
        items = [x async for x in enc.generate(req)]
        assert items[-1].get("done"), items
        for t in loops:
            t.cancel()
        return prof

    prof = asyncio.run(run())
    assert ("encode", (1, 0.5)) in prof.calls


def test_a_request_whose_client_went_away_is_dropped_from_its_micro_batch() -> None:
    """A client disconnect closes the request's handler; the request was already waiting in the
    batcher (its micro-batch formed meanwhile), and the encoder must not spend time on it."""

    class Recording(SimEngine):
        batches: list[list[str]] = []

        async def encode(self, batch: Any, sm_share: float = 1.0) -> Any:
            self.batches.append([b.request_id for b in batch])
            return await super().encode(batch, sm_share)

    async def run() -> tuple[list[list[str]], list[dict[str, Any]]]:
        s = spec(ratio=1.0)
        s = s.model_copy(update={"encode": s.encode.model_copy(update={"dispatch": "fixed-timeout", "timeout_ms": 300.0})})
        eng = Recording.for_spec(s, speedup=50.0)
        m = Metrics()
        dec = DecodeWorker(eng, m)
        pw = PrefillWorker(eng, m, FakePool({10: dec.generate}))
        enc = EncodeWorker(s, eng, m, FakePool({1: pw.generate}), None)
        loops = [asyncio.create_task(x) for x in (enc.run(), pw.run(), dec.run())]

        async def one(i: int) -> list[dict[str, Any]]:
            req = {"id": f"r{i}", "seed": i, "text_tokens": 4, "max_tokens": 2, "parts": [png_part()]}
            return [x async for x in enc.generate(req)]

        kept = asyncio.create_task(one(0))
        gone = asyncio.create_task(one(1))
        await asyncio.sleep(0.05)  # both wait in the batcher (fixed timeout: 300 ms)
        gone.cancel()  # the client went away: its handler closes
        with contextlib.suppress(asyncio.CancelledError):
            await gone
        items = await asyncio.wait_for(kept, 10)
        for t in loops:
            t.cancel()
        return Recording.batches, items

    batches, items = asyncio.run(run())
    assert items[-1].get("done"), items
    assert batches == [["r0"]], batches  # r1 never reached the encoder
