"""Shared fixtures of the gem-kernels tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Floor of the interpreter tests' error bound: a few ulps of the dtype (the kernels' relative errors are
# compared with FACTOR x the error of the reference run in the same dtype, plus this).
ERROR_FLOOR = {"torch.float32": 1e-6, "torch.float16": 2e-4}


@pytest.fixture(scope="module")
def interpreter_results(request) -> list[dict]:
    """Runs the requesting module's ``DRIVER`` script under ``TRITON_INTERPRET=1`` and returns its results.

    The interpreter has to be on before triton is first imported, so the cases run in one subprocess (for
    at most the module's ``DRIVER_TIMEOUT_S`` seconds, with the module's ``DRIVER_ARGS`` if any), which
    prints ``JSON:`` and a list of result dicts.
    """
    driver = request.module.DRIVER
    args = list(getattr(request.module, "DRIVER_ARGS", []))
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(driver), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=request.module.DRIVER_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("JSON:", 1)[1])


@pytest.fixture
def over_bound():
    """``over_bound(results, factor, labels=None) -> list[str]``: the outputs of the interpreter results
    whose relative error ``err`` exceeds ``factor * ref_err + ERROR_FLOOR[dtype]`` (one line each; empty
    when all pass). ``labels`` names the outputs (e.g. out, dq, dk, dv); default: their index."""

    def check(results: list[dict], factor: float, labels: tuple[str, ...] | None = None) -> list[str]:
        bad = []
        for r in results:
            for i, (err, ref) in enumerate(zip(r["err"], r["ref_err"], strict=True)):
                bound = factor * ref + ERROR_FLOOR[r["dtype"]]
                if not err <= bound:
                    what = labels[i] if labels else f"output {i}"
                    bad.append(f"{r['name']} {r['dtype']} {what}: {err:.2e} > {bound:.2e}")
        return bad

    return check
