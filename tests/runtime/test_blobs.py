"""Same-host blobs: what the sender puts, the receiver takes once; names from the wire stay inside
the directory; a discarded or taken blob leaves no file."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from easerve_runtime.engines.hf import _from_bytes
from easerve_runtime.workers.blobs import HostBlobs


def test_put_then_take_once(tmp_path: Path) -> None:
    blobs = HostBlobs(tmp_path / "b")
    data = np.arange(1000, dtype=np.int16)
    name = asyncio.run(blobs.put(memoryview(data).cast("B")))
    got = asyncio.run(blobs.take(name))
    assert bytes(got) == data.tobytes()
    assert list((tmp_path / "b").iterdir()) == []  # taken: gone
    with pytest.raises(ValueError, match="gone"):
        blobs.take_sync(name)


def test_a_taken_blob_becomes_a_tensor_without_a_copy(tmp_path: Path) -> None:
    blobs = HostBlobs(tmp_path)
    src = np.arange(24, dtype=np.float32)
    buf = blobs.take_sync(blobs.put_sync(src.tobytes()))
    t = _from_bytes(buf, "float32", (2, 3, 4))
    assert t.shape == (2, 3, 4) and float(t[1, 2, 3]) == 23.0
    buf[0:4] = np.float32(7.0).tobytes()  # the tensor views the taken buffer itself
    assert float(t[0, 0, 0]) == 7.0


@pytest.mark.parametrize("name", ["../etc/passwd", "x.blob", "/tmp/a", "0" * 32 + ".blob/.."])
def test_names_from_the_wire_stay_inside(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="bad blob name"):
        HostBlobs(tmp_path).take_sync(name)


def test_discard_is_quiet_and_removes(tmp_path: Path) -> None:
    blobs = HostBlobs(tmp_path)
    name = blobs.put_sync(b"x" * 10)
    blobs.discard(name)
    blobs.discard(name)  # twice: nothing to do, no error
    blobs.discard("../nope")
    assert list(tmp_path.iterdir()) == []
