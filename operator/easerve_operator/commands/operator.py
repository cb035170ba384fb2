"""`easerve operator`: run the kopf operator that reconciles EPDDeployments.

By default it watches every namespace (``--namespace`` restricts it to some). It runs
standalone: one replica, no kopf peering objects (documented in docs/operator.md). The
validating webhook is served when ``--webhook-port`` is given; with no certificate supplied, a
self-signed one (SAN = the webhook host) is generated with openssl, because kopf's own
certificate builder cannot parse OpenSSL 3.0.x versions on Debian bookworm.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import subprocess
import tempfile

HELP = "run the EPDDeployment operator (kopf)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable); default: all namespaces",
    )
    parser.add_argument(
        "--webhook-port", type=int, default=0, help="serve the validating webhook on this port (0: off)"
    )
    parser.add_argument(
        "--webhook-host",
        default="127.0.0.1",
        help="address the API server uses to reach the webhook (also the bind address)",
    )
    parser.add_argument(
        "--webhook-cert", help="PEM certificate for the webhook (default: generate a self-signed one)"
    )
    parser.add_argument("--webhook-key", help="PEM private key for the webhook")
    parser.add_argument("--metrics-port", type=int, default=9100, help="Prometheus metrics port (0: off)")
    parser.add_argument(
        "--health-port", type=int, default=8080, help="liveness endpoint /healthz port (0: off)"
    )
    parser.add_argument("--bind", default="0.0.0.0", help="bind address of the metrics and health endpoints")
    parser.add_argument("--worker-limit", type=int, default=0,
                        help="most objects handled at once (bounds memory during bursts; 0: unlimited)")
    parser.add_argument(
        "--discovery-etcd-endpoints",
        default=os.environ.get("EASERVE_DISCOVERY_ETCD_ENDPOINTS") or None,
        help="etcd endpoints for Dynamo discovery, passed into every pod whose spec uses etcd discovery "
        "without naming endpoints (default: $EASERVE_DISCOVERY_ETCD_ENDPOINTS; the chart sets it)",
    )
    parser.add_argument(
        "--prometheus-url",
        default=os.environ.get("EASERVE_PROMETHEUS_URL") or None,
        help="the Prometheus that scores HAS trials on the cluster (spec.tuning.trials: cluster) when a spec "
        "names no spec.observability.prometheusUrl (default: $EASERVE_PROMETHEUS_URL; the chart sets it)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def self_signed(host: str, directory: str) -> tuple[str, str]:
    """A CA-capable self-signed certificate whose SAN carries ``host`` (kopf sends it as caBundle)."""
    cert, key = os.path.join(directory, "webhook.crt"), os.path.join(directory, "webhook.key")
    try:
        ipaddress.ip_address(host)
        san = f"subjectAltName=IP:{host},DNS:localhost"
    except ValueError:
        san = f"subjectAltName=DNS:{host},DNS:localhost"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-sha256",
            "-days",
            "365",
            "-keyout",
            key,
            "-out",
            cert,
            "-subj",
            f"/CN={host}",
            "-addext",
            san,
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,digitalSignature,keyEncipherment,keyCertSign",
            "-addext",
            "extendedKeyUsage=serverAuth",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import kopf
    from prometheus_client import start_http_server

    from easerve_operator.reconcile import handlers, tuning  # noqa: F401 - registers the HAS daemon

    handlers.OPTIONS.worker_limit = max(0, args.worker_limit)
    handlers.OPTIONS.namespaces = list(args.namespace)  # the children's informer watches the same scope
    from easerve_operator.reconcile.defaults import OperatorDefaults

    handlers.OPTIONS.defaults = OperatorDefaults(
        discovery_etcd_endpoints=args.discovery_etcd_endpoints, prometheus_url=args.prometheus_url
    )

    if args.webhook_port:
        cert, key = args.webhook_cert, args.webhook_key
        if not cert:
            cert, key = self_signed(args.webhook_host, tempfile.mkdtemp(prefix="easerve-webhook-"))
        handlers.enable_webhook(args.webhook_host, args.webhook_port, cert, key)
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.bind)
    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=f"http://{args.bind}:{args.health_port}/healthz" if args.health_port else None,
    )
    return 0
