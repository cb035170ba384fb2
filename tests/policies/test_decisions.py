"""The shared decisions: prefill batching, decode admission, post-encode routing, spec -> SM policy.

Each object is checked on its own (properties over random inputs), and then the live worker and
the twin are checked to hold the SAME object type built from the SAME spec fields, so a constant
can no longer differ between them.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from easerve_runtime.api import DecodeSpec, EncodeSpec, EPDDeploymentSpec, PrefillSpec, load_manifest
from easerve_runtime.policies.decode_admission import DecodeAdmission
from easerve_runtime.policies.partition import PartitionTable
from easerve_runtime.policies.post_encode import LOCAL, PostEncodeRouter
from easerve_runtime.policies.prefill_batch import PrefillBatcher
from easerve_runtime.policies.sm_policy import PolicyKind, partition_policy, policy_kind
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {p.stem: p for p in (ROOT / "examples").glob("*.yaml")}

# -- prefill batching ----------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(budget=st.integers(1, 5000), sizes=st.lists(st.integers(0, 6000), max_size=40))
def test_prefill_batches_are_fifo_within_budget_and_never_stall(budget: int, sizes: list[int]) -> None:
    b: PrefillBatcher[int] = PrefillBatcher(budget)
    for i, t in enumerate(sizes):
        b.add(i, t)
    assert b.pending_tokens == sum(sizes)
    order: list[int] = []
    while b:
        batch, tokens = b.take()
        assert batch, "a non-empty queue always yields a batch (an over-budget request runs alone)"
        assert tokens == sum(sizes[i] for i in batch)
        assert tokens <= budget or len(batch) == 1
        if b:  # the batch stopped because the next request would not fit
            assert tokens + sizes[batch[-1] + 1] > budget
        order.extend(batch)
    assert order == list(range(len(sizes)))
    assert b.take() == ([], 0) and b.pending_tokens == 0


def test_prefill_batcher_rejects_a_bad_budget() -> None:
    with pytest.raises(ValueError, match="max_batch_tokens"):
        PrefillBatcher(0)


# -- decode admission ----------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    cap=st.integers(1, 8),
    capacity=st.floats(1.0, 100.0),
    ops=st.lists(st.tuples(st.booleans(), st.floats(0.1, 60.0)), max_size=60),
)
def test_decode_admission_never_exceeds_sequences_or_memory(
    cap: int, capacity: float, ops: list[tuple[bool, float]]
) -> None:
    a: DecodeAdmission[int] = DecodeAdmission(cap, capacity)
    running: list[float] = []
    for i, (arrive, need) in enumerate(ops):
        if arrive:
            a.add(i, need)
        elif running:
            a.finish(running.pop(0))
        for _item, n in a.admit():
            running.append(n)
        assert a.running == len(running) <= cap
        # memory holds unless a lone sequence was let in (it must run, or the queue deadlocks)
        assert a.reserved <= capacity + 1e-9 or a.running == 1
        assert math.isclose(a.reserved, sum(running), abs_tol=1e-6)
        if a.waiting and a.running == 0:
            pytest.fail("an empty worker left a sequence waiting")


def test_decode_admission_waits_for_memory_then_admits_in_order() -> None:
    a: DecodeAdmission[str] = DecodeAdmission(max_sequences=10, kv_capacity_bytes=100.0)
    for name, need in (("a", 60.0), ("b", 50.0), ("c", 10.0)):
        a.add(name, need)
    assert [x for x, _ in a.admit()] == ["a"]  # b does not fit; c waits behind it (FIFO)
    assert a.waiting == 2
    a.finish(60.0)
    assert [x for x, _ in a.admit()] == ["b", "c"]
    assert a.reserved == 60.0 and a.running == 2


# -- post-encode routing --------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    ratio=st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]),
    batches=st.lists(st.integers(1, 9), min_size=1, max_size=20),
    n_remote=st.integers(1, 4),
)
def test_post_encode_routing_splits_by_ratio_and_balances_remotes(
    ratio: float, batches: list[int], n_remote: int
) -> None:
    r: PostEncodeRouter[str] = PostEncodeRouter(ratio, has_local=True)
    remotes = [f"p{i}" for i in range(n_remote)]
    n = 0
    for size in batches:
        items = list(range(n, n + size))
        n += size
        plan = r.route(items, remotes)
        got = [x for g in plan.groups.values() for x in g]
        assert sorted(got) == items and not plan.unroutable  # every request, exactly once
        for g in plan.groups.values():
            assert g == sorted(g)  # batch order kept within an envelope
        loads = [r.outstanding.get(p, 0) for p in remotes]
        assert max(loads) - min(loads) <= 1  # nothing prefilled yet: the pick spreads evenly
    assert r.remote_count == math.floor(n * ratio + 1e-9)  # the deficit router's exact count
    assert r.remote_count + r.local_count == n
    for p in remotes:
        r.prefilled(p, r.outstanding.get(p, 0))
    assert r.outstanding == {}


def test_post_encode_routing_follows_prefilled_and_reports_unroutable() -> None:
    r: PostEncodeRouter[str] = PostEncodeRouter(1.0, has_local=False)
    plan = r.route(["a", "b"], ["p0", "p1"])
    assert plan.groups == {"p0": ["a"], "p1": ["b"]}
    r.prefilled("p0")
    assert r.route(["c"], ["p0", "p1"]).groups == {"p0": ["c"]}  # p0 drained: it gets the next
    assert r.route(["d"], []).unroutable == ["d"]
    r.prefilled(LOCAL)  # a no-op: the local worker is not load-balanced
    with pytest.raises(ValueError, match="no local prefill worker"):
        PostEncodeRouter(0.5, has_local=False)


# -- spec -> SM policy ---------------------------------------------------------------------


def _spec(name: str, **update: object) -> EPDDeploymentSpec:
    _, spec = load_manifest(EXAMPLES[name])
    data = spec.model_dump(by_alias=True, exclude_none=True)
    for path, value in update.items():
        node = data
        *head, last = path.split(".")
        for k in head:
            node = node[k]
        node[last] = value
    return EPDDeploymentSpec.model_validate(data)


def test_spec_to_sm_policy_table() -> None:
    table = PartitionTable.from_latencies(132, {64: {1: 1.0, 8: 1.05}, 132: {1: 1.0, 8: 1.0}})
    dyn = _spec("llava-v1.6-34b")
    assert policy_kind(dyn) is PolicyKind.ENCODE_BATCH_SPLIT
    pol = partition_policy(dyn, 132, table=table)
    assert pol.split is not None and pol.split.decide(8).primary_sms == 64
    with pytest.raises(ValueError, match="table"):
        partition_policy(dyn, 132)
    static = _spec("llava-v1.6-34b", **{"smPartition.mode": "static", "smPartition.staticEncodeSms": 48})
    assert partition_policy(static, 132).static_sms == 48
    assert partition_policy(static, 132).static_share == pytest.approx(48 / 132)
    none = _spec("llava-v1.6-34b", **{"smPartition.mode": "none"})
    assert partition_policy(none, 132).kind is PolicyKind.NONE
    remote_only = _spec("qwen2.5-vl-32b")  # s = 1: no local prefill, the encoder owns its GPU
    assert partition_policy(remote_only, 132, table=table).kind is PolicyKind.NONE
    omni = _spec("qwen2.5-omni")
    from easerve_runtime.omni.profile import load_omni_profile

    prof = load_omni_profile(omni.engine.profile)
    pol = partition_policy(omni, prof.total_sms, throttle=prof.throttle)
    assert pol.kind is PolicyKind.BANDWIDTH_THROTTLE and pol.throttle is not None
    assert pol.throttle.ladder == tuple(sorted(prof.throttle["ladder"]))
    with pytest.raises(ValueError, match="throttle"):
        partition_policy(omni, prof.total_sms)


# -- one object, one home for the constants --------------------------------------------------


def test_live_workers_and_twin_hold_the_same_objects_from_the_same_fields() -> None:
    """Set every new field away from its default; both sides must pick the value up."""
    import asyncio

    from easerve_runtime.engines.sim import SimEngine
    from easerve_runtime.metrics import Metrics
    from easerve_runtime.profiles import load_profile
    from easerve_runtime.sim.latency import StageModel
    from easerve_runtime.sim.shares import ShareModel
    from easerve_runtime.sim.stages import DecodeWorker as TwinDecode
    from easerve_runtime.sim.twin import run_pipeline
    from easerve_runtime.workers.decode import DecodeWorker
    from easerve_runtime.workers.encode import EncodeWorker
    from easerve_runtime.workers.prefill import PrefillWorker

    spec = _spec(
        "llava-v1.6-34b",
        **{
            "prefill.maxBatchTokens": 3000,
            "decode.maxSequences": 7,
            "decode.kvMemoryFraction": 0.8,
            "encode.sendWindow": 3,
        },
    )
    assert (PrefillSpec().max_batch_tokens, DecodeSpec().max_sequences, EncodeSpec().send_window) == (
        8192,
        256,
        8,
    )
    m = Metrics()
    engine = SimEngine.for_spec(spec, "decode")

    async def build() -> tuple[DecodeWorker, PrefillWorker, EncodeWorker]:
        dec = DecodeWorker.for_spec(spec, engine, m)
        pre = PrefillWorker(engine, m, None, max_batch_tokens=spec.prefill.max_batch_tokens)  # type: ignore[arg-type]
        enc = EncodeWorker(spec, engine, m, remote=object(), local=object())  # type: ignore[arg-type]
        return dec, pre, enc

    dec, pre, enc = asyncio.run(build())
    profile = load_profile(spec.engine.profile)
    tp = spec.allocation.decode.tensor_parallel
    assert isinstance(dec.admission, DecodeAdmission) and dec.admission.max_sequences == 7
    assert dec.admission.kv_capacity_bytes == profile.kv_budget_bytes(tp, 0.8)
    assert profile.kv_budget_bytes(tp, 0.8) < profile.kv_budget_bytes(tp)
    assert isinstance(pre.batcher, PrefillBatcher) and pre.batcher.max_batch_tokens == 3000
    assert isinstance(enc.router, PostEncodeRouter) and enc.router.ratio == spec.offload.ratio
    assert enc.window.max_in_flight == 3

    # the twin, built by run_pipeline from the same spec, obeys the same values
    from easerve_runtime.workload import generate as gen

    model = StageModel(profile)
    twin_dec = TwinDecode(None, model, tp, "d", 7, 0.8)  # type: ignore[arg-type]
    assert twin_dec.admission.kv_capacity_bytes == dec.admission.kv_capacity_bytes
    reqs = gen(spec, 4.0, 120, seed=1)
    _, small = run_pipeline(spec, reqs, model)
    _, default = run_pipeline(_spec("llava-v1.6-34b"), reqs, model)
    assert small["mean_decode_batch"] <= 7 < default["mean_decode_batch"]
    assert small["prefill_batches"] > default["prefill_batches"]
    shares = ShareModel(spec, model, colocated=True)
    assert shares.policy.kind is PolicyKind.ENCODE_BATCH_SPLIT


def test_partition_controller_runs_every_spec_from_config_alone(tmp_path: Path) -> None:
    """`--config` is enough for any deployment: the omni pod's controller (rendered with
    `--policy bandwidth-throttle` and no `--ladder`) used to exit 2; it now takes the throttle
    from the omni profile through the same factory as the omni engine."""
    import argparse

    from easerve_runtime.api import RuntimeConfig
    from easerve_runtime.cli import partition_controller as cli
    from easerve_runtime.partition.record import ControlRecordFile, control_path

    for name, extra, want in (
        ("qwen2.5-omni", ["--policy", "bandwidth-throttle"], "BANDWIDTH_THROTTLE"),
        ("llava-v1.6-34b", [], "ENCODE_BATCH_SPLIT"),
    ):
        _, spec = load_manifest(EXAMPLES[name])
        cfg = tmp_path / f"{name}.json"
        cfg.write_text(RuntimeConfig(name=name, dynamo_namespace="t", spec=spec).to_json())
        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        args = ["--config", str(cfg), "--gpu", "3", "--shm-dir", str(tmp_path), "--duration", "0.05"]
        assert cli.run(p.parse_args([*args, *extra])) == 0, name
        assert ControlRecordFile(control_path(3, tmp_path)).read().policy.name == want


def test_live_decode_worker_waits_for_kv_memory_and_finishes_everything() -> None:
    """The live worker admits by the shared policy: with room for two sequences' KV at a time it
    never runs three, the others wait (no OOM, no error) and every request completes."""
    import asyncio
    from collections.abc import Sequence

    from easerve_runtime.engines.base import DecodeSequence
    from easerve_runtime.metrics import Metrics
    from easerve_runtime.workers.decode import DecodeWorker

    class Engine:
        def __init__(self) -> None:
            self.batches: list[int] = []

        async def receive_kv(self, kv_bytes: int) -> None:
            return None

        async def decode_step(self, batch: Sequence[DecodeSequence]) -> list[int]:
            self.batches.append(len(batch))
            await asyncio.sleep(0)
            return [7] * len(batch)

    per_token = 10.0
    eng = Engine()
    # each sequence needs (context 5 + 5 tokens) * 10 = 100 bytes at full length: two fit in 250
    w = DecodeWorker(eng, Metrics(), admission=DecodeAdmission(64, 250.0), kv_bytes=lambda t: t * per_token)

    async def one(i: int) -> list[int]:
        req = {"id": f"r{i}", "context_tokens": 5, "max_tokens": 5, "first_token": 1}
        return [item["token"] async for item in w.generate(req)]

    async def main() -> list[list[int]]:
        loop_task = asyncio.create_task(w.run())
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(6))), 10)
        finally:
            loop_task.cancel()

    outs = asyncio.run(main())
    assert all(len(o) == 4 for o in outs)  # max_tokens 5, the first came from prefill
    assert max(eng.batches) == 2 and w.admission.running == 0 and w.admission.reserved == 0.0
