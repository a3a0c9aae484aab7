"""The block-attention, rotary and jagged<->padded Triton kernels on the CPU (``TRITON_INTERPRET=1``).

The cases run in one subprocess (``block_interpreter_cases.py``), because the interpreter must be on
before triton is imported; this module checks what it reports. Covered: block sizes 32, 64, 128 and 24
(not a power of two), causal or not, no rotary / default positions / real-valued positions, lengths 0,
1, 63, 64, 65, 130, 37 random sequences (the binary search), odd and unequal head dims, fp32 and fp16
(bf16 arithmetic is wrong in the interpreter), forward and all gradients.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

DRIVER = Path(__file__).with_name("block_interpreter_cases.py")
# Relative Frobenius error allowed: twice the error of the reference path run in the same dtype (it
# computes in fp32 and rounds once), plus a floor of a few ulps. The kernels round the rotated q/k, P and
# dS to the input dtype once more than the reference and sum in another order, hence the factor 2
# (measured: at most 1.35x in fp16).
FACTOR = 2.0
FLOOR = {"torch.float32": 1e-6, "torch.float16": 2e-4}


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(DRIVER)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("JSON:", 1)[1])


def test_kernels_match_reference(results):
    assert len(results) >= 53
    bad = []
    for r in results:
        for i, (err, ref) in enumerate(zip(r["err"], r["ref_err"])):
            bound = FACTOR * ref + FLOOR[r["dtype"]]
            if not err <= bound:
                bad.append(f"{r['name']} {r['dtype']} output {i}: {err:.2e} > {bound:.2e}")
    assert not bad, "\n".join(bad)


def test_kernels_ran_and_outputs_are_finite(results):
    expected = {
        "block": {"block_attention_fwd": 1, "block_attention_bwd": 1},
        "rotary": {"rotary_triton": 2},
        "jagged_to_padded": {"jagged_to_padded_triton": 1, "padded_to_jagged_triton": 1},
        "padded_to_jagged": {"jagged_to_padded_triton": 1, "padded_to_jagged_triton": 1},
        "jagged_mean": {"jagged_mean_triton": 1},
    }
    for r in results:
        assert r["launches"] == expected[r["name"].split()[0]], r["name"]
        assert r["finite"] and r["dtypes_ok"], r["name"]
