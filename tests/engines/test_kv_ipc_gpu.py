"""The same-GPU KV handoff by CUDA IPC (``engines.kv_ipc``) between two real processes on one GPU.

The two-process test needs CUDA (skipped elsewhere; run on the GPU machine). The producer is a child process that
exports a device tensor as the prefill engine does; this process maps it as the decode engine
does, refuses a descriptor of another GPU, and tells the producer it may drop its tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")

REPO = Path(__file__).resolve().parents[2]
SHAPE = (2, 2, 3, 5, 4)

PRODUCER = f"""
import json, sys, torch
from easerve_runtime.engines import kv_ipc
kv = (torch.arange({'*'.join(map(str, SHAPE))}, device="cuda", dtype=torch.float32) * 0.5).to(torch.bfloat16)
helds = [[kv.reshape{SHAPE}], [(kv * 2).reshape{SHAPE}], [(kv * 3).reshape{SHAPE}]]
ready = torch.cuda.Event()
ready.record()
shares = [kv_ipc.deferred_share(held, ready)() for held in helds]
print(json.dumps([desc for desc, _ in shares]), flush=True)
for _, answered in shares:
    answered(sys.stdin.readline().strip() == "taken")
print(json.dumps({{"held": [len(h) for h in helds]}}), flush=True)
sys.stdin.readline()
"""


def expected() -> object:
    n = 1
    for x in SHAPE:
        n *= x
    return (torch.arange(n, dtype=torch.float32) * 0.5).to(torch.bfloat16).reshape(SHAPE)


@needs_cuda
def test_a_tensor_crosses_processes_on_one_gpu_and_the_producer_drops_it_once_copied() -> None:
    from easerve_runtime.engines import kv_ipc

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-c", PRODUCER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=env)
    try:
        assert p.stdout is not None and p.stdin is not None
        desc, desc2, _never_opened = json.loads(p.stdout.readline())
        assert desc["gpu"] == kv_ipc.gpu_uuid(torch.device("cuda"))
        with pytest.raises(kv_ipc.KVIPCRefused, match="GPU"):
            kv_ipc.open_shared({**desc, "gpu": "GPU-elsewhere"}, "cuda")
        got = kv_ipc.open_shared(desc, "cuda")
        assert got.device.type == "cuda" and tuple(got.shape) == SHAPE and got.dtype == torch.bfloat16
        assert torch.equal(got.cpu(), expected())  # a device-local copy of the producer's tensor
        buf = torch.zeros(got.numel() + 7, dtype=torch.bfloat16, device="cuda")  # a staging buffer
        ev = torch.cuda.Event()
        ev.record()
        into = kv_ipc.open_shared(desc2, "cuda", dst=buf, after=ev)
        assert into.data_ptr() == buf.data_ptr() and torch.equal(into.cpu(), expected() * 2)
        p.stdin.write("taken\ntaken\nrefused\n")
        p.stdin.flush()
        # taken: let go; refused (its IPC count returned): kept for the host copy that follows
        assert json.loads(p.stdout.readline()) == {"held": [0, 0, 1]}
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_a_decode_on_the_cpu_refuses_a_share_naming_why() -> None:
    from easerve_runtime.engines import kv_ipc

    with pytest.raises(kv_ipc.KVIPCRefused, match="cpu"):
        kv_ipc.open_shared({"gpu": "GPU-x"}, "cpu")
