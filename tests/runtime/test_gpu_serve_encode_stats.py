"""``gpu_serve.py`` records the encode stage of each point from the encode workers' own
``/metrics`` (micro-batches, their size, engine time against the profile, the batcher's wait):
run 16 found a P99 TTFT the twin missed that the points had no figure to place. Real processes:
``easerve serve`` of the LLaVA example (sim engine) and ``easerve bench`` against it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_serve  # noqa: E402
from easerve_runtime.workers.launcher import free_port  # noqa: E402

SPEC = REPO / "examples" / "llava-v1.6-34b.yaml"


def test_a_point_carries_its_encode_batches_from_the_workers_metrics(tmp_path: Path) -> None:
    assert gpu_serve.worker_metrics(tmp_path) == {}  # nothing serves here: no figures, no error
    srv = gpu_serve.Serve(SPEC, tmp_path, free_port(), dict(os.environ))
    try:
        srv.wait(120)
        before = gpu_serve.worker_metrics(tmp_path)
        pre_before = gpu_serve.prefill_metrics(tmp_path)
        assert before.get("batches") == 0.0  # both encode replicas answered, nothing encoded yet
        rep = gpu_serve.bench_point(srv.url, SPEC, 4.0, 12, 3, dict(os.environ), client=gpu_serve.SIM_CLIENT)
        assert rep["completed"] == 12, rep.get("errors")
        enc = gpu_serve.encode_breakdown(before, gpu_serve.worker_metrics(tmp_path))
        pre = gpu_serve.prefill_breakdown(pre_before, gpu_serve.prefill_metrics(tmp_path))
    finally:
        srv.stop()
    # every request was encoded once, in micro-batches of at most the spec's bound (8)
    assert enc["requests"] == 12 and 1 <= enc["batches"] <= 12
    assert 1.0 <= enc["requests_per_batch"] <= 8.0
    assert sum(enc["dispatch"].values()) == enc["batches"]
    assert enc["engine_ms_per_batch"] > 0 and enc["profile_ms_per_batch"] > 0
    assert abs(enc["engine_over_profile"] - enc["engine_ms_per_batch"] / enc["profile_ms_per_batch"]) < 0.01
    assert enc["queue_wait_ms_mean"] >= 0
    # and each was prefilled once, remote or local (the example offloads a share), each worker's
    # batches priced by the same profile the twin reads
    assert pre and set(pre) <= {"prefill", "local-prefill"}
    assert sum(row["requests"] for row in pre.values()) == 12
    for row in pre.values():
        assert row["engine_ms_per_batch"] > 0 and row["profile_ms_per_batch"] > 0 and row["queue_wait_ms_mean"] >= 0


def test_the_prefill_breakdown_reads_the_kv_handoff_beside_the_stages() -> None:
    """The prefill side of the KV handoff (``easerve_kv_handoff_seconds``, no stage label) is its own
    entry of a point's ``prefill`` block, the mean over the point's handoffs; a point without
    handoffs (the sim engine moves no KV) has none, and the stages' rows are as before."""
    before = {"prefill/batches": 2.0, "prefill/requests": 2.0, "prefill/engine_s": 0.1, "prefill/profile_s": 0.1,
              "kv-handoff/s": 1.0, "kv-handoff/n": 10.0}
    after = {"prefill/batches": 6.0, "prefill/requests": 8.0, "prefill/engine_s": 0.5, "prefill/profile_s": 0.4,
             "kv-handoff/s": 2.2, "kv-handoff/n": 16.0}
    out = gpu_serve.prefill_breakdown(before, after)
    assert out["kv-handoff"] == {"handoffs": 6, "ms_mean": 200.0}
    assert out["prefill"]["batches"] == 4 and out["prefill"]["requests"] == 6
    quiet = gpu_serve.prefill_breakdown(before, {**after, "kv-handoff/s": 1.0, "kv-handoff/n": 10.0})
    assert "kv-handoff" not in quiet and set(quiet) == {"prefill"}
