"""The RL steps both GPU comparisons time: rlpipe's stage functions and TRL's GRPOTrainer.

bench_gpu's `rl_vs_trl` runs both sides in its process; gpu_vllm's `rl_vs_trl_vllm` runs each in a
process of its own with vLLM sampling. Only torch, transformers and (for the TRL side) TRL and
datasets are needed: no Prefect, Parquet tables or MLflow.
"""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path

import torch
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.torch_engine import TorchEngine
from rlpipe.envs.registry import build_env
from rlpipe.models.chat import template_ids
from rlpipe.models.device import model_device, synchronize
from rlpipe.tasks.setup import stop_token_ids
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.rl_loss import build_rl_loss
from rlpipe.training.step import StepOptions, build_optimizer, forward_backward, optim_step


def arithmetic_prompts(tokenizer, count: int, seed: int):
    """The arithmetic environment, its first `count` train examples and their prompt token ids
    (the chat template with the assistant generation prompt, as the generate stage encodes them)."""
    env = build_env("arithmetic")
    examples = list(env.examples("train", seed=seed))[:count]
    return env, examples, [template_ids(tokenizer, env.reset(e), add_generation_prompt=True) for e in examples]


def rlpipe_steps(model, tokenizer, args, cuda_graphs: bool = False, engine=None) -> dict:
    """rlpipe's stage functions, no Prefect/Parquet/MLflow: generate, reward, advantages, pack, train
    (sampling with `engine`, default the torch engine in bf16)."""
    env, examples, prompts = arithmetic_prompts(tokenizer, args.prompts * (args.steps + 2), seed=0)
    engine = engine or TorchEngine(model, dtype=torch.bfloat16, cuda_graphs=cuda_graphs)
    device = model_device(model)
    optimizer = build_optimizer(model, lr=1e-6)
    loss_fn = build_rl_loss("reinforce")
    stops = stop_token_ids(tokenizer)
    times, tokens, phases = [], [], []
    for step in range(args.steps):
        sl = slice(step * args.prompts, (step + 1) * args.prompts)
        synchronize(device)
        start = time.perf_counter()
        out = engine.generate(prompts[sl], SamplingParams(n=args.group, max_new_tokens=args.max_new, seed=step,
                                                          stop_token_ids=stops))
        generated = time.perf_counter()
        seqs = []
        for example, prompt, group in zip(examples[sl], prompts[sl], out, strict=True):
            rewards = [env.reward(example, tokenizer.decode(c.tokens, skip_special_tokens=True)).reward for c in group]
            mean = sum(rewards) / len(rewards)
            for c, r in zip(group, rewards, strict=True):
                seqs.append(Sequence(tokens=prompt + c.tokens, weights=[0.0] * len(prompt) + [r - mean] * len(c.tokens),
                                     logprobs=[0.0] * len(prompt) + c.logprobs, prefix_len=len(prompt),
                                     loss_mask=[False] * len(prompt) + [True] * len(c.tokens)))
        batches = pack(seqs, 16_384)
        forward_backward(model, batches, loss_fn, StepOptions(autocast=device.type == "cuda"))
        optim_step(model, optimizer, None, max_grad_norm=1.0)
        engine.sync(None, step + 1)  # vLLM: the push (or, asleep, at the next wake-up)
        synchronize(device)
        end = time.perf_counter()
        times.append(end - start)
        phases.append({"generate": generated - start, "train": end - generated})
        tokens.append(sum(len(s.tokens) for s in seqs))
    keep = slice(1, None)  # the first step warms up kernels and caches
    return {"seconds_per_step": statistics.median(times[keep]), "seconds_all": times,
            "tokens_per_second": sum(tokens[keep]) / sum(times[keep]), "phases": phases}


def trl_steps(model, tokenizer, args, workdir: Path, vllm: dict | None = None, on_trainer=None) -> dict:
    """TRL's GRPOTrainer on the same steps; `vllm`: GRPOConfig's vllm_* settings (else TRL generates
    with transformers), `on_trainer`: called with the trainer before it trains."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    env, examples, _ = arithmetic_prompts(tokenizer, args.prompts * (args.steps + 2), seed=0)
    by_id = {e.example_id: e for e in examples}
    dataset = Dataset.from_dict({"prompt": [env.reset(e) for e in examples],
                                 "example_id": [e.example_id for e in examples]})
    lengths: list[int] = []

    def reward(completions, example_id, completion_ids=None, **kwargs):
        if completion_ids is not None:
            lengths.append(sum(len(c) for c in completion_ids))
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(env.reward(by_id[i], t).reward) for t, i in zip(texts, example_id, strict=True)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_train_begin(self, *_, **__):
            self.ends.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            synchronize(model_device(model))
            self.ends.append(time.perf_counter())

    clock = Clock()
    config = GRPOConfig(
        output_dir=str(workdir / "trl"), max_steps=args.steps, per_device_train_batch_size=args.group * 4,
        # one optimizer step per generation batch, in micro-batches of 4 prompts' completions
        # (all 256 at once ran out of the GPU's 80 GB without gradient checkpointing)
        gradient_accumulation_steps=args.prompts // 4, num_generations=args.group, max_completion_length=args.max_new,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1, scale_rewards="none", loss_type="dapo",
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none",
        bf16=model_device(model).type == "cuda", gradient_checkpointing=False, use_vllm=bool(vllm), seed=0, shuffle_dataset=False, dataloader_num_workers=0,
        disable_tqdm=True, log_completions=False, learning_rate=1e-6, **(vllm or {}),
    )
    optimizer = build_optimizer(model, lr=1e-6)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock], optimizers=(optimizer, None))
    if on_trainer is not None:
        on_trainer(trainer)
    trainer.train()
    times = [b - a for a, b in itertools.pairwise(clock.ends)]
    keep = slice(1, None)
    logs = [e for e in trainer.state.log_history if "completions/mean_length" in e]
    mean_len = statistics.mean(float(e["completions/mean_length"]) for e in logs) if logs else None
    return {"seconds_per_step": statistics.median(times[keep]), "seconds_all": times,
            "completion_tokens_mean": mean_len,
            "effective_args": {k: getattr(config, k, None) for k in (
                "per_device_train_batch_size", "num_generations", "max_completion_length", "bf16",
                "gradient_checkpointing", "use_vllm", "vllm_mode", "vllm_enable_sleep_mode",
                "vllm_gpu_memory_utilization", "loss_type", "beta", "steps_per_generation")}}
