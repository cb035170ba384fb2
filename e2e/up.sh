#!/bin/bash
# The main job on an embedded default: set the machine up (idempotent), then `easerve up`:
# local control plane + discovery etcd, CRD, operator, the LLaVA example applied, its pods run as
# processes (kubelet harness) and Ready, a short load through its frontend Service, clean stop.
# Extra arguments go to `easerve up` (`--json`: the last line is one JSON object; see --help).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${EASERVE_CACHE:-$HOME/.cache/easerve}
bash "$HERE/bootstrap.sh"
unset KUBECONFIG
exec "$CACHE/venv/bin/easerve" up "$@"
