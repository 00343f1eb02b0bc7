"""What the group buffer checks of a user's batch maker (rollouts/group_buffer.py): a digest of
each group it hands out, and its own copies of them."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rlpipe.rollouts.advantages import Group


def group_digest(group: Group) -> str:
    """A group's identity and content (ids, example, versions, rewards): what a maker must not change."""
    text = json.dumps([group.group_id, group.env, group.example_id, group.policy_version, group.attempt,
                       list(group.sample_ids), [repr(float(r)) for r in group.rewards]])
    return hashlib.sha256(text.encode()).hexdigest()


def _copy(group: Group) -> Group:
    return Group.from_dict(group.to_dict())


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{text[:60] + '...' if len(text) > 60 else text} (a {type(value).__name__})"

