"""One rank of :func:`gem_parallel.testing.run_distributed`: ``python -m gem_parallel.testing --file ...``."""

from gem_parallel.testing import _worker_main

raise SystemExit(_worker_main())
