"""Operator-wide defaults that fill what a spec leaves unset, before rendering.

Why a hook of its own: some settings belong to the cluster, not to each EPDDeployment. The etcd
that Dynamo's discovery uses is one: the chart installs it (or points at an existing one) and the
operator passes it into every pod whose spec uses etcd discovery without naming endpoints
(``--discovery-etcd-endpoints`` / ``EASERVE_DISCOVERY_ETCD_ENDPOINTS``). A spec that names its own
endpoints keeps them. The cluster's Prometheus is another: cluster HAS trials are scored there
unless the spec names its own (``--prometheus-url`` / ``EASERVE_PROMETHEUS_URL``). Pure: the stored spec is never written (the operator never writes ``spec``);
the filled copy only feeds rendering, so the ConfigMap and the pods' ``ETCD_ENDPOINTS`` agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from easerve_runtime.api import DiscoveryBackend, EPDDeploymentSpec

ETCD_ENDPOINTS_ENV = "EASERVE_DISCOVERY_ETCD_ENDPOINTS"
PROMETHEUS_URL_ENV = "EASERVE_PROMETHEUS_URL"


@dataclass(frozen=True)
class OperatorDefaults:
    discovery_etcd_endpoints: str | None = None
    prometheus_url: str | None = None
    """Where cluster HAS trials are scored when a spec names no ``observability.prometheusUrl``."""


def with_operator_defaults(spec: EPDDeploymentSpec, defaults: OperatorDefaults) -> EPDDeploymentSpec:
    """``spec`` with the operator's defaults filled in where it leaves them unset."""
    d = spec.discovery
    if (
        defaults.discovery_etcd_endpoints
        and d.backend == DiscoveryBackend.ETCD
        and not d.etcd_endpoints
    ):
        disc = d.model_copy(update={"etcd_endpoints": defaults.discovery_etcd_endpoints})
        return spec.model_copy(update={"discovery": disc})
    return spec
