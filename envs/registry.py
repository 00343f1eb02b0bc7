"""Environments by name: the one module that knows every environment.

`build_env(name, **options)` builds a registered environment: `arithmetic`, `calculator`
(multi-turn tool use), `code` (functions judged by hidden tests in the sandbox), `countdown`, `dataset`, `verifiers` (a verifiers taskset;
envs/verifiers_env.py, the optional `verifiers` extra, imported only when named). Unknown
names and unknown options raise `ValueError` naming them.

It sits above the environments it lists: they import envs/base.py, never this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlpipe.envs.arithmetic import ArithmeticEnv
from rlpipe.envs.base import Environment
from rlpipe.envs.calculator import CalculatorEnv
from rlpipe.envs.code import CodeEnv
from rlpipe.envs.countdown import CountdownEnv
from rlpipe.envs.dataset import DatasetEnv


def _verifiers_env(**options: Any) -> Environment:
    from rlpipe.envs.verifiers_env import VerifiersEnv  # the optional `verifiers` extra

    return VerifiersEnv.from_options(**options)


_FACTORIES: dict[str, Callable[..., Environment]] = {
    "arithmetic": ArithmeticEnv.from_options,
    "calculator": CalculatorEnv.from_options,
    "code": CodeEnv.from_options,
    "countdown": CountdownEnv.from_options,
    "dataset": DatasetEnv.from_options,
    "verifiers": _verifiers_env,
}

ENV_NAMES = tuple(_FACTORIES)


def build_env(name: str, **options: Any) -> Environment:
    """Build the environment registered as `name` with its options (unknown ones raise)."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(sorted(_FACTORIES))}")
    return _FACTORIES[name](**options)
