#!/bin/bash
# Start a private, loopback-only Kubernetes control plane for tests and demos:
#   etcd (Debian etcd-server 3.4) + kube-apiserver + kube-controller-manager + kube-scheduler (v1.20.2,
#   built from Debian's `kubernetes` source package by e2e/build-k8s.sh, cached in $EASERVE_CACHE/k8s/bin).
# There is no kubelet: run e2e/kubelet_harness.py to play one (it registers a fake Node and marks the
# pods bound to it Running/Ready).
#
# Environment (all optional):
#   RUN=$EASERVE_CACHE/run   state dir: pki/, etcd data, logs/, pids/, ports.env, kubeconfig
#   EASERVE_CACHE=~/.cache/easerve   where build-k8s.sh caches the binaries (K8S_BIN=$EASERVE_CACHE/k8s/bin)
#   ETCD_PORT, ETCD_PEER_PORT, API_PORT   default: free high ports chosen now (so concurrent runs by
#                            several people on one machine do not collide); written to $RUN/ports.env
#   SERVICE_CIDR=10.96.0.0/16   a /16: scale tests create 600+ ClusterIP Services (a /24 holds ~253)
#   KCM_QPS=200 KCM_BURST=400   controller-manager client rate limit (the default 20/30 makes
#                            ReplicaSets and Endpoints trail far behind a fast operator)
#   ETCD_RAM=0               1 = etcd data in /dev/shm (RAM-backed; faster on slow disks)
#   ETCD_DATA=$RUN/etcd      explicit etcd data dir (overrides ETCD_RAM)
#   KEEP_DATA=0              1 = keep etcd data from a previous run
#   WITH_KCM=1 WITH_SCHEDULER=1
#   WITH_DISCOVERY_ETCD=0    1 = also start the etcd that Dynamo's discovery uses (e2e/discovery-etcd.sh;
#                            port DISCOVERY_ETCD_PORT in ports.env; separate from the control plane's etcd)
#   WATCH_PID=            stop the cluster when this process exits (the pytest fixture passes its own)
#   WATCH_RM_RUN=0        1 = the watchdog also deletes RUN (a temp dir) after stopping the cluster
#   BUILD=1                  build the binaries with e2e/build-k8s.sh when missing (slow the first time)
# Output: $RUN/kubeconfig (admin client certificate, group system:masters); the last line printed is
# `export KUBECONFIG=...`. Stop with e2e/k8s-down.sh (same RUN).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${EASERVE_CACHE:-$HOME/.cache/easerve}
K8S_BIN=${K8S_BIN:-$CACHE/k8s/bin}
RUN=${RUN:-$CACHE/run}
mkdir -p "$RUN"
RUN=$(cd "$RUN" && pwd)
SERVICE_CIDR=${SERVICE_CIDR:-10.96.0.0/16}
KCM_QPS=${KCM_QPS:-200}
KCM_BURST=${KCM_BURST:-400}
WITH_KCM=${WITH_KCM:-1}
WITH_SCHEDULER=${WITH_SCHEDULER:-1}
KEEP_DATA=${KEEP_DATA:-0}
BUILD=${BUILD:-1}
if [ -z "${ETCD_DATA:-}" ]; then
  if [ "${ETCD_RAM:-0}" = 1 ]; then
    ETCD_DATA=/dev/shm/easerve-etcd-$(echo "$RUN" | md5sum | cut -c1-12)
  else
    ETCD_DATA=$RUN/etcd
  fi
fi
P=$RUN/pki
mkdir -p "$P" "$RUN/logs" "$RUN/pids"

