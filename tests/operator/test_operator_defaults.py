"""The operator-wide discovery default (reconcile/defaults.py): filled only where the spec is silent."""

from __future__ import annotations

from pathlib import Path

from easerve_operator.reconcile.defaults import OperatorDefaults, with_operator_defaults
from easerve_operator.render import render_children
from easerve_runtime.api import load_manifest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llava-v1.6-34b.yaml"
URL = "http://etcd.infra:2379"


def _etcd_env(objs: list[dict]) -> set[str]:  # type: ignore[type-arg]
    out = set()
    for o in objs:
        if o["kind"] == "Deployment":
            for c in o["spec"]["template"]["spec"]["containers"]:
                out |= {e["value"] for e in c["env"] if e["name"] == "ETCD_ENDPOINTS"}
    return out


def test_fills_the_endpoint_into_every_pod_and_the_config_map() -> None:
    name, spec = load_manifest(str(EXAMPLE))
    assert spec.discovery.etcd_endpoints is None
    filled = with_operator_defaults(spec, OperatorDefaults(discovery_etcd_endpoints=URL))
    assert filled.discovery.etcd_endpoints == URL
    assert spec.discovery.etcd_endpoints is None  # the input is not changed
    objs = render_children(name, "default", "uid", filled)
    assert _etcd_env(objs) == {URL}
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    assert URL in cm["data"]["config.json"]


def test_a_spec_that_names_endpoints_or_another_backend_keeps_its_own() -> None:
    _, spec = load_manifest(str(EXAMPLE))
    own = spec.model_copy(update={"discovery": spec.discovery.model_copy(update={"etcd_endpoints": "http://mine:2379"})})
    assert with_operator_defaults(own, OperatorDefaults(URL)).discovery.etcd_endpoints == "http://mine:2379"
    k8s = spec.model_copy(update={"discovery": spec.discovery.model_copy(update={"backend": "kubernetes"})})
    assert with_operator_defaults(k8s, OperatorDefaults(URL)).discovery.etcd_endpoints is None
    assert with_operator_defaults(spec, OperatorDefaults()) is spec
