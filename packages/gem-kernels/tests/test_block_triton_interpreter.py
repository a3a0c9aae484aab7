"""The block-attention, rotary and jagged<->padded Triton kernels on the CPU (``TRITON_INTERPRET=1``).

The cases run in one subprocess (``block_interpreter_cases.py``), because the interpreter must be on
before triton is imported; this module checks what it reports. Covered: block sizes 32, 64, 128 and 24
(not a power of two), causal or not, no rotary / default positions / real-valued positions, lengths 0,
1, 63, 64, 65, 130, 37 random sequences (the binary search), odd and unequal head dims, fp32 and fp16
(bf16 arithmetic is wrong in the interpreter), forward and all gradients.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

# Run by the ``interpreter_results`` fixture (conftest.py) under TRITON_INTERPRET=1.
DRIVER_TIMEOUT_S = 600
DRIVER = Path(__file__).with_name("block_interpreter_cases.py")
# Relative Frobenius error allowed: twice the error of the reference path run in the same dtype (it
# computes in fp32 and rounds once), plus a floor of a few ulps. The kernels round the rotated q/k, P and
# dS to the input dtype once more than the reference and sum in another order, hence the factor 2
# (measured: at most 1.35x in fp16).
FACTOR = 2.0  # the floor: conftest.ERROR_FLOOR


def test_kernels_match_reference(interpreter_results, over_bound):
    assert len(interpreter_results) >= 53
    bad = over_bound(interpreter_results, FACTOR)
    assert not bad, "\n".join(bad)


def test_kernels_ran_and_outputs_are_finite(interpreter_results):
    expected = {
        "block": {"block_attention_fwd": 1, "block_attention_bwd": 1},
        "rotary": {"rotary_triton": 2},
        "jagged_to_padded": {"jagged_to_padded_triton": 1, "padded_to_jagged_triton": 1},
        "padded_to_jagged": {"jagged_to_padded_triton": 1, "padded_to_jagged_triton": 1},
        "jagged_mean": {"jagged_mean_triton": 1},
    }
    for r in interpreter_results:
        assert r["launches"] == expected[r["name"].split()[0]], r["name"]
        assert r["finite"] and r["dtypes_ok"], r["name"]
