"""One whole line on stderr, safe when several ranks share the launcher's stderr pipe."""

from __future__ import annotations

import io
import os
import sys


def say(line: str) -> None:
    """Write ``line`` and its newline to stderr in one ``write`` system call.

    The ranks of a multi-process run share one stderr pipe; ``print`` writes a line in pieces (text, then
    newline) that another rank's line can land between. POSIX keeps one ``write`` of at most ``PIPE_BUF``
    (4,096 on Linux) bytes to a pipe whole, so each rank's line stays a line. Where stderr has no file
    descriptor (a test's captured stream) the line goes through the stream object.
    """
    stream = sys.stderr
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        stream.write(line + "\n")
        stream.flush()
        return
    stream.flush()  # what the stream still holds comes first
    data = (line + "\n").encode(stream.encoding or "utf-8", "backslashreplace")
    while data:
        data = data[os.write(fd, data) :]
