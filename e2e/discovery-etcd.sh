#!/bin/bash
# The etcd that Dynamo's discovery uses in the local cluster (NOT the control plane's etcd: a test
# can stop this one for a while without taking the apiserver down).
#   RUN=<state dir of k8s-up.sh> e2e/discovery-etcd.sh start   start it (port DISCOVERY_ETCD_PORT in
#                                                             $RUN/ports.env, free high port if unset)
#   RUN=... e2e/discovery-etcd.sh stop                       stop it (by recorded PID), data kept
#   RUN=... e2e/discovery-etcd.sh purge                      stop it and delete its data
# Data lives in $RUN/discovery-etcd and survives stop/start (a restarted etcd keeps the leases it had,
# as a real one with a persistent volume does). The endpoint is printed as the last line.
set -euo pipefail
RUN=${RUN:-${EASERVE_CACHE:-$HOME/.cache/easerve}/run}
mkdir -p "$RUN/logs" "$RUN/pids"
PIDF=$RUN/pids/discovery-etcd.pid
DATA=$RUN/discovery-etcd
port_of() { { grep -s "^$1=" "$RUN/ports.env" || true; } | cut -d= -f2; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
stop() {
  [ -f "$PIDF" ] || return 0
  pid=$(cat "$PIDF")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
  fi
  rm -f "$PIDF"
}
case "${1:-start}" in
  stop) stop; exit 0 ;;
  purge) stop; rm -rf "$DATA"; exit 0 ;;
  start) ;;
  *) echo "usage: $0 start|stop|purge" >&2; exit 2 ;;
esac
if [ -f "$PIDF" ] && kill -0 "$(cat "$PIDF")" 2>/dev/null; then
  echo "http://127.0.0.1:$(port_of DISCOVERY_ETCD_PORT)"; exit 0
fi
PORT=${DISCOVERY_ETCD_PORT:-$(port_of DISCOVERY_ETCD_PORT)}
PEER=${DISCOVERY_ETCD_PEER_PORT:-$(port_of DISCOVERY_ETCD_PEER_PORT)}
[ -n "$PORT" ] || PORT=$(free_port)
[ -n "$PEER" ] || PEER=$(free_port)
touch "$RUN/ports.env"
grep -v '^DISCOVERY_ETCD_' "$RUN/ports.env" > "$RUN/ports.env.tmp" || true
printf 'DISCOVERY_ETCD_PORT=%s\nDISCOVERY_ETCD_PEER_PORT=%s\n' "$PORT" "$PEER" >> "$RUN/ports.env.tmp"
mv "$RUN/ports.env.tmp" "$RUN/ports.env"
nohup etcd --name discovery --data-dir "$DATA" \
  --listen-client-urls "http://127.0.0.1:${PORT}" --advertise-client-urls "http://127.0.0.1:${PORT}" \
  --listen-peer-urls "http://127.0.0.1:${PEER}" --initial-advertise-peer-urls "http://127.0.0.1:${PEER}" \
  --initial-cluster "discovery=http://127.0.0.1:${PEER}" --log-level=warn \
  >> "$RUN/logs/discovery-etcd.log" 2>&1 < /dev/null &
echo $! > "$PIDF"
for _ in $(seq 1 150); do
  if curl -fsS "http://127.0.0.1:${PORT}/health" >/dev/null 2>&1; then
    echo "http://127.0.0.1:${PORT}"; exit 0
  fi
  kill -0 "$(cat "$PIDF")" 2>/dev/null || break
  sleep 0.1
done
echo "discovery etcd did not become healthy on port ${PORT}; see $RUN/logs/discovery-etcd.log" >&2
tail -5 "$RUN/logs/discovery-etcd.log" >&2
stop
exit 1
