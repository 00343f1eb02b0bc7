"""Every command docs/CLUSTER.md prints, and what the tests do with each (as tests/readme_commands.py
does for README.md, with its parser).

RUN: tests/integration/test_cluster_commands.py runs it exactly as printed, in a temporary folder
holding a copy of configs/. Every other command needs a real cluster, and its reason names the test
that rehearses it on one machine. tests/unit/test_readme.py fails when the page gains a command
this list does not know.
"""

from __future__ import annotations

from pathlib import Path

from tests.readme_commands import INSTALL, PLACEHOLDER, RUN, readme_commands

CLUSTER = Path(__file__).resolve().parents[1] / "docs" / "CLUSTER.md"
NODES = ("needs a real cluster (several machines, node0's host name); tests/integration/test_multinode_run.py "
         "runs two nodes of one rank each on 127.0.0.1 and a free port")
SERVERS = ("needs a real cluster (servers on fixed ports of named hosts); tests/integration/test_rl_http_flow.py "
           "runs the RL flow on two `rlpipe serve` servers on free loopback ports")
PREFECT = ("needs a real cluster (a server every machine reaches, workers on each); "
           "tests/integration/test_deployments.py runs this sequence on one machine on a free port")
DASK = ("needs a real cluster (a scheduler on a fixed port of a named host); tests/integration/"
        "test_cluster_scoring_run.py scores on a distributed.LocalCluster of 2 process workers")

COMMANDS: dict[str, str] = {
    "rlpipe run configs/tiny.toml --nproc-per-node 2": RUN,
    "rlpipe run configs/tiny.toml --set run_name=tiny-dask --set cluster.runner=dask --set cluster.workers=2": RUN,
    "rlpipe run CONFIG --nproc-per-node 8 --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29500": NODES,
    "rlpipe run CONFIG --nproc-per-node 8 --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29500": NODES,
    "rlpipe resume runs/NAME --nproc-per-node 8 --nnodes 2 --node-rank R --rdzv-endpoint node0:29500": NODES,
    "rlpipe serve MODEL --port 8001": SERVERS,
    "rlpipe run CONFIG --set engine.type=http --set 'engine.urls=[\"http://gen1:8001\", \"http://gen2:8001\"]'":
        SERVERS,
    "prefect server start --host 0.0.0.0": PREFECT,
    "prefect work-pool create rlpipe --type process": PREFECT,
    "prefect deploy --all": PREFECT,
    "prefect worker start --pool rlpipe": PREFECT,
    "rlpipe run CONFIG --set runs_root=/shared/runs":
        "needs a filesystem that several machines share; the nodes of tests/integration/test_multinode_run.py "
        "share one machine's runs_root",
    "pip install -e '.[cluster]'": INSTALL,
    "dask scheduler --port 8786": DASK,
    "dask worker tcp://sched:8786 --nworkers 8 --nthreads 1 --resources sandbox=1": DASK,
    "rlpipe run CONFIG --set cluster.runner=dask --set cluster.address=tcp://sched:8786 \\": DASK,
    "rlpipe serve": PLACEHOLDER,
    "rlpipe resume": PLACEHOLDER,
}


def cluster_commands() -> list[str]:
    """Every command docs/CLUSTER.md prints, in order, each once, without its trailing comment."""
    return readme_commands(CLUSTER.read_text())
