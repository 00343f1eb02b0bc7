"""The order in which the test session hands test files to its xdist workers: the most expensive
files first, so that the last files to run are short ones and the workers end together.

`make test` runs each file on one worker (`--dist loadfile`), the next file going to whichever
worker is nearly out of work. By default xdist orders the files by how many tests each holds,
most first: the unit files with dozens of quick tests run first, and the integration files that
hold one or a few tests of a minute or more each (a whole run in a subprocess, a vLLM server, a
kill-and-resume chain) run last. Then one worker may still be on such a file, with another taken
ahead of time behind it, while the others have nothing left to do.

HEAVIEST_FIRST lists the files whose tests take longest, heaviest first, by the seconds each file's
tests took (setup included) in a whole `make test` on three workers; every
other file runs after them, in collection order. A file's own tests keep their order. The list
only orders: a file missing from it, or one no longer there, changes nothing but the balance.
"""

from __future__ import annotations

HEAVIEST_FIRST = (
    "tests/integration/test_every_loss.py",
    "tests/integration/test_faults.py",
    "tests/integration/test_cluster_commands.py",
    "tests/integration/test_compile_run.py",
    "tests/integration/test_readme_commands.py",
    "tests/integration/test_vllm_cpu_served.py",
    "tests/integration/test_deployments.py",
    "tests/integration/test_commit_faults.py",
    "tests/integration/test_vllm_cpu.py",
    "tests/integration/test_disk_full_run.py",
    "tests/integration/test_distributed_run.py",
    "tests/integration/test_thinking_pipeline.py",
    "tests/integration/test_multinode_run.py",
    "tests/integration/test_resume.py",
    "tests/integration/test_partial_rollouts_run.py",
    "tests/integration/test_serve_calculator_agent.py",
    "tests/integration/test_code_flow.py",
    "tests/unit/test_gpu_checks_path.py",
    "tests/integration/test_gsm8k_run.py",
    "tests/integration/test_corrupt_checkpoint_run.py",
    "tests/integration/test_distill_run.py",
    "tests/integration/test_run_folder_copies.py",
    "tests/integration/test_flows.py",
    "tests/integration/test_cluster_scoring_run.py",
    "tests/integration/test_rl_http_flow.py",
    "tests/integration/test_losses_learn.py",
    "tests/integration/test_async_rl.py",
    "tests/unit/test_tracking.py",
    "tests/unit/test_warm_cli.py",
    "tests/unit/test_compaction.py",
    "tests/integration/test_distributed.py",
    "tests/integration/test_serve_abuse_http.py",
    "tests/integration/test_distributed_extras.py",
)


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def heaviest_first(nodeids: list[str]) -> list[int]:
    """The positions of `nodeids` in the order their files should run: HEAVIEST_FIRST's files in
    its order, then every other file in the order it came; within a file, the order it came."""
    rank = {name: position for position, name in enumerate(HEAVIEST_FIRST)}
    first_seen: dict[str, int] = {}
    for nodeid in nodeids:
        first_seen.setdefault(file_of(nodeid), len(first_seen))

    def key(index: int) -> tuple[int, int, int, int]:
        name = file_of(nodeids[index])
        listed = name in rank
        return (0 if listed else 1, rank.get(name, 0), first_seen[name], index)

    return sorted(range(len(nodeids)), key=key)
