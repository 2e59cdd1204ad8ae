"""``python -m benchmarks``: run the whole suite (see :mod:`benchmarks.run_all`)."""

from benchmarks.run_all import main

raise SystemExit(main())
