#!/bin/bash
# Stop the prometheus that e2e/prom-up.sh started (by recorded PID) and delete its data.
# Environment: PROM_DIR=$EASERVE_CACHE/prom (the same as given to prom-up.sh).
PROM_DIR=${PROM_DIR:-${EASERVE_CACHE:-$HOME/.cache/easerve}/prom}
f=$PROM_DIR/prometheus.pid
if [ -f "$f" ]; then
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    echo "stopped prometheus (pid $pid)" >&2
  fi
  rm -f "$f"
fi
rm -rf "$PROM_DIR/data"
exit 0
