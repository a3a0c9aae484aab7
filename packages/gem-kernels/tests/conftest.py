"""Shared fixtures of the gem-kernels tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


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
