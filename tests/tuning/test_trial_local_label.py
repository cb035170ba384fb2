"""``benchmarks/trial_local.py`` serves a cluster trial by the label the operator writes into
``status.tuning.trialsDetail[].candidate`` (``reconcile/tuning.py``): that label must read back as
the same candidate, and a label it cannot read is refused naming what it expected."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from easerve_operator.tuning.space import Alloc, Candidate

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import trial_local  # noqa: E402


@pytest.mark.parametrize("c", [
    Candidate(Alloc(6, 0, 2, 1, 2), 1, 0.0),
    Candidate(Alloc(4, 1, 2, 1, 2), 1, 0.3),
    Candidate(Alloc(2, 1, 4, 2, 2), 16, 0.55),
])
def test_the_operators_trial_label_reads_back_as_its_candidate(c: Candidate) -> None:
    label = f"{c.alloc.label} B={c.batch_bound} s={c.offload_ratio:g}"  # as reconcile/tuning.py writes it
    assert trial_local.candidate(label).key() == c.key()


def test_a_label_it_cannot_read_is_refused() -> None:
    with pytest.raises(SystemExit, match="expected e.g."):
        trial_local.candidate("6E-0P B=1")
