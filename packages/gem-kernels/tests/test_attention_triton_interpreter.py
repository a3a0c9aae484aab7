"""The attention Triton kernels, run on the CPU by the Triton interpreter, against the fp64 reference.

The interpreter has to be on before triton is first imported, so the cases run in one subprocess
(``attention_interpreter_cases.py``) with ``TRITON_INTERPRET=1``; this module checks what it reports.
Covered: softmax and every GDPA activation, x no mask / causal / window / causal+window (self-attention),
cross-attention with short keys and an empty key sequence, PMA (few queries, long keys), short
self-attention with band masks (the one-tile kernels, and the general tiled ones), fp32 and fp16, lengths 0,
1, 16, 37, 64, 70 (non-multiples of the blocks), other tile shapes, and head dims that are not powers of
two, diagonal-only and very wide windows, int32 and int64 offsets, strided (non-contiguous) inputs; forward
and the three gradients.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

# Run by the ``interpreter_results`` fixture (conftest.py) under TRITON_INTERPRET=1.
DRIVER_TIMEOUT_S = 900
DRIVER = Path(__file__).with_name("attention_interpreter_cases.py")
# Relative Frobenius error allowed: a few times the error of the reference run in the same dtype (which
# computes in fp32 and rounds once at the end), plus a floor of a few ulps. The kernels round P and dS to
# the input dtype once more than the reference and sum in another order, hence the factor.
FACTOR = 4.0  # the floor: conftest.ERROR_FLOOR


def test_interpreter_cases_match_reference(interpreter_results, over_bound):
    assert len(interpreter_results) >= 69
    bad = over_bound(interpreter_results, FACTOR, ("out", "dq", "dk", "dv"))
    assert not bad, "\n".join(bad)


def test_interpreter_outputs_finite_and_empty_rows_zero(interpreter_results):
    assert all(r["finite"] for r in interpreter_results), [
        r["name"] for r in interpreter_results if not r["finite"]
    ]
    assert all(r["empty_rows_zero"] for r in interpreter_results), [
        r["name"] for r in interpreter_results if not r["empty_rows_zero"]
    ]
