"""Suite-wide settings for a small CI box (2 cores): one intra-op thread per process.

With torch's default thread count, tests (and the torchrun ranks they spawn) oversubscribe the
cores and timings swing by 30x; one thread keeps the suite fast and stable.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)