for f in "$RUN"/pids/*.pid; do
  [ -e "$f" ] || continue
  if kill -0 "$(cat "$f")" 2>/dev/null; then
    echo "already running ($(basename "$f" .pid) pid $(cat "$f")); run e2e/k8s-down.sh with RUN=$RUN first" >&2
    exit 1
  fi
  rm -f "$f"
done

for c in kube-apiserver kube-controller-manager kube-scheduler; do
  if ! [ -x "$K8S_BIN/$c" ]; then
    if [ "$BUILD" = 1 ]; then
      EASERVE_CACHE=$CACHE "$HERE/build-k8s.sh"
      break
    fi
    echo "missing $K8S_BIN/$c: run e2e/build-k8s.sh (or set BUILD=1)" >&2
    exit 1
  fi
done
command -v etcd >/dev/null || { echo "etcd not found: run e2e/setup-host.sh (Debian etcd-server)" >&2; exit 1; }

# ---------- ports: free high ports unless given ----------
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ETCD_PORT=${ETCD_PORT:-$(free_port)}
ETCD_PEER_PORT=${ETCD_PEER_PORT:-$(free_port)}
API_PORT=${API_PORT:-$(free_port)}
cat > "$RUN/ports.env" <<EOF
ETCD_PORT=$ETCD_PORT
ETCD_PEER_PORT=$ETCD_PEER_PORT
API_PORT=$API_PORT
EOF

# On any failure below, stop whatever this script already started (by recorded PID).
trap 'rc=$?; [ $rc = 0 ] || RUN=$RUN "$HERE/k8s-down.sh" >/dev/null 2>&1; exit $rc' EXIT
t0=$(date +%s.%N)

# ---------- PKI (generated once per RUN dir, reused) ----------
SVC_IP=$(python3 -c "import ipaddress,sys; print(ipaddress.ip_network(sys.argv[1])[1])" "$SERVICE_CIDR")
if [ ! -f "$P/admin.crt" ] || [ "$(cat "$P/svc-ip" 2>/dev/null)" != "$SVC_IP" ]; then
  (
    cd "$P"
    openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days 3650 -keyout ca.key -out ca.crt \
      -subj "/CN=easerve-local-ca" 2>/dev/null
    cat > san.ext <<EOF
subjectAltName=IP:127.0.0.1,DNS:localhost,IP:${SVC_IP},DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
extendedKeyUsage=serverAuth
EOF
    printf 'extendedKeyUsage=clientAuth\n' > client.ext
    openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj "/CN=kube-apiserver" 2>/dev/null
    openssl x509 -req -sha256 -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile san.ext -out apiserver.crt 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr -subj "/O=system:masters/CN=admin" 2>/dev/null
    openssl x509 -req -sha256 -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile client.ext -out admin.crt 2>/dev/null
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    echo "$SVC_IP" > svc-ip
    chmod 600 ./*.key
    rm -f ./*.csr
  )
fi

# ---------- kubeconfig ----------
b64() { base64 -w0 "$1"; }
umask 077
cat > "$RUN/kubeconfig.tmp" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: easerve-local
  cluster:
    server: https://127.0.0.1:${API_PORT}
    certificate-authority-data: $(b64 "$P/ca.crt")
users:
- name: admin
  user:
    client-certificate-data: $(b64 "$P/admin.crt")
    client-key-data: $(b64 "$P/admin.key")
contexts:
- name: easerve-local
  context: {cluster: easerve-local, user: admin, namespace: default}
current-context: easerve-local
EOF
mv "$RUN/kubeconfig.tmp" "$RUN/kubeconfig"
umask 022

# ---------- etcd ----------
[ "$KEEP_DATA" = 1 ] || rm -rf "$ETCD_DATA"
echo "$ETCD_DATA" > "$RUN/etcd-data-path"
nohup etcd --name easerve --data-dir "$ETCD_DATA" \
  --listen-client-urls "http://127.0.0.1:${ETCD_PORT}" --advertise-client-urls "http://127.0.0.1:${ETCD_PORT}" \
  --listen-peer-urls "http://127.0.0.1:${ETCD_PEER_PORT}" --initial-advertise-peer-urls "http://127.0.0.1:${ETCD_PEER_PORT}" \
  --initial-cluster "easerve=http://127.0.0.1:${ETCD_PEER_PORT}" \
  --quota-backend-bytes=2147483648 --log-level=warn \
  > "$RUN/logs/etcd.log" 2>&1 < /dev/null &
echo $! > "$RUN/pids/etcd.pid"

ok=0
for _ in $(seq 1 150); do
  if curl -fsS "http://127.0.0.1:${ETCD_PORT}/health" >/dev/null 2>&1; then ok=1; break; fi
  kill -0 "$(cat "$RUN/pids/etcd.pid")" 2>/dev/null || break
  sleep 0.1
done
if [ $ok != 1 ]; then
  echo "etcd did not become healthy (port ${ETCD_PORT} taken?); see $RUN/logs/etcd.log" >&2
  tail -5 "$RUN/logs/etcd.log" >&2
  exit 1
fi
t_etcd=$(date +%s.%N)
if [ "${WITH_DISCOVERY_ETCD:-0}" = 1 ]; then
  RUN=$RUN "$HERE/discovery-etcd.sh" start >/dev/null
fi

# ---------- kube-apiserver ----------
nohup "$K8S_BIN/kube-apiserver" \
  --etcd-servers="http://127.0.0.1:${ETCD_PORT}" \
  --bind-address=127.0.0.1 --advertise-address=127.0.0.1 \
  --secure-port="${API_PORT}" --insecure-port=0 \
  --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" \
  --client-ca-file="$P/ca.crt" \
  --authorization-mode=RBAC \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$P/sa.pub" --service-account-signing-key-file="$P/sa.key" \
  --service-cluster-ip-range="$SERVICE_CIDR" \
  --endpoint-reconciler-type=none \
  --kubelet-preferred-address-types=InternalIP \
  --allow-privileged=true --profiling=false \
  --cert-dir="$RUN/apiserver-certs" \
  --v=1 \
  > "$RUN/logs/kube-apiserver.log" 2>&1 < /dev/null &
echo $! > "$RUN/pids/kube-apiserver.pid"

ok=0
for _ in $(seq 1 600); do
  if curl -fsS --cacert "$P/ca.crt" "https://127.0.0.1:${API_PORT}/readyz" >/dev/null 2>&1; then ok=1; break; fi
  kill -0 "$(cat "$RUN/pids/kube-apiserver.pid")" 2>/dev/null || break
  sleep 0.1
done
t_api=$(date +%s.%N)
if [ $ok != 1 ]; then
  echo "kube-apiserver did not become ready (port ${API_PORT} taken?); see $RUN/logs/kube-apiserver.log" >&2
  tail -20 "$RUN/logs/kube-apiserver.log" >&2
  exit 1
fi

# ---------- kube-controller-manager ----------
if [ "$WITH_KCM" = 1 ]; then
  nohup "$K8S_BIN/kube-controller-manager" \
    --kubeconfig="$RUN/kubeconfig" \
    --bind-address=127.0.0.1 --port=0 --secure-port=0 \
    --leader-elect=false \
    --kube-api-qps="$KCM_QPS" --kube-api-burst="$KCM_BURST" \
    --service-account-private-key-file="$P/sa.key" --root-ca-file="$P/ca.crt" \
    --use-service-account-credentials=false \
    --cluster-signing-cert-file="$P/ca.crt" --cluster-signing-key-file="$P/ca.key" \
    --controllers='*,-nodeipam,-nodelifecycle,-cloud-node-lifecycle,-service,-route,-attachdetach,-persistentvolume-binder,-persistentvolume-expander,-pv-protection,-pvc-protection,-ttl,-bootstrapsigner,-tokencleaner' \
    --v=1 \
    > "$RUN/logs/kube-controller-manager.log" 2>&1 < /dev/null &
  echo $! > "$RUN/pids/kube-controller-manager.pid"
fi

# ---------- kube-scheduler ----------
if [ "$WITH_SCHEDULER" = 1 ]; then
  nohup "$K8S_BIN/kube-scheduler" \
    --kubeconfig="$RUN/kubeconfig" \
    --bind-address=127.0.0.1 --port=0 --secure-port=0 \
    --kube-api-qps="$KCM_QPS" --kube-api-burst="$KCM_BURST" \
    --leader-elect=false --v=1 \
    > "$RUN/logs/kube-scheduler.log" 2>&1 < /dev/null &
  echo $! > "$RUN/pids/kube-scheduler.pid"
fi

# Optional watchdog: stop the whole cluster when process WATCH_PID exits (a test session that is
# killed must not leave an apiserver behind on a shared machine).
if [ -n "${WATCH_PID:-}" ]; then
  nohup bash -c 'while kill -0 "$0" 2>/dev/null; do sleep 2; done
                 rm -f "$1/pids/watchdog.pid"; RUN="$1" "$2/k8s-down.sh" --purge
                 [ "$3" = 1 ] && rm -rf "$1"' "$WATCH_PID" "$RUN" "$HERE" "${WATCH_RM_RUN:-0}" \
    > /dev/null 2>&1 < /dev/null &
  echo $! > "$RUN/pids/watchdog.pid"
fi

# Pods are refused until the namespace's default ServiceAccount exists (the controller-manager makes it).
if [ "$WITH_KCM" = 1 ]; then
  ok=0
  for _ in $(seq 1 300); do
    if curl -fsS --cacert "$P/ca.crt" --cert "$P/admin.crt" --key "$P/admin.key" \
      "https://127.0.0.1:${API_PORT}/api/v1/namespaces/default/serviceaccounts/default" >/dev/null 2>&1; then
      ok=1; break
    fi
    kill -0 "$(cat "$RUN/pids/kube-controller-manager.pid")" 2>/dev/null || break
    sleep 0.1
  done
  if [ $ok != 1 ]; then
    echo "the default ServiceAccount did not appear; see $RUN/logs/kube-controller-manager.log" >&2
    tail -20 "$RUN/logs/kube-controller-manager.log" >&2
    exit 1
  fi
fi
t_end=$(date +%s.%N)

printf 'etcd ready in %.1fs, kube-apiserver in %.1fs, all up in %.1fs (api https://127.0.0.1:%s)\n' \
  "$(echo "$t_etcd - $t0" | bc)" "$(echo "$t_api - $t_etcd" | bc)" "$(echo "$t_end - $t0" | bc)" "$API_PORT" >&2
echo "export KUBECONFIG=$RUN/kubeconfig"
