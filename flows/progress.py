"""Progress bars for long phases (tqdm on stderr; quiet when RLPIPE_PROGRESS=0)."""

from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm


def progress(total: int, desc: str, initial: int = 0, unit: str = "step") -> tqdm:
    disabled = os.environ.get("RLPIPE_PROGRESS", "1") == "0"
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr,
                disable=disabled, dynamic_ncols=True, mininterval=0.5, leave=True)
