"""Importing the user's own code: reward functions, sample filters, tasksets, batch makers.

A spec is "module:attribute" (or a bare module for `reward_module`). The module is looked up
on sys.path and then in the current working directory, so `rlpipe run --set
rl.filter.sample_filter=myfilters:keep` finds ./myfilters.py however rlpipe was started (the console
script's sys.path does not hold the working directory). The working directory goes last on the
path: a user's models.py or tasks/ never shadows an installed package.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def import_user_module(name: str) -> Any:
    """The module `name`, also from the working directory; ImportError when neither has it."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    return importlib.import_module(name)


def import_user_object(spec: str, key: str) -> Any:
    """The attribute a "module:attribute" spec names; ValueError naming `key` and the spec otherwise."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{key} must be 'module:attribute', got {spec!r}")
    try:
        module = import_user_module(module_name)
    except ImportError as error:
        raise ValueError(f"{key} {spec!r}: cannot import module {module_name!r}: {error}") from None
    if not hasattr(module, attribute):
        raise ValueError(f"{key} {spec!r}: module {module_name!r} has no attribute {attribute!r}")
    return getattr(module, attribute)
