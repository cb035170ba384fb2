"""Live knobs in the runtime: the config follower (kubelet-style ``..data`` swap and plain
rewrites), the knob diff, and end to end: ``easerve serve`` under ``easerve bench`` load, B and s
rewritten in the config file mid-run, no request fails and the metrics show the new values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from easerve_runtime.api import RuntimeConfig, load_manifest
from easerve_runtime.policies.batcher import make_batcher
from easerve_runtime.policies.knobs import apply_knobs, diff_knobs
from easerve_runtime.policies.router import DeficitRouter
from easerve_runtime.workers.main import ConfigFollower
from serve_process import serve_process

SPEC = str(Path(__file__).with_name("spec_small.yaml"))


def _cfg(**spec_update: object) -> RuntimeConfig:
    name, spec = load_manifest(SPEC)
    return RuntimeConfig(
        name=name, namespace="t", dynamo_namespace="t-x", spec=spec.model_copy(update=spec_update)
    )


def _kubelet_write(root: Path, text: str, gen: int) -> None:
    """What a kubelet does to a ConfigMap volume: a new timestamped dir, an atomic ``..data`` swap."""
    d = root / f"..2026_{gen}"
    d.mkdir()
    (d / "config.json").write_text(text)
    tmp = root / "..data_tmp"
    tmp.symlink_to(d.name)
    os.replace(tmp, root / "..data")
    if not (root / "config.json").is_symlink():
        (root / "config.json").symlink_to("..data/config.json")


def test_follower_sees_a_kubelet_swap_and_splits_live_from_roll(tmp_path: Path) -> None:
    base = _cfg()
    _kubelet_write(tmp_path, base.to_json(), 1)
    f = ConfigFollower(str(tmp_path / "config.json"), base.spec)
    assert f.poll() is None  # nothing changed
    enc = base.spec.encode.model_copy(update={"batch_bound": 3})
    new = base.spec.model_copy(
        update={"encode": enc, "offload": base.spec.offload.model_copy(update={"ratio": 0.25})}
    )
    _kubelet_write(tmp_path, base.model_copy(update={"spec": new}).to_json(), 2)
    ch = f.poll()
    assert ch is not None and ch.encode is not None and ch.encode.batch_bound == 3
    assert ch.ratio == 0.25 and ch.roll == ()
    assert f.poll() is None  # the same version is not applied twice
    # a half-written file is skipped, then the complete one is taken
    (tmp_path / "..2026_2" / "config.json").write_text("{not json")
    assert f.poll() is None
    alloc = new.allocation.model_copy(
        update={"decode": new.allocation.decode.model_copy(update={"replicas": 1})}
    )
    _kubelet_write(
        tmp_path, base.model_copy(update={"spec": new.model_copy(update={"allocation": alloc})}).to_json(), 3
    )
    ch = f.poll()
    assert ch is not None and not ch.live and ch.roll == ("spec.allocation.decode.replicas",)


def test_s_below_one_without_a_local_worker_is_refused_not_applied() -> None:
    spec = _cfg().spec
    b = make_batcher(spec.encode)
    r = DeficitRouter(1.0)
    one = spec.model_copy(update={"offload": spec.offload.model_copy(update={"ratio": 1.0})})
    half = spec.model_copy(update={"offload": spec.offload.model_copy(update={"ratio": 0.5})})
    res = apply_knobs(b, r, diff_knobs(one, half), has_local=False, has_remote=True)
    assert r.ratio == 1.0 and res.applied == []
    assert len(res.refused) == 1 and "needs a roll" in res.refused[0] and "local prefill" in res.refused[0]
    # the other way round (a worker with a local prefill partner) is live
    res = apply_knobs(b, r, diff_knobs(one, half), has_local=True, has_remote=True)
    assert r.ratio == 0.5 and res.refused == []
    # s > 0 on a worker started with s = 0 has no remote pool
    zero = spec.model_copy(update={"offload": spec.offload.model_copy(update={"ratio": 0.0})})
    res = apply_knobs(b, DeficitRouter(0.0), diff_knobs(zero, half), has_local=True, has_remote=False)
    assert res.refused and "remote" in res.refused[0]


def _metric(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {" and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


@pytest.mark.slow
def test_b_and_s_change_under_load_without_a_failed_request(tmp_path: Path) -> None:
    env = {"EASERVE_SIM_SPEEDUP": "10", "EASERVE_SIM_BYTES_SCALE": "0.01"}
    with serve_process(Path(SPEC).read_text(), tmp_path, env, timeout_s=120) as (port, wd):
        bench_proc = None
        try:
            procs = json.loads((wd / "processes.json").read_text())["processes"]
            enc_port = next(p for p in procs if p["stage"] == "encode")["system_port"]
            url = f"http://127.0.0.1:{port}"
            n = 400
            bcmd = [
                sys.executable,
                "-m",
                "easerve_operator.cli",
                "bench",
                "--url",
                url,
                "--rate",
                "20",
                "--requests",
                str(n),
                "--seed",
                "5",
                "--output-mean",
                "4",
                "--prompt-mean",
                "16",
                "--json",
            ]
            bench_proc = subprocess.Popen(bcmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            m0 = _scrape(enc_port)
            assert (
                _metric(m0, "easerve_encode_batch_bound") == 8
                and _metric(m0, "easerve_router_offload_ratio") == 0.5
            )
            while _metric(_scrape(enc_port), "easerve_router_routed_total") < n // 4:
                assert bench_proc.poll() is None
                time.sleep(0.2)
            # rewrite B and s in the file the workers run from (atomically, as a kubelet swaps ..data)
            cfg = RuntimeConfig.from_json((wd / "config.json").read_text())
            spec = cfg.spec.model_copy(
                update={
                    "encode": cfg.spec.encode.model_copy(update={"batch_bound": 2}),
                    "offload": cfg.spec.offload.model_copy(update={"ratio": 0.25}),
                }
            )
            (wd / "config.new").write_text(cfg.model_copy(update={"spec": spec}).to_json())
            os.replace(wd / "config.new", wd / "config.json")
            while True:
                m1 = _scrape(enc_port)
                if _metric(m1, "easerve_encode_batch_bound") == 2:
                    break
                assert bench_proc.poll() is None, "the change was not applied before the run ended"
                time.sleep(0.1)
            assert _metric(m1, "easerve_router_offload_ratio") == 0.25
            assert _metric(m1, "easerve_knob_updates_total", 'outcome="applied"') == 2
            out, err = bench_proc.communicate(timeout=300)
            rep = json.loads(out)
            assert rep["completed"] == n and rep["failed"] == 0, rep.get("errors")
            m2 = _scrape(enc_port)

            def delta(name: str, labels: str = "") -> float:
                return _metric(m2, name, labels) - _metric(m1, name, labels)

            after = delta("easerve_router_routed_total")
            assert after > 0
            assert abs(delta("easerve_router_routed_total", 'route="remote"') - 0.25 * after) <= 1
            # every micro-batch after the change had at most the new B = 2 requests
            assert (
                delta("easerve_encode_batch_size_bucket", 'le="2.0"')
                == delta("easerve_encode_batch_size_count")
                > 0
            )
        finally:
            if bench_proc is not None and bench_proc.poll() is None:
                bench_proc.kill()
                bench_proc.wait()
