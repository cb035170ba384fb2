"""`easerve crd`: print the CRD generated from the models; `easerve crd apply` installs or upgrades it.

Helm never upgrades the CRDs in a chart's ``crds/`` folder, so users upgrade (or roll back)
the CRD with ``easerve crd apply``, which uses server-side apply with our own field manager:
re-applying the same CRD changes nothing, and fields owned by other managers are left alone.
"""

from __future__ import annotations

import argparse
import sys

HELP = "print the EPDDeployment CRD generated from the models (or apply it: `easerve crd apply`)"
FIELD_MANAGER = "easerve-crd"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        nargs="?",
        choices=["print", "apply", "docs"],
        default="print",
        help="print (default) the CRD YAML; apply it with server-side apply; or print the docs/api.md field reference",
    )
    parser.add_argument("--kubeconfig", help="kubeconfig for `apply` (default: $KUBECONFIG or in-cluster)")
    parser.add_argument(
        "--force-conflicts",
        action="store_true",
        help="take ownership of fields another manager set (server-side apply force)",
    )
    parser.add_argument(
        "--wait", type=float, default=30.0, help="seconds to wait for the CRD to be Established"
    )


def apply_crd(kubeconfig: str | None = None, force: bool = False, wait_s: float = 30.0) -> str:
    """Server-side apply the CRD; return the resourceVersion once it is Established."""
    import time

    from kubernetes import client, config

    from easerve_operator.api.crd import build_crd

    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig)
    else:
        try:
            config.load_kube_config()
        except Exception:  # noqa: BLE001 - fall back to the pod's service account
            config.load_incluster_config()
    api = client.ApiextensionsV1Api()
    crd = build_crd()
    name = crd["metadata"]["name"]
    api.patch_custom_resource_definition(
        name,
        crd,
        field_manager=FIELD_MANAGER,
        force=force,
        _content_type="application/apply-patch+yaml",
        _preload_content=False,
    )
    deadline = time.monotonic() + wait_s
    while True:
        obj = api.read_custom_resource_definition(name)
        conds = {c.type: c.status for c in (obj.status.conditions or [])}
        if conds.get("Established") == "True":
            return str(obj.metadata.resource_version)
        if time.monotonic() > deadline:
            raise TimeoutError(f"CRD {name} not Established after {wait_s}s: {conds}")
        time.sleep(0.2)


def run(args: argparse.Namespace) -> int:
    from easerve_operator.api.crd import crd_yaml

    if args.action == "print":
        sys.stdout.write(crd_yaml())
        return 0
    if args.action == "docs":
        from easerve_operator.api.reference import field_reference

        sys.stdout.write(field_reference())
        return 0
    from kubernetes.client.exceptions import ApiException

    try:
        rv = apply_crd(args.kubeconfig, args.force_conflicts, args.wait)
    except ApiException as exc:
        if exc.status == 409:
            print("error: another field manager (e.g. Helm, which installed the CRD) owns fields of the CRD.\n"
                  "Re-run with --force-conflicts to take them over (see docs/upgrade.md).", file=sys.stderr)
            return 1
        print(f"error: applying the CRD failed: {exc.status} {exc.reason}", file=sys.stderr)
        return 1
    print(
        f"customresourcedefinition.apiextensions.k8s.io/epddeployments.easerve.io serverside-applied (rv {rv})"
    )
    return 0
