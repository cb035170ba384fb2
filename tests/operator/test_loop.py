"""The reconcile loop as an object, against an in-memory fake of its small client interface.

A unit-test double for ``loop.Client`` (apply / delete / patch_status / unschedulable_pods); the
same behaviours are exercised end to end against a real API server in test_operator_k8s.py.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from easerve_operator.reconcile.handlers import LoopReader
from easerve_operator.reconcile.loop import Children, ClientError, Owner, Reconciler
from easerve_runtime.api import LABEL_DEPLOYMENT

REPO = Path(__file__).resolve().parents[2]
NS = "team"


class FakeClient:
    """The API server as a dict: apply stores the object (with a new resourceVersion)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.rv = 0
        self.applies: list[tuple[str, str]] = []
        self.deletes: list[tuple[str, str]] = []
        self.status_writes: list[dict[str, Any]] = []
        self.refuse: set[str] = set()  # kinds the "API server" refuses
        self.pending: dict[tuple[str, str], list[str]] = {}

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] in self.refuse:
            raise ClientError(422, "Unprocessable Entity")
        self.rv += 1
        live = copy.deepcopy(obj)
        live["metadata"]["resourceVersion"] = str(self.rv)
        live["metadata"].setdefault("uid", f"uid-{self.rv}")
        self.objects[(obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])] = live
        self.applies.append((obj["kind"], obj["metadata"]["name"]))
        return copy.deepcopy(live)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        if self.objects.pop((kind, namespace, name), None) is None:
            raise ClientError(404, "Not Found")
        self.deletes.append((kind, name))

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.status_writes.append(copy.deepcopy(status))

    def unschedulable_pods(self, namespaces: list[str] | None) -> dict[tuple[str, str], list[str]]:
        return {k: list(v) for k, v in self.pending.items()}

    # what kopf's indexes would hold
    def children(self, owner: str) -> Children:
        return {
            (k, n): copy.deepcopy(o)
            for (k, ns, n), o in self.objects.items()
            if ns == NS and o["metadata"].get("labels", {}).get(LABEL_DEPLOYMENT) == owner
        }

    def edit(self, kind: str, name: str, fn: Any) -> None:
        obj = self.objects[(kind, NS, name)]
        fn(obj)
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)


def owner(example: str = "llava-v1.6-34b", *, name: str | None = None, generation: int = 1,
          status: dict[str, Any] | None = None, **spec_updates: Any) -> Owner:
    doc = yaml.safe_load((REPO / "examples" / f"{example}.yaml").read_text())
    doc["spec"].update(spec_updates)
    return Owner(NS, name or doc["metadata"]["name"], "u-1", generation, doc["spec"], status or {})


@pytest.fixture
def fake() -> FakeClient:
    return FakeClient()


@pytest.fixture
def rec(fake: FakeClient) -> Reconciler:
    return Reconciler(fake, now=lambda: "2026-01-01T00:00:00Z")


def test_first_reconcile_applies_every_child_and_writes_status_once(fake: FakeClient, rec: Reconciler) -> None:
    o = owner()
    out = rec.reconcile(o, lambda: fake.children(o.name))
    assert out.applied == 7 and out.apply_error is None and out.status_written
    assert sorted(k for k, _ in fake.applies) == ["ConfigMap"] + ["Deployment"] * 3 + ["Service"] * 3
    (st,) = fake.status_writes
    assert st["phase"] == "Progressing" and st["observedGeneration"] == 1
    # desired pods per stage, as the topology lays them out (llava: one encode pod spans both
    # encode GPUs, since its local prefill needs TP 2 on that profile's GPU)
    deps = {b["metadata"]["labels"]["easerve.io/stage"]: b["spec"]["replicas"]
            for (k, _, _), b in fake.objects.items() if k == "Deployment"}
    assert deps == {"encode": 1, "prefill": 1, "decode": 2}
    assert st["stages"] == {s: {"desired": d, "ready": 0} for s, d in deps.items()}
    cm = next(b for (k, _, _), b in fake.objects.items() if k == "ConfigMap")
    assert st["configHash"] == cm["metadata"]["annotations"]["easerve.io/config-hash"]


def test_apply_only_if_drifted(fake: FakeClient, rec: Reconciler) -> None:
    o = owner()
    rec.reconcile(o, lambda: fake.children(o.name))
    fake.applies.clear()
    again = rec.reconcile(o, lambda: fake.children(o.name))  # a resume with nothing changed
    assert again.applied == 0 and fake.applies == [] and not again.status_written
    dep = next(n for (k, _, n) in fake.objects if k == "Deployment" and n.endswith("decode"))
    fake.edit("Deployment", dep, lambda d: d["spec"].__setitem__("replicas", 7))  # a hand edit
    fake.edit("ConfigMap", next(n for (k, _, n) in fake.objects if k == "ConfigMap"),
              lambda c: c["metadata"]["labels"].__setitem__("extra", "ok"))  # not ours: no drift
    edited_rv = fake.objects[("Deployment", NS, dep)]["metadata"]["resourceVersion"]
    assert not rec.seen(o.key, "Deployment", dep, edited_rv), "an edit is news: its event must be looked at"
    out = rec.reconcile(o, lambda: fake.children(o.name))
    assert fake.applies == [("Deployment", dep)] and out.applied == 1
    assert fake.objects[("Deployment", NS, dep)]["spec"]["replicas"] == 2
    # the echo of our own apply (same resourceVersion) needs no work when its event arrives
    assert rec.seen(o.key, "Deployment", dep, fake.objects[("Deployment", NS, dep)]["metadata"]["resourceVersion"])


