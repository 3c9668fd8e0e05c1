"""`python -m recsys_pipe.bench NAME [ARGS...]`: the same as `recsys-bench NAME [ARGS...]`."""

import sys

from recsys_pipe.bench.cli import main

sys.exit(main())
