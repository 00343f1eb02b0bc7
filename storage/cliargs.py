"""What the `rlpipe` subcommands whose `main(argv) -> int` returns an exit status share (sql,
rescore, lineage, report): tests and flows/cli.py call them in-process, so argparse's exits and
the commands' own refusals come back as a status instead of ending the process.

    args = parse_args(build_parser(), argv)
    if isinstance(args, int):  # --help (0) or a usage error (2), argparse printed the message
        return args
    ...
    return fail(PROG, "no such run")  # "rlpipe xyz: no such run" on stderr, status 2

Here, in storage, because every layer with a command (storage, dashboards, flows) may import it.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(
    parser: argparse.ArgumentParser, argv: list[str] | None, *, intermixed: bool = False
) -> argparse.Namespace | int:
    """`argv` (default: sys.argv[1:]) parsed, or the status argparse exited with."""
    args = sys.argv[1:] if argv is None else argv
    try:
        return parser.parse_intermixed_args(args) if intermixed else parser.parse_args(args)
    except SystemExit as exit_:  # argparse already printed its message
        return int(exit_.code or 0)


def fail(prog: str, message: str) -> int:
    """Say `message` on stderr after the command's name; the status of a refused command (2)."""
    print(f"{prog}: {message}", file=sys.stderr)
    return 2
