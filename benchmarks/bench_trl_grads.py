"""Is rlpipe's RL update TRL's? Gradients of both on identical rollouts, step by step.

bench_trl found rlpipe's final reward 0.015-0.021 below TRL's on every seed pair. This separates
the update from the sampling: from one start (bench_trl's SFT checkpoint, or --start), each step

1. samples one batch with rlpipe's engine from rlpipe's current weights (8 prompts x 8, temperature
   1, the env's reward, advantage r − group mean), the SAME rollouts for both sides;
2. computes rlpipe's gradient (`forward_backward`, reinforce, token normaliser) on its model and
   TRL's (`GRPOTrainer._compute_loss`, loss_type dapo, beta 0, the same tokens laid out as TRL
   lays them: left-padded prompts, right-padded completions) on its own copy;
3. reports the loss of each, the cosine and the norm ratio of the two gradients, then steps each
   model with its own AdamW (the same settings) and reports how far the weights drifted apart.

Identical algorithms give cosine ~1, norm ratio ~1 and a drift at float noise, step after step;
then a reward gap comes from the sampling (engines, RNG streams), i.e. run-to-run noise. It also
records what shapes TRL's sampling (its EOS ids and generation config) next to rlpipe's.

Measured (fp32, 5 steps, bench_trl's SFT start): cosine 1 − <1e-9 every step, norm
ratio 1 ± 2e-7, max |Δgrad| 1e-7, weights 7e-7 apart after 5 steps (not growing): the same update.
Both sides also put the same prompt tokens in front of the model, stop at the same EOS ids
([0, 2]) and sample at temperature 1, top-p 1, top-k 0. (A first run left TRL's bf16 at its
default, True: its log-probs then differed by up to 0.03 nats and the gradients by cosine 0.99993.)

    python -m benchmarks.bench_trl_grads [--start SFT_CHECKPOINT] [--steps 5] [--out runs/bench/trl_grads.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results import write_results

PROMPTS, GROUP, LR = 8, 8, 1e-4


def grad_vector(model) -> torch.Tensor:  # noqa: F821
    import torch

    return torch.cat([p.grad.detach().flatten().double() for p in model.parameters() if p.grad is not None])


def trl_inputs(samples: list, pad_id: int) -> dict:
    """The batch dict TRL's `_compute_loss` reads, from the step's selected samples."""
    import torch

    prompts = [list(s.rollout.prompt_tokens) for s in samples]
    completions = [list(s.rollout.completion_tokens) for s in samples]
    p_len, c_len = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.tensor([[pad_id] * (p_len - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (p_len - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [pad_id] * (c_len - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (c_len - len(c)) for c in completions])
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
            "num_items_in_batch": completion_mask.sum().float()}


def make_trainer(start: str, env, root: Path, steps: int, dtype):
    """A GRPOTrainer configured like bench_trl's, on its own copy of the start."""
    from rlpipe.models.loading import load_model
    from rlpipe.models.tokenizer import load_tokenizer
    from rlpipe.tasks.setup import make_optimizer
    from rlpipe.training.config import OptimConfig
    from transformers import TrainerCallback  # noqa: F401 - transformers first, as TRL expects
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.trl_sides import make_reward, trl_dataset

    model, tokenizer = load_model(start, dtype=dtype), load_tokenizer(start)
    optim = OptimConfig(lr=LR, warmup_steps=2, min_lr_ratio=0.1, token_budget=8192, max_grad_norm=1.0)
    optimizer, scheduler = make_optimizer(model, optim, steps)
    dataset, by_id = trl_dataset(env, steps * PROMPTS, 0)
    config = GRPOConfig(output_dir=str(root / "trl"), max_steps=steps, per_device_train_batch_size=PROMPTS * GROUP,
                        num_generations=GROUP, max_completion_length=16, temperature=1.0, top_p=1.0, top_k=0,
                        beta=0.0, num_iterations=1, scale_rewards="none", loss_type="dapo", max_grad_norm=1.0,
                        report_to="none", use_cpu=True, seed=0, shuffle_dataset=False, gradient_checkpointing=False,
                        save_strategy="no", disable_tqdm=True, bf16=False)  # TRL defaults bf16 to True
    trainer = GRPOTrainer(model=model, reward_funcs=make_reward(env, by_id, []), args=config, train_dataset=dataset,
                          processing_class=tokenizer, optimizers=(optimizer, scheduler))
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; one micro-batch per step here
    return trainer, optimizer, scheduler


