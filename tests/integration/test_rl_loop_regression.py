"""Regression guard for the RL loop: k = 0 (synchronous) must train bit-identical weights to the
loop before its redesign (a RolloutSource owning sampling rounds and the group buffer), on the
same seed.

The expected sha256 of the final `model.safetensors` were computed with the pre-redesign loop
(commit 900ca3a, torch 2.13 CPU, one thread) by this very test; any change to what the loop samples,
selects, packs or trains (order included) changes them. If a deliberate algorithmic change moves
them, say so in the commit and recompute them.

Recomputed once since: the chunked log-softmax saves the logsumexp and folds 1/τ
into the GEMM (training/logprob_kernels.py), which changes float rounding only. With the previous
training/logprobs.py on the same tree both hashes above were still reproduced; the new weights
differ from them by at most 1.2e-3 after 6 steps (Adam's first steps move each weight by ~lr =
3e-4 whatever the gradient's size, so a rounding-level sign flip of a near-zero gradient shows).

Bit-identical holds on one kind of CPU only: MKL's kernels round differently by vendor and vector
width, so the hashes are kept per machine kind (vendor, torch's CPU capability, torch version).
The test fails on a known kind when the weights differ and is skipped, saying so, before any run
on another (tests/unit/test_step_reference.py checks a training step on every machine).
The runs are float32 throughout (`model.bf16_autocast = false`): on a CPU with AVX512-BF16 the
default would train under bf16 autocast, which the earlier machines could not run (there it was
a no-op, so their hashes are float32 too). The AuthenticAMD/AVX512 hashes were recorded
from commit 0867608, the tree whose runs gave the first hashes on the earlier
machines, and from this commit: both gave the same.
"""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

import pytest
import torch

from tests.built_once import build_once

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

VARIANTS = {
    # tiny.toml as is: over-sampling ×2 with carried surplus groups
    "base": {},
    # PPO ratio over two epochs, rloo with std normalisation, no over-sampling, partial batches
    "ppo": {"loss": {"type": "ppo_clip", "ppo_epochs": 2}, "advantages": {"estimator": "rloo", "normalize_std": True},
            "buffer": {"oversample_factor": 1.0, "partial_batches": True, "max_attempts": 2}},
}
# machine kind -> variant -> sha256 of the final model.safetensors
EXPECTED = {
    "earlier machines (kind not recorded), torch 2.13.0+cpu": {
        "base": "bd0fbc1b64f46c9769f83788d2c964cd1ff26f6f8b1c56252082601b4d955d80",
        "ppo": "3e7d99fd32676a1c4361224afc2dda7b4bd244b090f707454f9955a9efcff9bd"},
    "AuthenticAMD AVX512, torch 2.13.0+cpu": {
        "base": "bc402e8e03fd70a1ea49da0451303a3a48d9bae463d25c6f79c68b23d9c323c9",
        "ppo": "3e9f9d8ba71d3c4c324c8bc81d7b87e3e7160cae2f0960376ed22536a6be3c13"},
}


def machine_kind() -> str:
    """What decides float rounding here: the CPU vendor, torch's vector width and torch itself."""
    vendor = "unknown-vendor"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        vendor = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                       if line.startswith("vendor_id")), vendor)
    return f"{vendor} {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}"


def merged(base: dict, changes: dict) -> dict:
    """`base` with `changes` over it, table by table: a change to one key of [rl.buffer] keeps
    the buffer's other keys of the base config."""
    out = dict(base)
    for key, value in changes.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def config_dict(runs_root: Path, name: str, rl: dict) -> dict:
    """tiny.toml in `runs_root` as run `name`, with the `[rl]` changes `rl` (its sub-tables merged
    into tiny.toml's)."""
    config = tomllib.loads((ROOT / "configs" / "tiny.toml").read_text())
    config.update(runs_root=str(runs_root), run_name=name, threads=1)
    config["tracking"] = {"enabled": False, "report": False, "prefect_task_runs": False}
    config["model"] = {**config.get("model", {}), "bf16_autocast": False}
    config["rl"] = merged(config["rl"], {"steps": 6, **rl})
    return config


@pytest.fixture(scope="session")
def sft_checkpoint(tmp_path_factory) -> str:
    """tiny.toml's SFT phase, trained once per test session (tests/built_once.py): every module
    that imports this fixture starts its RL runs from the same checkpoint, and only reads it."""
    from rlpipe.flows.supervised import run_supervised
    from rlpipe.tasks.config import validate_config

    def build(root: Path) -> None:
        checkpoint = run_supervised(validate_config(config_dict(root, "sft", {})), "sft")["checkpoint"]
        (root / "checkpoint.txt").write_text(str(checkpoint))

    return (build_once(tmp_path_factory, "sft-checkpoint", build) / "checkpoint.txt").read_text()


def final_weights_sha(run_dir: Path) -> str:
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return hashlib.sha256((last / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_synchronous_loop_trains_the_same_weights_as_before_the_redesign(variant, sft_checkpoint, tmp_path):
    from rlpipe.flows.rl import run_rl
    from rlpipe.tasks.config import validate_config

    torch.set_num_threads(1)
    config = validate_config(config_dict(tmp_path, variant, VARIANTS[variant]))
    run_rl(config, start_checkpoint=sft_checkpoint)
    sha = final_weights_sha(config.run_dir / "rl")
    kind = machine_kind()
    assert sha == EXPECTED[kind][variant], f"{variant}: the loop trained other weights than before ({sha} on {kind})"


@pytest.fixture(scope="module", autouse=True)
def known_machine_kind() -> None:
    """Skip, before paying for any run, where no hashes were recorded: bit-identity is a change
    detector for one kind of machine. The correctness of a training step on every machine is
    tests/unit/test_step_reference.py's (a float64 reference)."""
    kind = machine_kind()
    if kind not in EXPECTED:
        pytest.skip(f"no reference weights for this kind of machine ({kind}): add them to EXPECTED after "
                    "checking that a commit which passed elsewhere gives the same here")
