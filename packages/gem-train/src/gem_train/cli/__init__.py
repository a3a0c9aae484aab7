"""The ``gem-train`` command (:func:`main`) and ``gem-train launch`` (:mod:`.launch`)."""

from gem_train.cli.main import main

__all__ = ["main"]
