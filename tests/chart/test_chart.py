"""The Helm chart: lint, golden renders, schema validation of values and of every rendered manifest.

Golden files: tests/chart/golden/<case>.yaml. After an intended change, regenerate them with
``EASERVE_UPDATE_GOLDEN=1 pytest tests/chart`` and review the diff.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from local_cluster import E2E, tool

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "easerve"
GOLDEN = Path(__file__).parent / "golden"
RELEASE, NAMESPACE = "easerve", "easerve-system"
MONITORING_API = ["--api-versions", "monitoring.coreos.com/v1"]

CASES: dict[str, list[str]] = {
    "default": [],
    "namespaced": ["--set", "scope=namespace", "--set", "watchNamespace=team-a"],
    "monitoring": [
        "--set",
        "monitoring.enabled=true",
        "--set-string",
        "monitoring.labels.release=prom",
        *MONITORING_API,
    ],
}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("helm"), *args], capture_output=True, text=True, check=check, timeout=120)


def render(*args: str) -> str:
    return helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args).stdout


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {case: docs(render(*args)) for case, args in CASES.items()}


# ----------------------------------------------------------------------------- chart basics
def test_chart_crd_is_the_generated_crd() -> None:
    top = (REPO / "crds" / "epddeployments.easerve.io.yaml").read_bytes()
    copy = (CHART / "crds" / "epddeployments.easerve.io.yaml").read_bytes()
    assert copy == top, (
        "charts/easerve/crds/ differs from crds/: re-copy it with\n"
        "  cp crds/epddeployments.easerve.io.yaml charts/easerve/crds/"
    )


@pytest.mark.parametrize("binary", ["helm", "helm-3.9"])
def test_helm_lint(binary: str) -> None:
    for args in ([], CASES["namespaced"], ["--set", "monitoring.enabled=true"]):
        r = subprocess.run(
            [tool(binary), "lint", "--strict", str(CHART), *args], capture_output=True, text=True
        )
        assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_render(case: str) -> None:
    out = render(*CASES[case])
    path = GOLDEN / f"{case}.yaml"
    if os.environ.get("EASERVE_UPDATE_GOLDEN") == "1":
        path.write_text(out)
    assert path.exists(), f"missing golden file {path}: run EASERVE_UPDATE_GOLDEN=1 pytest tests/chart"
    assert out == path.read_text(), f"render of case {case!r} changed: review, then EASERVE_UPDATE_GOLDEN=1"


# ----------------------------------------------------------------------------- values schema
@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--set", "scope=everywhere"], "scope"),
        (["--set", "operator.replicas=2"], "replicas"),
        (["--set", "securityContext.readOnlyRootFilesystem=false"], "readOnlyRootFilesystem"),
        (["--set", "podSecurityContext.runAsNonRoot=false"], "runAsNonRoot"),
        (["--set", "webhook.port=70000"], "port"),
        (["--set", "image.digest=latest"], "digest"),
        (["--set", "monitoring.interval=often"], "interval"),
        (["--set", "nosuchkey=1"], "nosuchkey"),
    ],
)
def test_bad_values_are_refused_naming_the_field(args: list[str], field: str) -> None:
    r = helm("template", RELEASE, str(CHART), *args, check=False)
    assert r.returncode != 0, f"{args} was accepted"
    assert field in r.stderr, r.stderr


def test_values_yaml_satisfies_its_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.validate(yaml.safe_load((CHART / "values.yaml").read_text()), schema)


# ----------------------------------------------------------------------------- what is rendered
def test_operator_deployment_is_hardened(rendered: dict[str, list[dict[str, Any]]]) -> None:
    (dep,) = by_kind(rendered["default"], "Deployment")
    spec = dep["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["resources"]["limits"] and c["resources"]["requests"]
    assert c["args"][:2] == ["easerve", "operator"]
    assert "--webhook-host=$(POD_IP)" in c["args"]
    assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"]), "a writable /tmp is needed"
    assert pod["serviceAccountName"] == by_kind(rendered["default"], "ServiceAccount")[0]["metadata"]["name"]


def test_operator_flags_exist_in_the_operator_command(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Every flag the chart passes is one `easerve operator` accepts."""
    import argparse

    from easerve_operator.commands import operator as op

    parser = argparse.ArgumentParser()
    op.add_arguments(parser)
    known = {s for a in parser._actions for s in a.option_strings}
    for case in CASES:
        (dep,) = by_kind(rendered[case], "Deployment")
        for arg in dep["spec"]["template"]["spec"]["containers"][0]["args"][2:]:
            assert arg.split("=", 1)[0] in known, f"{arg} is not an `easerve operator` flag"


def _rules(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for o in by_kind(objs, kind) for r in o["rules"]]