def compare(args: argparse.Namespace) -> dict:
    import torch
    from rlpipe.engines.base import SamplingParams
    from rlpipe.engines.torch_engine import TorchEngine
    from rlpipe.envs.prompts import PromptSource
    from rlpipe.models.loading import load_model
    from rlpipe.models.tokenizer import load_tokenizer
    from rlpipe.rollouts.config import RLConfig
    from rlpipe.rollouts.group_buffer import GroupBuffer
    from rlpipe.rollouts.options import rollout_options
    from rlpipe.rollouts.source import RolloutSource
    from rlpipe.tasks.pack import pack_rollouts
    from rlpipe.tasks.setup import make_optimizer, stop_token_ids
    from rlpipe.training.config import OptimConfig
    from rlpipe.training.rl_loss import build_rl_loss
    from rlpipe.training.step import StepOptions, forward_backward, optim_step

    from benchmarks.bench_losses import MemoryStages, arithmetic_env

    torch.set_num_threads(args.threads)
    env = arithmetic_env()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dtype = getattr(torch, args.dtype)
        trainer, trl_opt, trl_sched = make_trainer(args.start, env, root, args.steps, dtype)
        model = load_model(args.start, dtype=dtype)
        tokenizer = load_tokenizer(args.start)
        optim = OptimConfig(lr=LR, warmup_steps=2, min_lr_ratio=0.1, token_budget=8192, max_grad_norm=1.0)
        optimizer, scheduler = make_optimizer(model, optim, args.steps)
        engine, stops = TorchEngine(model), stop_token_ids(tokenizer)
        rl = RLConfig(steps=args.steps, prompts_per_step=PROMPTS, group_size=GROUP,
                      filter={"drop_zero_variance": False})
        stages = MemoryStages(engine, tokenizer, env, SamplingParams(n=GROUP, max_new_tokens=16,
                                                                     stop_token_ids=stops, seed=0))
        options = rollout_options(rl)
        source = RolloutSource(options, PromptSource(env.examples("train", seed=0), seed=0),
                               GroupBuffer(options.buffer), stages, start_step=0, published_version=0)
        loss_fn, rows = build_rl_loss("reinforce"), []
        trl_model = trainer.model
        source.__enter__()
        for step in range(1, args.steps + 1):
            batch = source.batch(step)
            selected = batch.samples
            batches = pack_rollouts(selected, 8192)
            if step == 1:  # do both sides put the same prompt tokens in front of the model?
                examples = [stages.env_examples[s.rollout.example_id] for s in selected[::GROUP]]
                trl_prompts = trainer._tokenize_prompts([env.reset(e) for e in examples])[0]
                ours_prompts = [list(s.rollout.prompt_tokens) for s in selected[::GROUP]]
                same_prompt_tokens = [list(t) for t in trl_prompts] == ours_prompts
            model.train()
            ours = forward_backward(model, batches, loss_fn, StepOptions(normaliser="token", entropy=True))
            g_ours = grad_vector(model)
            trl_model.train()
            loss = trainer._compute_loss(trl_model, trl_inputs(selected, tokenizer.pad_token_id))
            loss.backward()
            g_trl = grad_vector(trl_model)
            cosine = float(torch.nn.functional.cosine_similarity(g_ours, g_trl, dim=0))
            before = [q.detach().clone() for q in model.parameters()]
            before_trl = [q.detach().clone() for q in trl_model.parameters()]
            ours_step = optim_step(model, optimizer, scheduler, 1.0)
            torch.nn.utils.clip_grad_norm_([p for p in trl_model.parameters() if p.grad is not None], 1.0)
            trl_opt.step()
            trl_sched.step()
            trl_opt.zero_grad(set_to_none=True)
            drift = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), trl_model.parameters(),
                                                                   strict=True))
            # the two updates, as vectors: how far apart relative to their size
            upd = torch.cat([(q.detach() - b).flatten().double() for q, b in zip(model.parameters(), before, strict=True)])
            upd_trl = torch.cat([(q.detach() - b).flatten().double()
                                 for q, b in zip(trl_model.parameters(), before_trl, strict=True)])
            update_rel_diff = float((upd - upd_trl).norm() / upd.norm())
            rows.append({"step": step, "loss_rlpipe": ours["loss"], "loss_trl": float(loss.detach()),
                         "grad_norm_rlpipe": float(g_ours.norm()), "grad_norm_trl": float(g_trl.norm()),
                         "grad_cosine": cosine, "grad_norm_ratio": float(g_ours.norm() / g_trl.norm()),
                         "grad_max_abs_diff": float((g_ours - g_trl).abs().max()),
                         "weight_max_abs_diff_after_step": drift, "update_rel_diff": update_rel_diff,
                         "lr": ours_step["lr"],
                         "reward_mean": sum(s.reward for s in selected) / len(selected),
                         "completion_tokens": int(sum(len(s.rollout.completion_tokens) for s in selected))})
            source.publish(step)
            print(json.dumps(rows[-1]))
        source.__exit__(None, None, None)
        sampling = {"trl_eos_token_ids": getattr(trainer, "eos_token_ids", None),
                    "trl_generation_config": {k: v for k, v in trainer.generation_config.to_dict().items()
                                              if k in ("do_sample", "temperature", "top_p", "top_k", "min_p",
                                                       "repetition_penalty", "max_new_tokens", "eos_token_id")},
                    "rlpipe_stop_token_ids": stops, "rlpipe_sampling": "temperature 1, top_p 1, top_k 0",
                    "same_prompt_tokens": same_prompt_tokens}
    return {"benchmark": "trl_grads", "start": args.start, "dtype": args.dtype, "steps": rows, "sampling": sampling}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", default="", help="an SFT checkpoint (default: make bench_trl's)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                        help="both sides' weights (float64: differences left are the algorithm's, not rounding)")
    parser.add_argument("--out", default="runs/bench/trl_grads.json")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if not args.start:
        from benchmarks.bench_losses import sft_start

        args.start = sft_start(Path(tempfile.mkdtemp(prefix="rlpipe-trl-grads-")))
    report = compare(args) | {"seconds": time.perf_counter() - started}
    write_results(args.out, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
