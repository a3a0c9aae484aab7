"""The ``gem-train`` command (:func:`main`, the program :func:`console_main`) and ``gem-train launch``
(:mod:`.launch`)."""

from gem_train.cli.main import console_main, main

__all__ = ["console_main", "main"]
