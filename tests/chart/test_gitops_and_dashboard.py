"""GitOps examples point at the example manifests; the Grafana dashboard queries real metrics."""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
GITOPS = REPO / "examples" / "gitops"
DASHBOARD = REPO / "charts" / "easerve" / "files" / "dashboards" / "easerve-pipeline.json"

# Metrics the dashboard shows that the runtime does not export yet (docs/helm.md lists them; their
# panels stay empty until then). Keep this list short and honest.
PENDING_METRICS: dict[str, str] = {}


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def example_manifests() -> list[Path]:
    return sorted(p for p in (REPO / "examples").glob("*.yaml"))


def test_argocd_application_points_at_the_examples() -> None:
    (app,) = load_all(GITOPS / "argocd-application.yaml")
    assert app["apiVersion"] == "argoproj.io/v1alpha1" and app["kind"] == "Application"
    src = app["spec"]["source"]
    assert (REPO / src["path"]).is_dir()
    assert src["directory"]["recurse"] is False, "recursing would sync examples/gitops/ too"
    picked = [
        p for p in (REPO / src["path"]).iterdir() if fnmatch.fnmatch(p.name, src["directory"]["include"])
    ]
    assert {p.name for p in picked} == {p.name for p in example_manifests()}
    assert all(load_all(p)[0]["kind"] == "EPDDeployment" for p in picked)
    assert app["spec"]["destination"]["namespace"]


def test_flux_kustomization_points_at_the_examples() -> None:
    repo, ks = load_all(GITOPS / "flux-kustomization.yaml")
    assert repo["kind"] == "GitRepository" and ks["kind"] == "Kustomization"
    assert ks["spec"]["sourceRef"] == {"kind": "GitRepository", "name": repo["metadata"]["name"]}
    path = ks["spec"]["path"]
    assert (REPO / path).is_dir() and path.strip("./") == "examples"
    assert ks["spec"]["wait"] is True, "health assessment through kstatus"
    ignore = repo["spec"]["ignore"]
    assert "/examples/gitops/" in ignore, "Flux recurses: the gitops folder must be ignored"


def test_examples_carry_no_namespace_so_gitops_can_target_one() -> None:
    for p in example_manifests():
        for obj in load_all(p):
            assert "namespace" not in obj["metadata"], f"{p.name} hard-codes a namespace"


def _exprs(dash: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def _exported_sample_names() -> set[str]:
    """What the runtime's processes export, and what the operator exports (its default registry)."""
    import prometheus_client
    from easerve_operator.reconcile import metrics as operator_metrics  # registers the operator's
    from easerve_runtime.metrics import Metrics

    del operator_metrics
    names: set[str] = set()
    operator = [f for f in prometheus_client.REGISTRY.collect() if f.name.startswith("easerve_operator_")]
    assert operator, "the operator's metrics are registered"
    for fam in [*Metrics().registry.collect(), *operator]:
        if fam.type == "counter":
            names |= {f"{fam.name}_total"}
        elif fam.type == "histogram":
            names |= {f"{fam.name}_bucket", f"{fam.name}_sum", f"{fam.name}_count"}
        else:
            names.add(fam.name)
    return names


def test_dashboard_has_the_pipeline_panels() -> None:
    dash = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for topic in (
        "throughput per stage",
        "queue depth",
        "encode batch size",
        "dispatch reasons",
        "offload ratio",
        "sm split",
        "ttft p99",
        "tpot p99",
        "goodput",
        "operator reconciles",
        "has trials by outcome",
        "has searches",
    ):
        assert topic in titles, f"no panel about {topic}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert dash["uid"] == "easerve-pipeline"


def test_dashboard_queries_metrics_the_runtime_exports() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exported = _exported_sample_names()
    used = set()
    for title, expr in _exprs(dash):
        assert expr.count("(") == expr.count(")"), f"{title}: unbalanced parentheses in {expr}"
        for name in re.findall(r"\b(easerve_[a-z0-9_]+)", expr):
            used.add(name)
            assert name in exported or name in PENDING_METRICS, f"{title}: {name} is not an exported metric"
    assert used - set(PENDING_METRICS), "the dashboard must mostly show metrics that exist"
    assert not set(PENDING_METRICS) & exported, "a pending metric is exported now: drop it from the list"
    # labels the PodMonitor adds are what the template variables filter on
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "deployment"} <= variables
