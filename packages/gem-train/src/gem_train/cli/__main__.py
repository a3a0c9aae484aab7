"""``python -m gem_train.cli``: the ``gem-train`` command."""

from gem_train.cli.main import console_main

console_main()