def test_rbac_lists_exact_verbs_and_resources(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for case, objs in rendered.items():
        for r in _rules(objs, "ClusterRole") + _rules(objs, "Role"):
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in r[key], f"{case}: wildcard in {key}: {r}"
            assert not r.get("nonResourceURLs")
    rules = _rules(rendered["default"], "ClusterRole")
    grants = {
        (g, res, v) for r in rules for g in r["apiGroups"] for res in r["resources"] for v in r["verbs"]
    }
    assert ("easerve.io", "epddeployments/status", "patch") in grants
    assert ("apps", "deployments", "create") in grants and ("", "pods", "list") in grants
    assert ("", "secrets", "get") not in grants and ("", "pods", "create") not in grants


def test_namespaced_mode_grants_only_the_watched_namespace(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objs = rendered["namespaced"]
    cluster_resources = {res for r in _rules(objs, "ClusterRole") for res in r["resources"]}
    assert "epddeployments" not in cluster_resources and "deployments" not in cluster_resources
    (role,) = by_kind(objs, "Role")
    (binding,) = by_kind(objs, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "team-a"
    assert binding["subjects"][0]["namespace"] == NAMESPACE
    assert {res for r in role["rules"] for res in r["resources"]} >= {"epddeployments", "deployments", "pods"}
    (dep,) = by_kind(objs, "Deployment")
    assert "--namespace=team-a" in dep["spec"]["template"]["spec"]["containers"][0]["args"]


def test_monitors_only_with_the_prometheus_operator_api() -> None:
    without_api = docs(render("--set", "monitoring.enabled=true"))
    assert not by_kind(without_api, "ServiceMonitor") and not by_kind(without_api, "PodMonitor")
    disabled = docs(render(*MONITORING_API))
    assert not by_kind(disabled, "ServiceMonitor") and not by_kind(disabled, "PodMonitor")
    on = docs(render(*CASES["monitoring"]))
    (sm,) = by_kind(on, "ServiceMonitor")
    (pm,) = by_kind(on, "PodMonitor")
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    (svc,) = [s for s in by_kind(on, "Service") if "easerve.io/role" not in s["metadata"]["labels"]]
    assert svc["spec"]["ports"][0]["name"] == "metrics"
    assert pm["spec"]["selector"]["matchExpressions"][0]["key"] == "easerve.io/deployment"
    # every port the topology names a metrics port: the frontend, a worker, local prefill, and the
    # further encode workers of a pod spanning up to 8 GPUs; the local cluster's Prometheus scrapes the same
    want = {"http", "system", "system-lp", *(f"system-e{i}" for i in range(1, 8))}
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} == want
    import sys

    sys.path.insert(0, str(REPO / "e2e"))
    from local_cluster import SCRAPED_PORTS

    assert set(SCRAPED_PORTS) == want


def test_discovery_etcd_installed_or_pointed_at() -> None:
    """values discovery.etcd: the chart installs an etcd (StatefulSet + Service) and the operator gets
    its Service address, or, with `endpoints`, installs nothing and passes those endpoints."""

    def operator_env(objs: list[dict[str, Any]]) -> dict[str, str]:
        (dep,) = by_kind(objs, "Deployment")
        return {e["name"]: e.get("value", "") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}

    installed = docs(render())
    (sts,) = by_kind(installed, "StatefulSet")
    svc = next(s for s in by_kind(installed, "Service") if s["metadata"]["name"] == sts["metadata"]["name"])
    assert svc["spec"]["ports"][0]["port"] == 2379
    assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    url = f"http://{svc['metadata']['name']}.{NAMESPACE}.svc:2379"
    assert operator_env(installed)["EASERVE_DISCOVERY_ETCD_ENDPOINTS"] == url
    external = docs(render("--set", "discovery.etcd.endpoints=http://etcd.infra:2379"))
    assert not by_kind(external, "StatefulSet")
    assert operator_env(external)["EASERVE_DISCOVERY_ETCD_ENDPOINTS"] == "http://etcd.infra:2379"
    neither = docs(render("--set", "discovery.etcd.install=false"))
    assert not by_kind(neither, "StatefulSet")
    assert "EASERVE_DISCOVERY_ETCD_ENDPOINTS" not in operator_env(neither)


def test_prometheus_for_cluster_trials_reaches_the_operator() -> None:
    """values monitoring.prometheusUrl -> the operator's EASERVE_PROMETHEUS_URL (its --prometheus-url
    default); unset, none; a URL that is not http(s) is refused by the values schema."""

    def operator_env(objs: list[dict[str, Any]]) -> dict[str, str]:
        (dep,) = by_kind(objs, "Deployment")
        return {e["name"]: e.get("value", "") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}

    url = "http://prometheus-operated.monitoring:9090"
    assert operator_env(docs(render("--set", f"monitoring.prometheusUrl={url}")))["EASERVE_PROMETHEUS_URL"] == url
    assert "EASERVE_PROMETHEUS_URL" not in operator_env(docs(render()))
    with pytest.raises(subprocess.CalledProcessError):
        render("--set", "monitoring.prometheusUrl=file:///etc/passwd")


def test_webhook_off_drops_its_rbac_and_flags() -> None:
    objs = docs(render("--set", "webhook.enabled=false"))
    groups = {g for r in _rules(objs, "ClusterRole") for g in r["apiGroups"]}
    assert "admissionregistration.k8s.io" not in groups
    (dep,) = by_kind(objs, "Deployment")
    assert not [
        a for a in dep["spec"]["template"]["spec"]["containers"][0]["args"] if a.startswith("--webhook")
    ]


def test_image_by_digest() -> None:
    digest = "sha256:" + "ab" * 32
    (dep,) = by_kind(docs(render("--set", f"image.digest={digest}")), "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == f"ghcr.io/easerve/operator@{digest}"


def test_notes_tell_how_to_upgrade_the_crd(tmp_path: Path) -> None:
    # `helm install --dry-run` needs a cluster; `helm template` skips NOTES.txt. So render a copy of the
    # chart in which NOTES.txt is an ordinary template.
    import shutil

    chart = tmp_path / "easerve"
    shutil.copytree(CHART, chart)
    (chart / "files" / "notes.txt").write_text((chart / "templates" / "NOTES.txt").read_text())
    (chart / "templates" / "notes-preview.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n  notes: |\n"
        '{{ tpl (.Files.Get "files/notes.txt") . | indent 4 }}\n'
    )
    out = helm(
        "template",
        RELEASE,
        str(chart),
        "--namespace",
        NAMESPACE,
        "--show-only",
        "templates/notes-preview.yaml",
        "--set",
        "monitoring.enabled=true",
        *CASES["namespaced"],
    ).stdout
    notes = yaml.safe_load(out)["data"]["notes"]
    assert "easerve crd apply" in notes
    assert "in namespace team-a only" in notes
    assert "no monitoring.coreos.com/v1 API" in notes


# ----------------------------------------------------------------------------- Kubernetes schemas
def _schema_dir_1_20() -> Path:
    r = subprocess.run(["bash", str(E2E / "get-k8s-schemas.sh")], capture_output=True, text=True, check=True)
    return Path(r.stdout.strip().splitlines()[-1])


def _validate_with(schema_dir: Path, obj: dict[str, Any]) -> None:
    """Validate like kubernetes-validate does (strict: unknown fields are errors), from `schema_dir`."""
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT4

    group_version = obj["apiVersion"]
    group, _, version = group_version.rpartition("/")
    short = group.split(".")[0] if group else ""
    name = f"{obj['kind'].lower()}-{short + '-' if short else ''}{version}.json"
    path = schema_dir / name
    assert path.exists(), f"no Kubernetes 1.20 schema for {obj['kind']} {group_version} ({name})"

    def retrieve(uri: str) -> Resource:
        # the schemas refer to "_definitions.json" relative to their own directory
        return Resource.from_contents(json.loads((schema_dir / uri.rsplit("/", 1)[-1]).read_text()), DRAFT4)

    schema = json.loads(path.read_text())
    schema.pop("$schema", None)
    validator = jsonschema.Draft4Validator(schema, registry=Registry(retrieve=retrieve))  # type: ignore[call-arg]
    validator.validate(obj)


PROMETHEUS_KINDS = {"ServiceMonitor", "PodMonitor"}  # not Kubernetes kinds: checked structurally above


def _all_manifests() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for case, args in CASES.items():
        for obj in docs(render(*args, "--include-crds")):
            out.append((case, obj))
    for obj in docs(render("--set", "webhook.enabled=false", "--set", "dashboard.enabled=false")):
        out.append(("minimal", obj))
    return out


def test_manifests_validate_against_kubernetes_1_20() -> None:
    schema_dir = _schema_dir_1_20()
    n = 0
    for case, obj in _all_manifests():
        if obj["kind"] in PROMETHEUS_KINDS:
            continue
        try:
            _validate_with(schema_dir, obj)
        except jsonschema.ValidationError as e:
            pytest.fail(f"{case}: {obj['kind']}/{obj['metadata']['name']} invalid for 1.20: {e.message}")
        n += 1
    assert n >= 20
    # and the check is not vacuous: an unknown field and a wrong type are caught
    (dep,) = by_kind(docs(render()), "Deployment")
    for broken in (
        {**dep, "spec": {**dep["spec"], "replicaz": 1}},
        {**dep, "spec": {**dep["spec"], "replicas": "one"}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            _validate_with(schema_dir, broken)


def test_manifests_validate_against_current_kubernetes() -> None:
    import kubernetes_validate

    latest = kubernetes_validate.latest_version()
    n = 0
    for case, obj in _all_manifests():
        if obj["kind"] in PROMETHEUS_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, latest, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{case}: {obj['kind']}/{obj['metadata']['name']} invalid for {latest}: {e}")
        n += 1
    assert n >= 20
