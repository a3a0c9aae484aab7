"""The ``gem-train`` console script."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("gem-train: the training command is not built yet (see the gem-train issue).", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
