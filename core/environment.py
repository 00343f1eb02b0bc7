"""Process-wide defaults: no telemetry, quiet progress output; set before the first Prefect,
MLflow or Hugging Face import, each only where the user has not set it. Hub access is left as the
user's environment says (HF_HUB_OFFLINE, HF_HOME, HF_TOKEN): a hub id in `model.path` or `hf:`
dataset downloads on a machine with a network, and reads the cache only under HF_HUB_OFFLINE=1."""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import os


def quiet_defaults() -> None:
    """Environment defaults: no telemetry, patient embedded server, quiet progress output."""
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # one INFO line per task run would drown the phase progress bars; the Prefect UI keeps them
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    # torchao (the `lean` extra), imported by transformers whenever installed, warns for each of
    # its CUDA kernel libraries a CPU-only torch cannot load; rlpipe uses its Python optimizers only
    logging.getLogger("torchao").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars would drown the phase bars
    hf_logging.set_verbosity_error()


@functools.cache
def exit_without_final_collections() -> None:
    """When this process exits, after every exit handler registered later than this call (Prefect's,
    MLflow's, the table writer's) has run, freeze the garbage collector's objects: the interpreter's
    shutdown then skips its collections over them. A run holds torch, transformers, Prefect and
    MLflow, some 700,000 tracked objects, and those collections took 2 to 7 s of CPU at the end of
    every `rlpipe` process (0.2 s with them skipped); the operating system frees the memory anyway.
    Objects are still deallocated as the interpreter clears its modules, exit handlers registered
    before this call (logging's flush) still run, and nothing rlpipe writes waits on a collection:
    files and databases are closed explicitly. Idempotent (cached: registered once)."""
    atexit.register(gc.freeze)
