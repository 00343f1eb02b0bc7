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

A lost node (more than one node: --nnodes M): torch's launcher starts each rank in a session of
its own, so a killed launcher left its ranks running as orphans; each rank now gets SIGTERM when
its launcher dies (Linux's parent-death signal), so a node's launcher and its ranks end together.
Every rank beats in the launch's store (training/peer_watch.py). A rank whose collective fails
because a peer process died learns within 5 s which rank it lost, prints one line naming it,
leaves that line in its launcher's error file and exits 1; a rank whose peer stops beating for
train.peer_timeout_s (30 s) does the same wherever it is (rank 0 through its SIGTERM stop). Each
launcher then fails with one line naming its own failed ranks and what they lost, and the resume
command of every node.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
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
        said = failure.error_file_data.get("message")  # a rank's own line (report_to_launcher)
        lines.append(f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}"
                     + (f": {said}" if isinstance(said, str) and said else ""))
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


def run_rank(config, run) -> int:
    """A launched rank: end with the launcher, join the process group and beat in its store;
    rank 0 runs `run()` and then releases the others, which train. A rank > 0 whose collective
    fails because it lost a peer says which (`lost_peers`) and exits 1."""
    import torch.distributed as dist
    from rlpipe.models.device import resolve_device
    from rlpipe.tasks.ranks import end_run, follow_ranks
    from rlpipe.training.distributed import init_from_environment
    from rlpipe.training.peer_watch import start_watch, stop_watch

    die_with_launcher()
    env = init_from_environment(resolve_device(config.device).type, config.train.parallel_timeout_s)
    if env.rank == 0:  # SIGTERM outside the run's own stop (its set-up, its failure path): exit through
        # atexit, which stops the embedded Prefect server; other ranks keep the default, which ends
        # them even while they wait in a collective
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if env.world_size > 1:
        start_watch(env.rank, env.world_size, config.train.peer_timeout_s, stop_lost_rank(env.rank))
    try:
        if env.rank > 0:
            try:
                follow_ranks()
            except Exception as error:
                if (lost := lost_peers(error)) is None:
                    raise
                print(f"rlpipe: rank {env.rank} failed: {lost}", file=sys.stderr)
                return 1
            return 0
        code = run()
        if code == 0:
            end_run()
        return code
    finally:
        stop_watch()
        # wrapped models first: a DDP reducer freed after its process group can hang the exit
        gc.collect()
        dist.destroy_process_group()


def die_with_launcher() -> None:
    """SIGTERM to this process when its parent, the launcher, dies (Linux's PR_SET_PDEATHSIG; a
    no-op elsewhere): rank 0 then stops its run as on any SIGTERM, the other ranks end at once."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the call
        os.kill(os.getpid(), signal.SIGTERM)


STOP_GRACE_S = 60.0
"""Seconds rank 0 has to stop its run after losing a peer (as on SIGTERM) before it exits at once."""


def stop_lost_rank(rank: int) -> Callable[[str], None]:
    """What a rank does when its heartbeat thread finds a peer lost (training/peer_watch.py): say
    so, leave the line for the launcher, then rank 0 stops its run as on SIGTERM (tables drain,
    run.json says failed; it exits anyway after STOP_GRACE_S, where a collective with a vanished
    peer holds it), and any other rank, which holds nothing persisted, exits at once."""

    def stop(line: str) -> None:
        print(f"rlpipe: rank {rank}: {line}; stopping", file=sys.stderr, flush=True)
        report_to_launcher(line)
        if rank > 0:
            os._exit(1)
        deadline = threading.Timer(STOP_GRACE_S, os._exit, (1,))
        deadline.daemon = True
        deadline.start()
        os.kill(os.getpid(), signal.SIGTERM)

    return stop


def lost_peers(error: BaseException) -> str | None:
    """Where a launched rank's `error` came with peers that stopped beating (or node 0's store
    gone): one line naming them and the error, also left for the launcher (`report_to_launcher`);
    None where every rank lives or no watch runs."""
    from rlpipe.training.peer_watch import SILENT_S, StoreLost, active, lost_line

    watch = active()
    if watch is None:
        return None
    on_lost, watch.on_lost = watch.on_lost, None  # meanwhile the heartbeat thread must not stop the rank
    try:
        lost, where = watch.silent(SILENT_S)
        what = lost_line(lost, where, watch.world_size, SILENT_S) if lost else None
    except StoreLost as gone:
        what = f"lost node 0: {gone}"
    if what is None:
        watch.on_lost = on_lost
        return None
    watch.close()
    cause = re.sub(r"^\[[^\]]*:\d+\] ", "", " ".join(str(error).split()))  # gloo's "[pair.cc:553] "
    line = f"{what} ({type(error).__name__}: {cause[:160]}{'…' if len(cause) > 160 else ''})"
    report_to_launcher(line)
    return line


def report_to_launcher(line: str) -> None:
    """`line` in this rank's torchelastic error file, which its launcher reads into the failure
    it reports (failure_message)."""
    from rlpipe.flows.common import write_json_atomic

    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        write_json_atomic(Path(path), {"message": line, "timestamp": int(time.time())})
