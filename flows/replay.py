"""`rlpipe replay RUN_DIR --step N`: recompute RL step N from the stored tables and the checkpoint
before it (tasks/replay_step.py), print its loss, grad norm, lr and per-token log-probs beside the
logged values, and exit 1 on any mismatch (2 when the step cannot be replayed).

    rlpipe replay runs/demo/rl --step 60
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlpipe replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="an RL run directory (holds config.json and tables/)")
    parser.add_argument("--step", type=int, required=True, help="the optimizer step to replay (from 1)")
    parser.add_argument("--start", default=None,
                        help="the run's starting weights (a checkpoint folder), when the run does not record them")
    args = parser.parse_args(argv)
    from rlpipe.tasks.replay_step import ReplayError, format_replay, replay_step

    try:
        replay = replay_step(args.run_dir, args.step, args.start)
    except ReplayError as error:
        print(f"rlpipe replay: {error}", file=sys.stderr)
        return 2
    print(format_replay(replay))
    return 0 if replay.ok else 1


if __name__ == "__main__":
    sys.exit(main())
