"""``say``: ranks that share one stderr pipe each keep their lines whole."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gem_train.cli.stderr import say

WRITER = """
import sys
from gem_train.cli.stderr import say
tag = sys.argv[1]
for i in range(400):
    say(f"gem-train: error: {tag} line {i} " + tag * 180 + " end")
"""
PARENT = (
    "import subprocess, sys; "
    f"ps = [subprocess.Popen([sys.executable, '-c', {WRITER!r}, t]) for t in 'ab']; "
    "sys.exit(sum(p.wait() for p in ps))"
)


@pytest.mark.timeout(120)
def test_lines_from_processes_sharing_a_pipe_stay_whole():
    # Both writers inherit one stderr pipe, as torchrun's ranks share the launcher's.
    done = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 800
    for tag in "ab":
        mine = [line for line in lines if line.startswith(f"gem-train: error: {tag} ")]
        assert mine == [f"gem-train: error: {tag} line {i} " + tag * 180 + " end" for i in range(400)]


def test_a_stream_without_a_file_descriptor_gets_the_line(capsys):
    say("gem-train: error: x")
    say("ü")
    assert capsys.readouterr().err == "gem-train: error: x\nü\n"
