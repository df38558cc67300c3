"""``python -m benchmarks.wan``: see ``benchmarks.wan.bench``."""

import sys

from benchmarks.wan.bench import main

sys.exit(main())
