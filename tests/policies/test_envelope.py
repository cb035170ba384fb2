"""Envelopes round-trip per destination; the send window never exceeds its cap."""

from __future__ import annotations

import json

import numpy as np
import pytest
from easerve_runtime.policies.envelope import ALIGN, Envelope, SendWindow, build_envelopes
from hypothesis import given, settings
from hypothesis import strategies as st

dtypes = st.sampled_from(["float16", "float32", "int8", "uint8", "float64", "int64"])
shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)


@settings(max_examples=80, deadline=None)
@given(
    spec=st.lists(st.tuples(st.integers(0, 3), shapes, dtypes), min_size=0, max_size=12),
    seed=st.integers(0, 1000),
)
def test_round_trip_one_envelope_per_destination(spec, seed):
    rng = np.random.default_rng(seed)
    entries = []
    for i, (dest, shape, dt) in enumerate(spec):
        arr = (rng.standard_normal(shape) * 50).astype(dt)
        entries.append((f"req-{i}", f"prefill-{dest}", arr))
    envs = build_envelopes(entries)
    assert set(envs) == {d for _, d, _ in entries}  # exactly one envelope per destination
    seen = []
    for dest, env in envs.items():
        assert env.destination == dest
        buf, index = env.pack()
        index = json.loads(json.dumps(index))  # the index survives JSON
        back = Envelope.unpack(buf, index)
        expected = [(rid, a) for rid, d, a in entries if d == dest]
        assert list(back) == [rid for rid, _ in expected]  # arrival order kept
        for rid, a in expected:
            assert back[rid].dtype == a.dtype and back[rid].shape == a.shape
            np.testing.assert_array_equal(back[rid], a)
        for e in env.index:
            assert e.offset % ALIGN == 0
        seen.extend(back)
    assert sorted(seen) == sorted(rid for rid, _, _ in entries)


def test_non_contiguous_and_duplicate():
    a = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]  # non-contiguous view
    env = build_envelopes([("r1", 0, a)])[0]
    np.testing.assert_array_equal(env.arrays()["r1"], a)
    with pytest.raises(ValueError, match="appears twice"):
        build_envelopes([("r1", 0, a), ("r1", 1, a)])
    with pytest.raises(ValueError, match="object array"):
        build_envelopes([("r1", 0, np.array([object()]))])


def test_unpack_rejects_bad_index():
    env = build_envelopes([("r", "d", np.zeros((2, 3), np.float32))])["d"]
    buf, index = env.pack()
    bad = dict(index[0], nbytes=4)
    with pytest.raises(ValueError, match="nbytes"):
        Envelope.unpack(buf, [bad])
    with pytest.raises(ValueError, match="outside"):
        Envelope.unpack(buf, [dict(index[0], offset=len(buf))])
    with pytest.raises(ValueError, match="missing field 'dtype'"):
        Envelope.unpack(buf, [{k: v for k, v in index[0].items() if k != "dtype"}])
    with pytest.raises(ValueError, match="dtype"):
        Envelope.unpack(buf, [dict(index[0], dtype="nope")])


@settings(max_examples=80, deadline=None)
@given(cap=st.integers(1, 5), ops=st.lists(st.booleans(), max_size=100))
def test_send_window_never_exceeds_cap(cap, ops):
    w = SendWindow(cap)
    held = 0
    for acquire in ops:
        if acquire:
            ok = w.try_acquire()
            assert ok == (held < cap)
            held += ok
        elif held:
            w.release()
            held -= 1
        else:
            with pytest.raises(RuntimeError):
                w.release()
        assert w.in_flight == held <= cap
        assert w.available == cap - held
    assert w.peak <= cap
    with pytest.raises(ValueError, match="max_in_flight"):
        SendWindow(0)
