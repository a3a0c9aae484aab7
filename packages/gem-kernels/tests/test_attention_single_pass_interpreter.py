"""The single-pass backward (``single_pass``: dK, dV and dQ from one kernel, dQ added atomically in fp32)
under the Triton interpreter, against the fp64 reference.

The cases (``single_pass_cases`` of ``attention_interpreter_cases.py``, run with ``--single-pass`` in a
subprocess under ``TRITON_INTERPRET=1``): softmax and GDPA silu with no mask, causal, window and
causal+window; every other activation causal; cross-attention with an empty key sequence and PMA (the
kernel runs every shape class); fp16; tiles 16x32 and 32x16, head dims 24 and 8; a diagonal-only window;
int64 offsets; strided inputs. Lengths 0, 1, 16, 37, 64 and 70: query rows that receive their dQ from one,
two or three key tiles, and tiles cut by the sequence's end. Forward and the three gradients, bounded as in
``test_attention_triton_interpreter.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

DRIVER_TIMEOUT_S = 600
DRIVER = Path(__file__).with_name("attention_interpreter_cases.py")
DRIVER_ARGS = ["--single-pass"]
FACTOR = 4.0  # as test_attention_triton_interpreter.py; the floor: conftest.ERROR_FLOOR


def test_single_pass_cases_match_reference(interpreter_results, over_bound):
    assert len(interpreter_results) >= 25
    bad = over_bound(interpreter_results, FACTOR, ("out", "dq", "dk", "dv"))
    assert not bad, "\n".join(bad)


def test_single_pass_outputs_finite_and_empty_rows_zero(interpreter_results):
    assert all(r["finite"] for r in interpreter_results), [
        r["name"] for r in interpreter_results if not r["finite"]
    ]
    assert all(r["empty_rows_zero"] for r in interpreter_results), [
        r["name"] for r in interpreter_results if not r["empty_rows_zero"]
    ]
