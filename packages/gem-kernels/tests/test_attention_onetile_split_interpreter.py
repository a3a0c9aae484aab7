"""The split one-tile backward (``onetile_split``) under the Triton interpreter, against the fp64 reference.

The cases (``split_cases`` of ``attention_interpreter_cases.py``, run with ``--split`` in a subprocess under
``TRITON_INTERPRET=1``) cut the long side into chunks of 24-128 rows, so that sequences span one to five
chunks: cross-attention (partial dK/dV) and PMA (partial dQ), softmax and GDPA, short self-attention with
band masks, fp32 and fp16, lengths 0 and 1, chunks that are not a whole number of tiles, strided inputs
and int64 offsets; forward and the three gradients, bounded as in ``test_attention_triton_interpreter.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

DRIVER_TIMEOUT_S = 600
DRIVER = Path(__file__).with_name("attention_interpreter_cases.py")
DRIVER_ARGS = ["--split"]
FACTOR = 4.0  # as test_attention_triton_interpreter.py; the floor: conftest.ERROR_FLOOR


def test_onetile_split_cases_match_reference(interpreter_results, over_bound):
    assert len(interpreter_results) >= 14
    bad = over_bound(interpreter_results, FACTOR, ("out", "dq", "dk", "dv"))
    assert not bad, "\n".join(bad)


def test_onetile_split_outputs_finite_and_empty_rows_zero(interpreter_results):
    assert all(r["finite"] for r in interpreter_results), [
        r["name"] for r in interpreter_results if not r["finite"]
    ]
    assert all(r["empty_rows_zero"] for r in interpreter_results), [
        r["name"] for r in interpreter_results if not r["empty_rows_zero"]
    ]
