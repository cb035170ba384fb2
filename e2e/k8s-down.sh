#!/bin/bash
# Stop what e2e/k8s-up.sh started, by recorded PID only (never by name: other people's clusters may
# run on the same machine). Environment: RUN (the state dir given to k8s-up.sh; default $EASERVE_CACHE/run).
#   k8s-down.sh           SIGTERM to all at once (graceful, ~3 s), SIGKILL whatever is left after 10 s
#   k8s-down.sh --purge   SIGKILL at once and delete the etcd data and logs (PKI kept): nothing is kept,
#                         so a graceful shutdown would only cost time (each component takes ~2 s)
RUN=${RUN:-${EASERVE_CACHE:-$HOME/.cache/easerve}/run}
sig=TERM
[ "${1:-}" = --purge ] && sig=KILL
pids=()
names=()
for name in watchdog kubelet-harness discovery-etcd kube-scheduler kube-controller-manager kube-apiserver etcd; do
  f=$RUN/pids/$name.pid
  [ -f "$f" ] || continue
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -"$sig" "$pid" 2>/dev/null
    pids+=("$pid")
    names+=("$name")
  fi
  rm -f "$f"
done
for i in "${!pids[@]}"; do
  pid=${pids[$i]}
  for _ in $(seq 1 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
  echo "stopped ${names[$i]} (pid $pid)" >&2
done
if [ "${1:-}" = --purge ]; then
  d=$(cat "$RUN/etcd-data-path" 2>/dev/null || echo "$RUN/etcd")
  rm -rf "$d" "$RUN/etcd" "$RUN/discovery-etcd" "$RUN/logs" "$RUN/apiserver-certs" "$RUN/etcd-data-path"
  echo "purged etcd data and logs (PKI kept in $RUN/pki)" >&2
elif [ -f "$RUN/etcd-data-path" ]; then
  # a RAM-backed data dir must not outlive the cluster
  d=$(cat "$RUN/etcd-data-path")
  case "$d" in /dev/shm/easerve-etcd-*) rm -rf "$d" ;; esac
fi
exit 0
