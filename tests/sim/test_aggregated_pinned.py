"""The twin's aggregated baseline, pinned: its numbers did not move when its iteration planning
became the shared policy (``policies.aggregated``) that the live aggregated worker runs too.

The digests were taken from the twin BEFORE the refactor (commit "tests: pin the twin's
aggregated baseline"); every record's first-token and finish times must match bit for bit.
"""

from __future__ import annotations

import hashlib

import pytest
from easerve_runtime.sim.aggregated import AggregatedReplica
from easerve_runtime.sim.events import EventLoop
from easerve_runtime.sim.latency import StageModel
from easerve_runtime.sim.runner import cached_model
from easerve_runtime.sim.stages import Job
from easerve_runtime.sim.systems import simulate_system
from easerve_runtime.workload import generate
from toy import ToyProfile


def _digest(records) -> str:
    rows = [(x.id, x.first_token_s, x.finish_s) for x in sorted(records, key=lambda x: x.id)]
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]


PINNED = [
    # (model, rate, n, seed, (tp, replicas, token budget), digest, iterations)
    ("toy", 3.0, 200, 5, (2, 4, 512), "dd86db1b5b65182a", 17889),
    ("toy", 6.0, 300, 7, (2, 2, 2048), "5f91a52db0b63264", 4132),
    ("toy", 2.0, 150, 3, (1, 1, 8192), "02e9a847b298f539", 2380),
    ("profile", 3.0, 200, 5, (2, 4, 512), "2b0625021c51939e", 4993),
    # saturated: admission waits for KV memory (an unbounded capacity gives other numbers)
    ("profile", 6.0, 300, 7, (2, 2, 2048), "3a449bae1fe6806e", 1076),
    ("profile", 2.0, 150, 3, (1, 1, 8192), "c62bacfdd97c77d5", 19200),
]


@pytest.mark.parametrize(("which", "rate", "n", "seed", "layout", "digest", "iterations"), PINNED)
def test_aggregated_twin_results_are_unchanged(llava_spec, which, rate, n, seed, layout, digest, iterations) -> None:
    model = StageModel(ToyProfile()) if which == "toy" else cached_model(llava_spec)
    r = simulate_system(llava_spec, generate(llava_spec, rate, n, seed=seed), "aggregated", model, layout=layout)
    assert r.summary["completed"] == n
    assert r.stats["iterations"] == iterations
    assert _digest(r.records) == digest


def test_aggregated_replica_sequence_cap_is_unchanged(llava_spec) -> None:
    """A replica capped at 4 sequences (vLLM's max_num_seqs): admission waits on the cap."""
    model = StageModel(ToyProfile())
    loop = EventLoop()
    rep = AggregatedReplica(loop, model, 1, "r", token_budget=1024, max_seqs=4)
    jobs = [Job(q) for q in generate(llava_spec, 8.0, 120, seed=11)]
    for j in jobs:
        loop.at(j.req.arrival_s, rep.arrive, j)
    loop.run()
    assert rep.iterations == PINNED_CAP[1]
    assert _digest([j.rec for j in jobs]) == PINNED_CAP[0]


PINNED_CAP = ("69b6ca38920cb25d", 3835)
