"""One topology: the renderer, the local launcher and the twin run the layout ``plan`` decides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from easerve_operator.render import render_children
from easerve_runtime.api import Allocation, SpecError, Stage, StageAllocation, load_manifest
from easerve_runtime.sim.runner import cached_model
from easerve_runtime.sim.twin import run_pipeline
from easerve_runtime.sim.twin import topology as twin_topology
from easerve_runtime.topology import Hardware, frontends_for, local_prefill_in_encode, plan
from easerve_runtime.workers.launcher import plan as launcher_plan
from easerve_runtime.workload import generate

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
DISAGGREGATED = [p for p in EXAMPLES if "omni" not in p.stem]


def _variants(path: Path) -> list[Any]:
    """The example, and the same on an H200 (the backbone fits one GPU: local prefill TP1)."""
    _, spec = load_manifest(path)
    gpu = spec.engine.profile.split("@")[0] + "@h200"
    h200 = spec.model_validate({**spec.wire(), "engine": {**spec.engine.wire(), "profile": gpu}})
    s05 = spec.model_validate({**spec.wire(), "offload": {"ratio": 0.5}, "smPartition": {"mode": "dynamic"}})
    return [spec, h200, s05]


@pytest.mark.parametrize("path", DISAGGREGATED, ids=lambda p: p.stem)
def test_renderer_and_launcher_run_the_topologys_processes(path: Path) -> None:
    for spec in _variants(path):
        topo = plan(spec)
        kids = render_children("x", "ns", "u", spec)
        deps = {d["metadata"]["labels"]["easerve.io/stage"]: d for d in kids if d["kind"] == "Deployment"}
        assert list(deps) == [str(p.stage) for p in topo.pods]
        for pod in topo.pods:
            dep = deps[str(pod.stage)]
            assert dep["spec"]["replicas"] == pod.replicas
            containers = dep["spec"]["template"]["spec"]["containers"]
            assert [(c["name"], c["args"]) for c in containers] == [(p.name, list(p.argv)) for p in pod.processes]
        expected = sorted((r, p.name) for pod, r in topo.replicas() for p in pod.processes)
        procs = launcher_plan(spec, 8000)
        assert sorted((p.pod, p.name) for p in procs) == expected
        # the partition controllers the pods run are started locally too, on host-unique GPUs
        pcs = [p for p in procs if p.stage == Stage.PARTITION_CONTROLLER]
        n_pc = sum(len(pod.process(Stage.PARTITION_CONTROLLER)) * pod.replicas for pod in topo.pods)
        assert len(pcs) == n_pc and len({p.partition_gpus[0] for p in pcs}) == n_pc
        if n_pc:
            enc = {g for p in procs if p.stage == Stage.ENCODE for g in p.partition_gpus}
            lp = {g for p in procs if p.stage == Stage.LOCAL_PREFILL for g in p.partition_gpus}
            assert enc == lp == {p.partition_gpus[0] for p in pcs}
        assert [p.stage for p in procs][-1] == Stage.FRONTEND  # clients after their servers
        ports = [p.system_port for p in procs if p.system_port is not None]
        assert len(ports) == len(set(ports))
        # GPU placement: every GPU the topology requests is owned by exactly one local process, a
        # sharer (local prefill) sits on GPUs its pod's encode workers own, the frontend on none
        owned = [g for p in procs if p.stage in (Stage.ENCODE, Stage.PREFILL, Stage.DECODE) for g in p.gpus]
        assert sorted(owned) == list(range(spec.allocation.gpus))
        for lp in (p for p in procs if p.stage == Stage.LOCAL_PREFILL):
            assert set(lp.gpus) <= {g for p in procs if p.stage == Stage.ENCODE and p.pod == lp.pod for g in p.gpus}
        assert all(not p.gpus for p in procs if p.stage == Stage.FRONTEND)


@pytest.mark.parametrize("path", DISAGGREGATED, ids=lambda p: p.stem)
def test_each_frontend_admits_its_share_of_the_frontends_the_operator_renders(path: Path) -> None:
    """The frontend runs in the encode pod; with local prefill of TP k an encode pod holds k encode
    GPUs, so a frontend's share of the capacity is over the encode *pods* the operator renders, not
    the encode GPUs (issue 13: counting GPUs halved a TP-2 trial's door and it refused 4x the twin)."""
    for spec in _variants(path):
        kids = render_children("x", "ns", "u", spec)
        rendered = sum(
            d["spec"]["replicas"] for d in kids if d["kind"] == "Deployment"
            and any(c["name"] == "frontend" for c in d["spec"]["template"]["spec"]["containers"])
        )
        assert rendered >= 1 and frontends_for(spec) == rendered
        if plan(spec).local_prefill_tp > 1:  # pods of several encode GPUs: fewer frontends than GPUs
            assert frontends_for(spec) < spec.allocation.encode.replicas


def test_launcher_wraps_gpus_onto_a_smaller_host() -> None:
    from easerve_runtime.workers.launcher import visible_devices

    assert visible_devices([2, 3], 8) == "2,3"
    assert visible_devices([2, 3], 2) == "0,1"
    assert visible_devices([1, 3], 2) == "1"  # both wrap onto GPU 1: listed once


@pytest.mark.parametrize("path", DISAGGREGATED, ids=lambda p: p.stem)
def test_twin_follows_the_same_layout(path: Path) -> None:
    for spec in _variants(path):
        model = cached_model(spec)
        topo = twin_topology(spec, model)
        assert topo == plan(spec), "the twin and the pods disagree on the layout"
        if spec.has_local_prefill:
            # one local prefill worker of the backbone's TP per encode pod of that many GPUs
            assert topo.local_prefill_tp == model.min_tp()
            enc = topo.pod(Stage.ENCODE)
            assert len(enc.process(Stage.ENCODE)) == topo.local_prefill_tp
            (lp,) = enc.process(Stage.LOCAL_PREFILL)
            assert lp.tp == topo.local_prefill_tp and lp.gpus == 0
            assert lp.shares == tuple(g for p in enc.process(Stage.ENCODE) for g in p.owns)
        assert topo.gpus == spec.allocation.gpus


def test_leftover_encode_gpus_are_refused_by_every_side() -> None:
    """3 encode GPUs with a TP2 local prefill: one GPU would have no local partner in its pod."""
    _, spec = load_manifest(REPO / "examples" / "llava-v1.6-34b.yaml")
    spec = spec.model_copy(
        update={
            "allocation": Allocation(
                encode=StageAllocation(replicas=3),
                prefill=StageAllocation(replicas=1, tensor_parallel=2),
                decode=StageAllocation(replicas=1, tensor_parallel=2),
            )
        }
    )
    match = r"spec\.allocation\.encode\.replicas"
    with pytest.raises(SpecError, match=match):
        render_children("x", "ns", "u", spec)
    with pytest.raises(SpecError, match=match):
        launcher_plan(spec, 8000)
    with pytest.raises(SpecError, match=match):
        run_pipeline(spec, generate(spec, 1.0, 3, seed=0), cached_model(spec))
    # with the whole backbone on one GPU (H200) the same allocation is fine
    h200 = spec.model_copy(update={"engine": spec.engine.model_copy(update={"profile": "llava-v1.6-34b@h200"})})
    assert plan(h200).pod(Stage.ENCODE).replicas == 3


def test_partition_controllers_start_without_nvml_in_every_mode() -> None:
    """The SM count comes from the profile's GPU, so a controller on a CPU node (sim engine) runs;
    static mode has no table to take it from."""
    _, spec = load_manifest(REPO / "examples" / "llava-v1.6-34b.yaml")
    part = spec.sm_partition.model_copy(update={"mode": "static", "static_encode_sms": 96})
    static = spec.model_copy(update={"sm_partition": part})
    for s in (spec, static):
        for pc in plan(s).pod(Stage.ENCODE).process(Stage.PARTITION_CONTROLLER):
            assert pc.argv[pc.argv.index("--total-sms") + 1] == str(cached_model(s).total_sms)


def test_no_partition_controller_without_sm_partitioning() -> None:
    """mode none: the workers never read a record, so a controller would only burn a CPU (and, on
    a machine without NVML, exit for want of an SM count)."""
    _, spec = load_manifest(REPO / "examples" / "llava-v1.6-34b.yaml")
    none = spec.model_copy(update={"sm_partition": spec.sm_partition.model_copy(update={"mode": "none"})})
    enc = plan(none).pod(Stage.ENCODE)
    assert enc.process(Stage.PARTITION_CONTROLLER) == []
    assert all(not p.partition_gpus for p in enc.processes)
    assert len(enc.process(Stage.LOCAL_PREFILL)) == 1


def test_omni_pod() -> None:
    _, spec = load_manifest(REPO / "examples" / "qwen2.5-omni.yaml")
    topo = plan(spec)
    (pod,) = topo.pods
    assert pod.stage == Stage.OMNI and pod.replicas == spec.gpu_budget and pod.gpus == 1
    assert [p.stage for p in pod.processes] == [Stage.OMNI_SHARED, Stage.OMNI_DOWNSTREAM, Stage.PARTITION_CONTROLLER]
    owner = [p for p in pod.processes if p.gpus]
    assert [p.name for p in owner] == ["omni-shared"]
    assert all(p.shares == (0,) for p in pod.processes if not p.gpus)
    pc = pod.process(Stage.PARTITION_CONTROLLER)[0]
    assert "--ladder" in pc.argv and "--total-sms" in pc.argv
    # a profile not readable here (a ConfigMap the pod mounts): the controller reads the ladder in the pod
    blind = plan(spec, Hardware()).pods[0].process(Stage.PARTITION_CONTROLLER)[0]
    assert "--config" in blind.argv and "--ladder" not in blind.argv


def test_launcher_runs_the_omni_pods_processes() -> None:
    _, spec = load_manifest(REPO / "examples" / "qwen2.5-omni.yaml")
    procs = launcher_plan(spec, 8000)
    assert [p.name for p in procs] == ["partition-controller", "omni-downstream", "omni-shared"]
    shared = procs[-1]
    assert shared.http_port == 8000 and shared.argv[-1] == "omni-shared"


@pytest.mark.parametrize("example", ["llava-v1.6-34b", "qwen2.5-omni"])
def test_an_unknown_profile_the_layout_needs_is_named(example: str) -> None:
    _, spec = load_manifest(REPO / "examples" / f"{example}.yaml")
    spec = spec.model_copy(update={"engine": spec.engine.model_copy(update={"profile": "nope@h200"})})
    with pytest.raises(SpecError, match=r"^spec\.engine\.profile: unknown .*nope@h200"):
        plan(spec)


def _with(spec: Any, backend: str, ratio: float, profile: str) -> Any:
    w = spec.wire()
    return spec.model_validate({
        **w,
        "engine": {**w["engine"], "backend": backend, "profile": profile},
        "model": {**w["model"], "path": "/models/llava"},
        "offload": {"ratio": ratio},
        "smPartition": {**w["smPartition"], "mode": "dynamic" if ratio < 1 else "none"},
        "allocation": {"encode": {"replicas": 2}, "prefill": {"replicas": 1}, "decode": {"replicas": 1}},
    })


def test_local_prefill_in_encode_is_decided_once_by_the_spec() -> None:
    """torch with local prefill: in the encode process; sim, or no local prefill: not."""
    _, spec = load_manifest(REPO / "examples" / "llava-v1.6-34b.yaml")
    assert local_prefill_in_encode(_with(spec, "torch", 0.5, "llava-v1.6-34b@h200"))
    assert local_prefill_in_encode(_with(spec, "torch", 0.0, "llava-v1.6-34b@h200"))
    assert not local_prefill_in_encode(_with(spec, "torch", 1.0, "llava-v1.6-34b@h200"))
    assert not local_prefill_in_encode(_with(spec, "sim", 0.5, "llava-v1.6-34b@h200"))
    _, omni = load_manifest(REPO / "examples" / "qwen2.5-omni.yaml")
    assert not local_prefill_in_encode(omni)


def test_spec_smpartition_localprefill_overrides_where_local_prefill_runs() -> None:
    """own-process puts the torch engine's local prefill back in a process of its own (e.g. under
    MPS, or to measure the difference); in-encode-process is refused for the sim engine, naming
    the field."""
    from easerve_runtime.api import parse_spec

    _, spec = load_manifest(REPO / "examples" / "llava-v1.6-34b.yaml")
    t = _with(spec, "torch", 0.5, "llava-v1.6-34b@h200")
    own = t.model_validate({**t.wire(), "smPartition": {**t.wire()["smPartition"], "localPrefill": "own-process"}})
    assert not local_prefill_in_encode(own)
    enc = plan(own).pod(Stage.ENCODE)
    assert [p.stage for p in enc.workers(Stage.LOCAL_PREFILL)] == [Stage.LOCAL_PREFILL]
    assert not enc.process(Stage.ENCODE)[0].hosts
    sim = _with(spec, "sim", 0.5, "llava-v1.6-34b@h200").wire()
    sim["smPartition"]["localPrefill"] = "in-encode-process"
    with pytest.raises(ValueError, match=r"spec\.smPartition\.localPrefill: in-encode-process needs"):
        parse_spec(sim)


@pytest.mark.parametrize("profile", ["llava-v1.6-34b@h200", "llava-v1.6-34b@rtx6000ada"])
def test_torch_encode_process_hosts_its_local_prefill_everywhere(profile: str) -> None:
    """No local-prefill container or process for torch: each encode process (one GPU, one pod,
    whatever TP the profile wants: torch has none) hosts it; the renderer, the launcher and the
    twin all follow; the sim spec keeps its separate local prefill process."""
    _, spec = load_manifest(REPO / "examples" / "llava-v1.6-34b.yaml")
    torch_spec = _with(spec, "torch", 0.5, profile)
    topo = plan(torch_spec)
    enc = topo.pod(Stage.ENCODE)
    assert [p.name for p in enc.processes] == ["frontend", "encode", "partition-controller"]
    assert enc.replicas == 2 and topo.local_prefill_tp == 1
    (e,) = enc.process(Stage.ENCODE)
    assert e.hosts == (Stage.LOCAL_PREFILL,) and enc.workers(Stage.LOCAL_PREFILL) == [e]
    assert "batcher:prefill-tokens" in e.policies
    (pc,) = enc.process(Stage.PARTITION_CONTROLLER)
    assert e.partition_gpus == pc.partition_gpus == (0,) and e.shm
    kids = render_children("x", "ns", "u", torch_spec)
    (dep,) = [d for d in kids if d["kind"] == "Deployment" and d["metadata"]["labels"]["easerve.io/stage"] == "encode"]
    names = [c["name"] for c in dep["spec"]["template"]["spec"]["containers"]]
    assert names == ["frontend", "encode", "partition-controller"]
    procs = launcher_plan(torch_spec, 8000)
    assert not [p for p in procs if p.stage == Stage.LOCAL_PREFILL]
    assert len([p for p in procs if p.stage == Stage.ENCODE]) == 2
    # the twin still models one local prefill worker per encode GPU (TP 1) and routes to it
    model = cached_model(torch_spec)
    assert twin_topology(torch_spec, model) == topo
    jobs, _ = run_pipeline(torch_spec, generate(torch_spec, 1.0, 20, seed=0), model)
    assert {j.route for j in jobs} == {"local", "remote"}
    # the same spec on the sim engine: its layout as before
    sim = plan(_with(spec, "sim", 0.5, profile))
    sim_enc = sim.pod(Stage.ENCODE)
    assert len(sim_enc.process(Stage.LOCAL_PREFILL)) == 1
    assert all(not p.hosts for p in sim_enc.processes)


def test_launcher_tells_the_pods_when_they_share_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``easerve serve`` on a host with fewer GPUs than the allocation places wraps the pods onto
    them and says so (``EASERVE_SHARED_GPUS``): the frontend sizes its admission queue from it."""
    import yaml
    from easerve_runtime.api import parse_spec
    from easerve_runtime.topology import SHARED_GPUS_ENV
    from easerve_runtime.workers import launcher as L

    doc = yaml.safe_load((EXAMPLES[0].parent / "llava-v1.6-34b.yaml").read_text())["spec"]
    doc["engine"] = {"backend": "torch", "profile": "llava-v1.6-34b@h200"}
    doc["model"]["path"] = str(tmp_path / "model")  # never loaded: no process is spawned
    doc["gpuBudget"], doc["allocation"] = 3, {"encode": {"replicas": 1}, "prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    spec = parse_spec(doc)
    monkeypatch.setattr(L.Launcher, "_spawn", lambda self, i: None)
    monkeypatch.setattr(L.Launcher, "_write_processes", lambda self: None)
    for host, shared in ((1, "1"), (2, "2"), (3, None), (8, None)):
        monkeypatch.setenv(L.HOST_GPUS_ENV, str(host))
        monkeypatch.delenv(SHARED_GPUS_ENV, raising=False)
        la = L.Launcher("t", spec, 0, tmp_path / str(host))
        la.start()
        assert {env.get(SHARED_GPUS_ENV) for _, env in la._cmds.values()} == {shared}


def test_launcher_caps_each_stage_under_mps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``EASERVE_MPS_SHARES`` gives each named stage's processes its SM share under MPS
    (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``) and leaves the others uncapped; a malformed value is
    refused with a message that names the variable and the part."""
    import yaml
    from easerve_runtime.api import parse_spec
    from easerve_runtime.workers import launcher as L

    doc = yaml.safe_load((EXAMPLES[0].parent / "llava-v1.6-34b.yaml").read_text())["spec"]
    doc["engine"] = {"backend": "torch", "profile": "llava-v1.6-34b@h200"}
    doc["model"]["path"] = str(tmp_path / "model")
    doc["gpuBudget"], doc["allocation"] = 3, {"encode": {"replicas": 1}, "prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    spec = parse_spec(doc)
    monkeypatch.setattr(L.Launcher, "_spawn", lambda self, i: None)
    monkeypatch.setattr(L.Launcher, "_write_processes", lambda self: None)
    monkeypatch.setenv(L.HOST_GPUS_ENV, "1")
    la = L.Launcher("t", spec, 0, tmp_path / "w", {L.MPS_SHARES_ENV: "encode=50, prefill=60"})
    la.start()
    caps = {la.procs[i].stage: env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") for i, (_, env) in la._cmds.items()}
    assert caps["encode"] == "50" and caps["prefill"] == "60"
    assert caps["decode"] is None and caps["frontend"] is None
    for bad, names in (("encoder=50", "'encoder=50'"), ("decode=0", "[1, 100]"), ("decode", "'decode'"),
                       ("decode=x", "[1, 100]")):
        with pytest.raises(ValueError, match=r"EASERVE_MPS_SHARES") as exc:
            L.mps_shares(bad)
        assert names in str(exc.value)
    assert L.mps_shares("") == {}


def test_easerve_serve_refuses_a_bad_mps_share_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    from easerve_runtime.cli import serve as cli

    path = str(EXAMPLES[0].parent / "llava-v1.6-34b.yaml")
    assert cli.main(["-f", path, "--mps-share", "encoder=85"]) == 2
    err = capsys.readouterr().err
    assert "--mps-share" in err and "'encoder=85'" in err and "EASERVE_MPS_SHARES" in err


def test_a_plan_never_hands_out_one_port_twice() -> None:
    """``free_port`` probes random ports that are free now but not reserved; the ones a plan already
    gave go in ``taken``, so a small range is used up port by port and then refused."""
    from easerve_runtime.workers.launcher import free_port

    taken: set[int] = set()
    ports = [free_port(20000, 20003, taken=taken) for _ in range(4)]
    assert sorted(ports) == [20000, 20001, 20002, 20003] and taken == set(ports)
    with pytest.raises(RuntimeError, match="no free port"):
        free_port(20000, 20003, taken=taken)
