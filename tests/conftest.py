"""Test-wide settings: offline, quiet, and one torch thread.

Tiny models are overhead-bound: a second intra-op thread buys little and makes timings swing
when the machine is shared, so in-process tests run single-threaded (subprocess tests keep the
CLI's defaults).
"""

import os

import torch

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RLPIPE_PROGRESS", "0")
torch.set_num_threads(1)
