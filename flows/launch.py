"""`rlpipe run|resume ... --nproc-per-node N`: N training ranks through torch's elastic launcher.

    rlpipe run configs/tiny.toml --nproc-per-node 2                      one machine
    rlpipe run CONFIG --nproc-per-node 8 --nnodes 2 --node-rank R \\
        --rdzv-endpoint HOST:PORT                                         each of 2 machines
    torchrun --nproc-per-node 2 -m rlpipe.flows.cli run CONFIG            the same, by torchrun

The launcher (torch.distributed.launcher's `elastic_launch`, what torchrun runs) starts N copies
of `python -m rlpipe.flows.cli run|resume ...` with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT). In each, flows/runner.py joins the process group: rank 0
runs the flow, the others only train (tasks/ranks.py). When a rank dies, the launcher stops the
others and raises ChildFailedError naming it; the run directory's run.json then says failed and
`rlpipe resume RUN_DIR --nproc-per-node N` continues from the last checkpoint.

No restarts (max_restarts = 0): a restarted rank would rejoin a flow whose other ranks already
failed; resuming the whole run from its checkpoint is the recovery.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path

LAUNCH_FLAGS = ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id")


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data-parallel training (torchrun semantics)")
    group.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                       help="training ranks on this machine (train.parallel 'none' then means ddp)")
    group.add_argument("--nnodes", type=int, default=1, metavar="M", help="machines taking part (default 1)")
    group.add_argument("--node-rank", type=int, default=None, metavar="R",
                       help="this machine's rank, 0..M-1 (static rendezvous at --rdzv-endpoint); "
                            "without it the c10d rendezvous assigns node ranks (needs --rdzv-id)")
    group.add_argument("--rdzv-endpoint", default="", metavar="HOST:PORT",
                       help="rendezvous address: node 0's host and a free port (needed when --nnodes > 1)")
    group.add_argument("--rdzv-id", default="", metavar="ID", help="a job id shared by every node (c10d)")


def check_launch_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the launch flags (None: fine, or no launch asked for)."""
    if args.nproc_per_node is None:
        given = [f for f, v in (("--nnodes", args.nnodes != 1), ("--node-rank", args.node_rank is not None),
                                ("--rdzv-endpoint", args.rdzv_endpoint), ("--rdzv-id", args.rdzv_id)) if v]
        return f"{', '.join(given)} needs --nproc-per-node N" if given else None
    if args.nproc_per_node < 1:
        return f"--nproc-per-node must be >= 1, got {args.nproc_per_node}"
    if args.nnodes < 1:
        return f"--nnodes must be >= 1, got {args.nnodes}"
    if args.nnodes > 1 and not args.rdzv_endpoint:
        return f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address, reachable from every node)"
    if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        return f"--node-rank must be in 0..{args.nnodes - 1}, got {args.node_rank}"
    if args.nnodes > 1 and args.node_rank is None and not args.rdzv_id:
        return "--nnodes > 1 needs --node-rank R (static rendezvous) or --rdzv-id ID (c10d rendezvous)"
    if args.rdzv_endpoint and ":" not in args.rdzv_endpoint:
        return f"--rdzv-endpoint must be HOST:PORT, got {args.rdzv_endpoint!r}"
    return None


def strip_launch_flags(argv: list[str]) -> list[str]:
    """`argv` without the launcher's flags (what each rank runs)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in LAUNCH_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def launch_config(args: argparse.Namespace):
    """torch's LaunchConfig for the flags, as torchrun builds it (standalone on one machine)."""
    from torch.distributed.launcher.api import LaunchConfig

    if args.nnodes == 1 and not args.rdzv_endpoint:  # torchrun --standalone
        backend, endpoint, run_id, rdzv = "c10d", "localhost:0", uuid.uuid4().hex, {}
    elif args.node_rank is not None:  # torchrun's default static rendezvous: node 0 is the master
        backend, endpoint, run_id, rdzv = "static", args.rdzv_endpoint, args.rdzv_id or "rlpipe", \
            {"rank": args.node_rank}
    else:
        backend, endpoint, run_id, rdzv = "c10d", args.rdzv_endpoint, args.rdzv_id, {}
    return LaunchConfig(min_nodes=args.nnodes, max_nodes=args.nnodes, nproc_per_node=args.nproc_per_node,
                        run_id=run_id, rdzv_endpoint=endpoint, rdzv_backend=backend, rdzv_configs=rdzv,
                        max_restarts=0, monitor_interval=0.5, start_method="spawn")


def failure_message(error) -> str:
    """The failed ranks of a ChildFailedError, the cause first: ranks the launcher stopped with
    SIGTERM because another failed (exit 143 from rlpipe, or -15) come last."""
    import signal

    def order(item):
        rank, failure = item
        return (failure.exitcode in (143, -signal.SIGTERM), failure.timestamp, rank)

    lines = []
    for rank, failure in sorted(error.failures.items(), key=order):
        how = f"exit code {failure.exitcode}"
        if failure.exitcode < 0:
            try:
                how = f"killed by {signal.Signals(-failure.exitcode).name}"
            except ValueError:
                pass
        lines.append(f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}")
    return "; then ".join(lines)


def launch(args: argparse.Namespace, rank_argv: list[str], run_dir: Path) -> int:
    """Run `python -m rlpipe.flows.cli *rank_argv` on every rank; 0, or 1 with the failed ranks named."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default: N ranks share the cores
    try:
        elastic_launch(launch_config(args), sys.executable)("-u", "-m", "rlpipe.flows.cli", *rank_argv)
    except ChildFailedError as error:
        mark_failed(run_dir)
        print(f"rlpipe: data-parallel run failed: {failure_message(error)}\n  {resume_hint(args, run_dir)}",
              file=sys.stderr)
        return 1
    return 0


def resume_hint(args: argparse.Namespace, run_dir: Path) -> str:
    """The resume command of a failed launch, with the node flags of a multi-node one."""
    flags = f"--nproc-per-node {args.nproc_per_node}"
    if args.nnodes == 1:
        return f"`rlpipe resume {run_dir} {flags}` continues from the last checkpoint"
    flags += f" --nnodes {args.nnodes}" + (" --node-rank R" if args.node_rank is not None else f" --rdzv-id {args.rdzv_id}")
    return (f"`rlpipe resume {run_dir} {flags} --rdzv-endpoint {args.rdzv_endpoint}` on every node "
            "(R: the node's rank) continues from the last checkpoint")


def other_node(args: argparse.Namespace) -> bool:
    """Whether this launcher is a node other than node 0 of a multi-node run: the run folder
    (shared by every node) is node 0's to create, so this one neither checks nor touches it."""
    return args.nnodes > 1 and args.node_rank is not None and args.node_rank > 0


def mark_failed(run_dir: Path) -> None:
    """run.json files still saying running (a rank 0 killed before it could say failed) → failed."""
    from rlpipe.flows.common import read_json, write_json_atomic

    for path in [run_dir / "run.json", *run_dir.glob("*/run.json")]:
        if path.is_file():
            state = read_json(path)
            if state.get("status") == "running":
                write_json_atomic(path, {**state, "status": "failed"})


def launched_rank():
    """This process's DistEnv-like (rank, world size) when a launcher started it, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None
