"""``python -m gem_train.cli``: the ``gem-train`` command."""

from gem_train.cli.main import main

raise SystemExit(main())
