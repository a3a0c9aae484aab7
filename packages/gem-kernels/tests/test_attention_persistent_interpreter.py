"""The persistent attention kernels (variant ``tma``) under the Triton interpreter against the fp64
reference: softmax, silu and gelu GDPA, no mask / causal / window / causal window, self-attention with
lengths 0, 1, 16, 37, 64, 70 (non-multiples of the blocks), cross and PMA shapes, fp32 and fp16, 32x32,
16x32 and 32x16 tiles; forward and the three gradients. The interpreter emulates tensor descriptors, so the
TMA path is checked too, and layouts TMA cannot address (head dims 24/8, strided inputs) are checked to
fall back to pointer loads.

The cases run in one subprocess (``attention_persistent_cases.py``) per module; this module runs the
quick subset (about 25 s of CPU) and, marked ``slow``, all 12 (about 50 s of CPU).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
    pytest.mark.timeout(900),  # the interpreter subprocess is slow on a loaded machine
]

DRIVER_TIMEOUT_S = 900
DRIVER = Path(__file__).with_name("attention_persistent_cases.py")
DRIVER_ARGS = ["--quick"]
N_CASES = 6
# The bound of the tiled kernels' interpreter test (test_attention_triton_interpreter.py): the persistent
# kernels do the same arithmetic in the same order, so they get no more slack. Relative Frobenius error
# <= FACTOR x the error of the reference run in the same dtype + a floor of a few ulps.
FACTOR = 4.0  # the floor: conftest.ERROR_FLOOR


def check_matches_reference(results: list[dict], n_cases: int, over_bound) -> None:
    assert len(results) == n_cases
    bad = over_bound(results, FACTOR, ("out", "dq", "dk", "dv"))
    for r in results:
        if not r["finite"] or not r["empty_rows_zero"]:
            bad.append(f"{r['name']}: non-finite values or non-zero rows of empty key sequences")
    assert not bad, "\n".join(bad)


def check_paths(results: list[dict]) -> None:
    for r in results:
        name, ran = r["name"], r["launches"]
        fallback = "dims24x8" in name or "strided" in name
        path = "pointer" if fallback else "tma"
        # One forward, one dQ and one dK/dV launch, each on the expected path (no silent tiled fallback).
        assert ran == {"fwd:" + path: 1, "dq:" + path: 1, "dkdv:" + path: 1}, (name, ran)


def test_persistent_cases_match_reference(interpreter_results, over_bound):
    check_matches_reference(interpreter_results, N_CASES, over_bound)


def test_persistent_cases_ran_the_intended_path(interpreter_results):
    check_paths(interpreter_results)


@pytest.fixture(scope="module")
def all_results() -> list[dict]:
    """Every case of the driver (the ``interpreter_results`` fixture runs the quick subset)."""
    proc = subprocess.run(
        [sys.executable, str(DRIVER)],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("JSON:", 1)[1])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_all_persistent_cases(all_results, over_bound):
    check_matches_reference(all_results, 12, over_bound)
    check_paths(all_results)
