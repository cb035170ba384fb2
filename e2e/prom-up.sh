#!/bin/bash
# Start Debian's prometheus (2.42) on 127.0.0.1 with a given config (never the system service).
#   usage: e2e/prom-up.sh [prometheus.yml]     (default: $PROM_DIR/prometheus.yml)
# Environment: PROM_DIR=$EASERVE_CACHE/prom (data, log, pid)  PROM_PORT (default: a free high port;
# written to $PROM_DIR/port)  PROM_RETENTION=1h. Stop with e2e/prom-down.sh (same PROM_DIR).
set -euo pipefail
PROM_DIR=${PROM_DIR:-${EASERVE_CACHE:-$HOME/.cache/easerve}/prom}
mkdir -p "$PROM_DIR"
PROM_DIR=$(cd "$PROM_DIR" && pwd)
PROM_PORT=${PROM_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
CFG=$(realpath "${1:-$PROM_DIR/prometheus.yml}")
command -v prometheus >/dev/null || { echo "prometheus not found: run e2e/setup-host.sh" >&2; exit 1; }
if [ -f "$PROM_DIR/prometheus.pid" ] && kill -0 "$(cat "$PROM_DIR/prometheus.pid")" 2>/dev/null; then
  echo "prometheus already running (pid $(cat "$PROM_DIR/prometheus.pid")); run e2e/prom-down.sh first" >&2
  exit 1
fi
promtool check config "$CFG" >/dev/null
rm -rf "$PROM_DIR/data"
nohup prometheus --config.file="$CFG" --storage.tsdb.path="$PROM_DIR/data" \
  --web.listen-address="127.0.0.1:${PROM_PORT}" --storage.tsdb.retention.time="${PROM_RETENTION:-1h}" \
  --log.level=warn > "$PROM_DIR/prometheus.log" 2>&1 < /dev/null &
echo $! > "$PROM_DIR/prometheus.pid"
echo "$PROM_PORT" > "$PROM_DIR/port"
for _ in $(seq 1 200); do
  curl -fsS "http://127.0.0.1:${PROM_PORT}/-/ready" >/dev/null 2>&1 && break
  kill -0 "$(cat "$PROM_DIR/prometheus.pid")" 2>/dev/null || break
  sleep 0.05
done
if ! curl -fsS "http://127.0.0.1:${PROM_PORT}/-/ready" >/dev/null 2>&1; then
  echo "prometheus not ready; see $PROM_DIR/prometheus.log" >&2
  tail "$PROM_DIR/prometheus.log" >&2
  "$(dirname "$0")/prom-down.sh"
  exit 1
fi
echo "prometheus ready (pid $(cat "$PROM_DIR/prometheus.pid")); new targets are first scraped after one scrape_interval" >&2
echo "http://127.0.0.1:${PROM_PORT}"
