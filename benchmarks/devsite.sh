#!/bin/bash
# On the GPU machine: unpack .devsite/ (made by benchmarks/make_devsite.sh) so that
# PYTHONPATH=.devsite/site:.devsite:runtime:operator runs `easerve serve` over Dynamo's runtime.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -f .devsite/dynamo/_core.abi3.so ]; then
    $PY -c "import lzma, shutil; shutil.copyfileobj(lzma.open('.devsite/dynamo/_core.abi3.so.xz'), open('.devsite/dynamo/_core.abi3.so', 'wb'))"
fi
if [ ! -d .devsite/site ] && [ -f .devsite/site.tar.xz ]; then   # make_devsite.sh's unpacked wheels
    mkdir -p .devsite/site && tar xJf .devsite/site.tar.xz -C .devsite/site
fi
if [ ! -d .devsite/site ]; then
    $PY -m pip install -q --no-index --find-links .devsite/wheels --target .devsite/site \
        uvloop aiohttp prometheus_client pyyaml tqdm pydantic
fi
PYTHONPATH=.devsite/site:.devsite $PY -c "import dynamo._core, aiohttp, pydantic; print('devsite ok: dynamo', dynamo._core.__file__)"
