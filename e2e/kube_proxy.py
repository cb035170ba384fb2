"""A test companion that PLAYS KUBE-PROXY for the local control plane (e2e only).

The local control plane has no kube-proxy and no cluster network, so a Service's ClusterIP
(10.96.a.b) leads nowhere. This companion makes each Service reachable the way kube-proxy's old
userspace mode did: it listens on a local address per Service port and forwards every TCP connection
to one of the Service's READY endpoints (pods that match its selector and are Ready: the endpoints
controller's rule, computed here because the Endpoints API refuses loopback pod IPs; see `_sync`),
round-robin, trying the next endpoint when a connect fails.

Addresses: the ClusterIP's low 16 bits on a loopback /16 of its own, ``127.<octet>.a.b:port`` for
ClusterIP ``10.96.a.b`` (``octet`` is the kubelet harness's pod octet + 100, so pod IPs 127.P.x.y and
Service addresses never overlap, and two clusters on one machine do not collide). `address(ns, name,
port)` and `url(ns, name, port)` return it; headless Services (clusterIP None) get no listener, as
with kube-proxy. Only TCP.

DNS: a cluster resolves ``<service>.<namespace>.svc.cluster.local`` (and ``<service>.<namespace>.svc``,
``<service>.<namespace>``) through kube-dns; here there is none. With ``hosts_file``, this companion
keeps a hosts file of those names -> the Service's address, and the process runner binds it over each
container's ``/etc/hosts`` (its own mount namespace), so a pod reaches a Service by name as it would
on a cluster (a load Job -> ``http://<trial>-encode.<ns>.svc:8000``). The file is rewritten in place
(same inode: a bind mount keeps pointing at it), only when the set of Services changes; the host's own
``/etc/hosts`` lines come first, so ``localhost`` still resolves.

Use: ``p = KubeProxy(kubeconfig, octet=...).start(); p.url("default", "llava-v1-6-34b-encode", 8000)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import socket
import struct
import threading
import time
from typing import Any

log = logging.getLogger("kube_proxy")


def _target_port(pod: dict[str, Any], target: Any) -> int | None:
    if isinstance(target, int) or (isinstance(target, str) and target.isdigit()):
        return int(target)
    for c in pod["spec"].get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == target:
                return int(p["containerPort"])
    return None


HOSTS_HEADER = "# written by the kube-proxy stand-in (e2e/kube_proxy.py): Service names of the local cluster\n"


def hosts_text(rows: list[str]) -> str:
    """The host's /etc/hosts, then one line per Service."""
    try:
        base = open("/etc/hosts").read()  # noqa: SIM115 - small file, read once per change
    except OSError:
        base = "127.0.0.1\tlocalhost\n"
    if not base.endswith("\n"):
        base += "\n"
    return base + HOSTS_HEADER + "".join(r + "\n" for r in rows)


def write_in_place(path: str, text: str) -> None:
    """Overwrite ``path`` keeping its inode (bind mounts of it see the new content)."""
    data = text.encode()
    with open(path, "r+b" if os.path.exists(path) else "wb") as f:
        f.write(data)
        f.truncate(len(data))


