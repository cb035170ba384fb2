"""Prometheus metrics of the omni-colocated path, all prefixed ``easerve_omni_``.

Defined here (not in ``easerve_runtime.metrics``) because only the omni worker records them; each
``OmniMetrics`` owns its own registry so several servers in one test process never collide.
The runtime engineer may fold them into ``metrics.py`` later: the names are the contract.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

FIRST_RESPONSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


class OmniMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.first_response = Histogram(
            "easerve_omni_first_response_seconds",
            "First-response latency by class (TTFT text, TTFO audio, end-to-end image), queueing included.",
            ["cls"],
            buckets=FIRST_RESPONSE_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "easerve_omni_requests", "First responses by class and SLO outcome.", ["cls", "slo"], registry=r
        )
        self.attainment = Gauge(
            "easerve_omni_slo_attainment",
            "Fraction of first responses within the class SLO.",
            ["cls"],
            registry=r,
        )
        self.slo_seconds = Gauge("easerve_omni_slo_seconds", "The class SLO in force.", ["cls"], registry=r)
        self.rotation_n = Gauge("easerve_omni_rotation_n", "Current short-path phase count N.", registry=r)
        self.hidden = Histogram(
            "easerve_omni_hidden_per_step",
            "Requests hidden from the base scheduler per shared-stage step.",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.sm_cap = Gauge("easerve_omni_sm_cap", "Shared-stage SM cap chosen by the throttle.", registry=r)
        self.bw_ewma = Gauge(
            "easerve_omni_bandwidth_ewma", "EWMA of the memory-activity signal (%).", registry=r
        )
        self._ok: dict[str, int] = {}
        self._n: dict[str, int] = {}

    def first(self, cls: str, latency_s: float, slo_s: float) -> None:
        met = latency_s <= slo_s
        self.first_response.labels(cls).observe(latency_s)
        self.requests.labels(cls, "met" if met else "missed").inc()
        self._n[cls] = self._n.get(cls, 0) + 1
        self._ok[cls] = self._ok.get(cls, 0) + int(met)
        self.attainment.labels(cls).set(self._ok[cls] / self._n[cls])

    def step(self, n: int, hidden: int, sm_cap: int, bw_ewma: float) -> None:
        self.rotation_n.set(n)
        self.hidden.observe(hidden)
        self.sm_cap.set(sm_cap)
        self.bw_ewma.set(bw_ewma)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
