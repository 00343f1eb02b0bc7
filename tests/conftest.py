"""Test-wide settings: offline, quiet, and one torch thread.

Tiny models are overhead-bound: a second intra-op thread buys little and makes timings swing
when the machine is shared, so in-process tests run single-threaded (subprocess tests keep the
CLI's defaults).
"""

import os

import torch
from rlpipe.core.environment import quiet_defaults

quiet_defaults()
os.environ.setdefault("RLPIPE_PROGRESS", "0")
torch.set_num_threads(1)