class KubeProxy:
    """Service address -> ready endpoints, forwarded per connection (see the module docstring)."""

    def __init__(
        self, kubeconfig: str, octet: int | None = None, resync_s: float = 0.5, hosts_file: str | None = None
    ) -> None:
        self.kubeconfig = kubeconfig
        self.hosts_file = hosts_file
        self._hosts = ""
        self.listeners: list[Any] = []
        """Called with (services, pods) after each sync: one list of each serves every stand-in."""
        self.octet = (octet if octet is not None else 30) + 100
        self.resync_s = resync_s
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._servers: dict[tuple[str, str, int], tuple[str, asyncio.AbstractServer]] = {}
        self._table: dict[tuple[str, str, int], list[tuple[str, int]]] = {}  # service port -> ready endpoints
        self._rr: dict[tuple[str, str, int], itertools.count[int]] = {}
        self._stop = threading.Event()
        self._synced = threading.Event()
        self.connections = 0
        self.connect_failures = 0

    # ------------------------------------------------------------------ public
    def service_address(self, cluster_ip: str) -> str:
        parts = cluster_ip.split(".")
        return f"127.{self.octet}.{parts[2]}.{parts[3]}"

    def address(self, namespace: str, name: str, port: int, timeout: float = 30.0) -> tuple[str, int]:
        """Where this Service port is reachable (waits until its listener exists)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = self._servers.get((namespace, name, port))
            if hit is not None:
                return hit[0], port
            time.sleep(0.1)
        raise TimeoutError(f"service {namespace}/{name}:{port} has no proxy listener (no ClusterIP?)")

    def url(self, namespace: str, name: str, port: int, timeout: float = 30.0) -> str:
        host, p = self.address(namespace, name, port, timeout)
        return f"http://{host}:{p}"

    def ready_endpoints(self, namespace: str, name: str, port: int) -> list[tuple[str, int]]:
        """The endpoints a new connection to this Service port may go to now."""
        return list(self._table.get((namespace, name, port), []))

    def routes(self, namespace: str) -> list[tuple[str, int, list[tuple[str, int]], bool]]:
        """Each Service port of ``namespace`` this proxy knows: its name, port, ready endpoints, and
        whether its listener exists (a failed test's report says where connections went)."""
        table, servers = self._table, set(self._servers)  # the sync thread rebinds and edits them
        return [(svc, port, list(eps), (ns, svc, port) in servers)
                for (ns, svc, port), eps in sorted(table.items()) if ns == namespace]

    def start(self, timeout: float = 30.0) -> KubeProxy:
        self._thread = threading.Thread(target=self._run, name="kube-proxy", daemon=True)
        self._thread.start()
        if not self._synced.wait(timeout):
            raise TimeoutError("kube proxy could not list Services")
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> KubeProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ sync (list every resync_s)
    def _run(self) -> None:
        from kubernetes import client, config

        api = config.new_client_from_config(config_file=self.kubeconfig)
        core = client.CoreV1Api(api)
        asyncio.set_event_loop(self._loop)
        try:
            while not self._stop.is_set():
                try:
                    self._loop.run_until_complete(self._sync(core))
                    self._synced.set()
                except Exception as e:  # noqa: BLE001 - keep proxying through apiserver hiccups
                    log.warning("kube proxy sync failed: %s", e)
                self._loop.run_until_complete(asyncio.sleep(self.resync_s))
        finally:
            for _, srv in self._servers.values():
                srv.close()
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    async def _sync(self, core: Any) -> None:
        """Polled, not watched: a few dozen Services and pods on a test cluster cost a few ms per list,
        and a poll has no watch to lose. Endpoints change within `resync_s`.

        Endpoints are computed here from the pods, with the endpoints controller's rule (pods that
        match the selector, Ready, not terminating, with a pod IP; ``targetPort`` by number or by
        container-port name), because the Endpoints API refuses the loopback pod IPs the kubelet
        harness hands out ("may not be in the loopback range"): the v1 Endpoints objects stay empty."""
        svcs = json.loads(core.list_service_for_all_namespaces(_preload_content=False).data)["items"]
        pods = json.loads(core.list_pod_for_all_namespaces(_preload_content=False).data)["items"]
        by_ns: dict[str, list[dict[str, Any]]] = {}
        for p in pods:
            st = p.get("status") or {}
            ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
            if ready and st.get("podIP") and not p["metadata"].get("deletionTimestamp"):
                by_ns.setdefault(p["metadata"]["namespace"], []).append(p)
        table: dict[tuple[str, str, int], list[tuple[str, int]]] = {}
        want: dict[tuple[str, str, int], str] = {}
        for s in svcs:
            md, spec = s["metadata"], s.get("spec") or {}
            ip = spec.get("clusterIP")
            if not ip or ip == "None":
                continue
            selector = spec.get("selector") or {}
            members = [
                p for p in by_ns.get(md["namespace"], [])
                if selector and all((p["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())
            ]
            for port in spec.get("ports") or []:
                if port.get("protocol", "TCP") != "TCP":
                    continue
                key = (md["namespace"], md["name"], int(port["port"]))
                want[key] = self.service_address(ip)
                target = port.get("targetPort", port["port"])
                addrs = []
                for p in members:
                    tp = _target_port(p, target)
                    if tp is not None:
                        addrs.append((p["status"]["podIP"], tp))
                table[key] = sorted(addrs)
        self._table = table
        self._write_hosts(svcs)
        for fn in list(self.listeners):
            try:
                fn(svcs, pods)
            except Exception as e:  # noqa: BLE001 - a listener never stops the proxy
                log.warning("kube proxy listener failed: %s", e)
        for key in [k for k in self._servers if k not in want or self._servers[k][0] != want[k]]:
            _, srv = self._servers.pop(key)
            srv.close()
        for key, host in want.items():
            if key in self._servers:
                continue
            try:
                srv = await asyncio.start_server(
                    lambda r, w, key=key: self._forward(key, r, w), host, key[2], reuse_address=True
                )
            except OSError as e:
                log.warning("kube proxy cannot listen on %s:%d for %s/%s: %s", host, key[2], key[0], key[1], e)
                continue
            self._servers[key] = (host, srv)
            self._rr[key] = itertools.count()

    def _write_hosts(self, svcs: list[dict[str, Any]]) -> None:
        if self.hosts_file is None:
            return
        rows = []
        for s in svcs:
            md, ip = s["metadata"], (s.get("spec") or {}).get("clusterIP")
            if ip and ip != "None":
                n, ns = md["name"], md["namespace"]
                rows.append(f"{self.service_address(ip)}\t{n}.{ns}.svc.cluster.local {n}.{ns}.svc {n}.{ns}")
        text = hosts_text(sorted(rows))
        if text != self._hosts:
            write_in_place(self.hosts_file, text)
            self._hosts = text

    # ------------------------------------------------------------------ forwarding
    async def _forward(self, key: tuple[str, str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        targets = self._table.get(key, [])
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        if targets:
            start = next(self._rr[key])
            for i in range(len(targets)):
                host, port = targets[(start + i) % len(targets)]
                try:
                    up = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
                    break
                except (OSError, TimeoutError):
                    self.connect_failures += 1
        if up is None:
            # no ready endpoint: kube-proxy's REJECT rule refuses the connection; the closest a
            # listener that already accepted can come is a reset (SO_LINGER 0), not a quiet close
            # that a client would read as a server that took the request and dropped it
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.close()
            return
        ur, uw = up

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while chunk := await src.read(65536):
                    dst.write(chunk)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                with contextlib.suppress(OSError, RuntimeError):
                    if dst.can_write_eof():
                        dst.write_eof()

        try:
            await asyncio.gather(pipe(reader, uw), pipe(ur, writer))
        finally:
            for w in (writer, uw):
                with contextlib.suppress(Exception):
                    w.close()