def test_prune_deletes_children_no_longer_rendered(fake: FakeClient, rec: Reconciler) -> None:
    o = owner()
    rec.reconcile(o, lambda: fake.children(o.name))
    stale = copy.deepcopy(next(b for (k, _, _), b in fake.objects.items() if k == "Service"))
    stale["metadata"]["name"] = "llava-v1-6-34b-old-stage"
    fake.objects[("Service", NS, "llava-v1-6-34b-old-stage")] = stale
    out = rec.reconcile(o, lambda: fake.children(o.name))
    assert out.pruned == 1 and fake.deletes == [("Service", "llava-v1-6-34b-old-stage")]
    assert len(fake.children(o.name)) == 7


def test_repair_reapplies_a_deleted_or_edited_child_only(fake: FakeClient, rec: Reconciler) -> None:
    o = owner()
    rec.reconcile(o, lambda: fake.children(o.name))
    fake.applies.clear()
    svc = next(n for (k, _, n) in fake.objects if k == "Service")
    body = fake.objects.pop(("Service", NS, svc))
    rec.refresh(o, lambda: fake.children(o.name), repair=("Service", svc, None))  # a DELETED event
    assert fake.applies == [("Service", svc)]
    assert fake.objects[("Service", NS, svc)]["spec"] == body["spec"]
    fake.applies.clear()
    rec.refresh(o, lambda: fake.children(o.name), repair=("Service", svc, fake.objects[("Service", NS, svc)]))
    assert fake.applies == [], "an event for an undrifted child applies nothing"
    fake.edit("Service", svc, lambda s: s["spec"]["ports"][0].__setitem__("port", 1))
    rec.refresh(o, lambda: fake.children(o.name), repair=("Service", svc, fake.objects[("Service", NS, svc)]))
    assert fake.applies == [("Service", svc)]


def test_status_written_only_when_it_changes_and_from_the_newest_observation(
    fake: FakeClient, rec: Reconciler
) -> None:
    o = owner()
    rec.reconcile(o, lambda: fake.children(o.name))
    assert len(fake.status_writes) == 1
    for _ in range(3):  # child events that change nothing we report
        assert not rec.refresh(o, lambda: fake.children(o.name))
    assert len(fake.status_writes) == 1

    def ready(d: dict[str, Any]) -> None:
        n = d["spec"]["replicas"]
        d["metadata"]["generation"] = 1
        d["status"] = {"observedGeneration": 1, "readyReplicas": n, "updatedReplicas": n, "replicas": n}

    for (k, _, n) in list(fake.objects):
        if k == "Deployment":
            fake.edit(k, n, ready)
    assert rec.refresh(o, lambda: fake.children(o.name))
    st = fake.status_writes[-1]
    assert st["phase"] == "Ready" and st["readySummary"] == "1/1,1/1,2/2"  # encode, prefill, decode pods
    ready_cond = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready_cond["status"] == "True" and ready_cond["reason"] == "AllStagesReady"
    assert not rec.refresh(o, lambda: fake.children(o.name))
    assert len(fake.status_writes) == 2


def test_child_events_wait_until_the_owner_applied_its_generation(fake: FakeClient, rec: Reconciler) -> None:
    o = owner()
    assert not rec.refresh(o, lambda: fake.children(o.name))
    assert fake.status_writes == [] and fake.applies == []


def test_invalid_spec_and_too_long_name_create_nothing_and_say_why(fake: FakeClient, rec: Reconciler) -> None:
    bad = owner(gpuBudget=3)
    out = rec.reconcile(bad, lambda: fake.children(bad.name))
    assert out.invalid and fake.applies == []
    msg = next(c["message"] for c in fake.status_writes[-1]["conditions"] if c["type"] == "Ready")
    assert fake.status_writes[-1]["phase"] == "Failed" and "spec.allocation" in msg
    long = owner(name="a" * 64)
    out = rec.reconcile(long, lambda: fake.children(long.name))
    assert out.invalid and fake.applies == []
    msg = next(c["message"] for c in fake.status_writes[-1]["conditions"] if c["type"] == "Stalled")
    assert msg.startswith("metadata.name: is 64 characters; at most 63")
    ok = owner(name="b" * 63)  # the longest admitted name renders children whose labels apply
    assert rec.reconcile(ok, lambda: fake.children(ok.name)).applied == 7
    assert all(len(v) <= 63 for b in fake.objects.values() for v in b["metadata"]["labels"].values())


