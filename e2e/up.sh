#!/bin/bash
# The main job on an embedded default: set the machine up (idempotent), then `easerve up`:
# local control plane, CRD, operator, the LLaVA example applied and reported Ready, and a short
# live run of it on the sim engine. Extra arguments go to `easerve up` (see `easerve up --help`).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${EASERVE_CACHE:-$HOME/.cache/easerve}
bash "$HERE/bootstrap.sh"
unset KUBECONFIG
exec "$CACHE/venv/bin/easerve" up "$@"
