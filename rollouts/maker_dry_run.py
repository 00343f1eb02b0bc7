"""The dry run pre-flight gives a user's batch maker (tasks/preflight.py): the maker built, one
batch filled through the group buffer's checks on synthetic groups, its state round-tripped
through JSON; one line naming the maker where any of it fails."""

from __future__ import annotations

import json

from rlpipe.rollouts.advantages import Group
from rlpipe.rollouts.group_buffer import BatchFillError, BufferOptions, GroupBuffer


def dry_run_maker(options: BufferOptions) -> None:
    """Pre-flight for a user's batch maker (tasks/preflight.py): build it, run the sampling rounds
    of one batch on synthetic groups (two rewards, 0 and 1), take the batch, and round-trip its
    state through JSON into a second instance. BatchMakerError (one line naming it) where any of
    that breaks the contract; a maker that does not make a batch from these groups is not refused
    (its rule may need real ones)."""
    buffer = GroupBuffer(options)
    counter = iter(range(1_000_000))

    def synthetic(attempt: int, n: int) -> list[Group]:
        out = []
        for _ in range(n):
            i = next(counter)
            out.append(Group(f"preflight-{i}", "preflight", f"preflight-{i}", 0, [f"preflight-{i}:0", f"preflight-{i}:1"],
                             [0.0, 1.0], attempt))
        return out

    try:
        buffer.fill(0, synthetic)
        buffer.take()
    except BatchFillError:
        pass
    state = buffer.state_dict()
    try:
        text = json.dumps(state["maker"], allow_nan=False)
    except (TypeError, ValueError) as error:
        raise buffer._refuse(f"state_dict is not plain JSON ({error})") from None
    GroupBuffer(options)._ask("load_state_dict", buffer.maker.__class__(options.maker).load_state_dict,
                              json.loads(text))