def test_refused_child_is_reported_and_retried(fake: FakeClient, rec: Reconciler) -> None:
    fake.refuse.add("Service")
    o = owner()
    out = rec.reconcile(o, lambda: fake.children(o.name))
    assert out.apply_error and "Unprocessable Entity (422)" in out.apply_error
    assert fake.status_writes[-1]["phase"] == "Degraded"
    fake.refuse.clear()
    out = rec.reconcile(o, lambda: fake.children(o.name))
    assert out.apply_error is None and out.applied == 3  # only the three Services were missing


def test_one_capacity_sweep_reports_unschedulable_pods_per_owner(fake: FakeClient, rec: Reconciler) -> None:
    a, b = owner(), owner(name="other")
    for o in (a, b):
        rec.reconcile(o, lambda o=o: fake.children(o.name))
    by_key = {a.key: a, b.key: b}

    def sweep() -> list[tuple[str, str]]:
        return rec.capacity_sweep(None, owner=by_key.get, children=lambda k: lambda: fake.children(k[1]))

    writes = len(fake.status_writes)
    fake.pending = {a.key: ["p-1: 0/1 nodes are available: Insufficient nvidia.com/gpu"]}
    assert sweep() == [a.key], "only the owner whose pods changed is refreshed"
    st = fake.status_writes[-1]
    assert len(fake.status_writes) == writes + 1 and st["phase"] == "Degraded"
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InsufficientCapacity" and "Insufficient nvidia.com/gpu" in degraded["message"]
    assert sweep() == [] and len(fake.status_writes) == writes + 1, "same pods: nothing new to write"
    fake.pending = {}
    assert sweep() == [a.key] and fake.status_writes[-1]["phase"] == "Progressing"


def test_forget_drops_per_owner_memory(fake: FakeClient, rec: Reconciler) -> None:
    o = owner()
    rec.reconcile(o, lambda: fake.children(o.name))
    assert rec.applied_generation(o.key) == 1 and rec.last_status(o.key) is not None
    rec.forget(o.key)
    assert rec.applied_generation(o.key) is None and rec.last_status(o.key) is None


def test_index_reads_on_the_loop_thread_never_see_a_half_updated_index() -> None:
    """The race of issue 15: a handler thread iterated a kopf index while the loop updated it.

    Here the loop updates a kopf ``Index`` without pause while four threads take snapshots
    through ``LoopReader``; every snapshot must be whole (the entries of one update).
    """
    from kopf._core.engines.indexing import Index

    index: Index[str, int] = Index()
    errors: list[BaseException] = []
    loop = asyncio.new_event_loop()
    started = threading.Event()
    stop = threading.Event()
    holder: dict[str, LoopReader] = {}

    async def writer() -> None:
        holder["read"] = LoopReader(asyncio.get_running_loop())
        started.set()
        n = 0
        while not stop.is_set():
            n += 1
            for i in range(20):  # one "update": 20 entries of the same generation n
                index._replace(("obj", i), {"owner": n})
            index._discard(("obj", n % 20))
            index._replace(("obj", n % 20), {"owner": n})
            await asyncio.sleep(0)

    def reader() -> None:
        try:
            for _ in range(300):
                snap = holder["read"](lambda: list(index.get("owner", ())))
                assert len(snap) == 20 and len(set(snap)) == 1, snap
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    t = threading.Thread(target=lambda: loop.run_until_complete(writer()))
    t.start()
    started.wait(10)
    readers = [threading.Thread(target=reader) for _ in range(4)]
    for r in readers:
        r.start()
    for r in readers:
        r.join(60)
    stop.set()
    t.join(10)
    loop.close()
    assert errors == []


def test_status_in_kopfs_own_patch_defers_other_writers_until_it_landed(fake: FakeClient, rec: Reconciler) -> None:
    """The owner handler hands its status to kopf's patch (one write, no half-handled event);
    a child event meanwhile must not race it, and writes once the patch is seen."""
    o = owner()
    handed: list[dict[str, Any]] = []
    out = rec.reconcile(o, lambda: fake.children(o.name), status_via=handed.append)
    assert out.status_written and len(handed) == 1 and fake.status_writes == []
    dep = next(n for (k, _, n) in fake.objects if k == "Deployment")
    fake.edit("Deployment", dep, lambda d: d.__setitem__("status", {"readyReplicas": 1}))
    assert not rec.refresh(o, lambda: fake.children(o.name)) and fake.status_writes == []
    assert not rec.landed(o.key, None), "an event from before the patch changes nothing"
    assert rec.landed(o.key, 1), "the patch landed, and a child event has news"
    assert rec.refresh(o, lambda: fake.children(o.name)) and len(fake.status_writes) == 1
