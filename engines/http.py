"""The `http` engine: sampling and weight sync against an OpenAI-compatible server.

    engine = HttpEngine("http://127.0.0.1:8001", timeout_s=60, retries=3)   # `rlpipe serve`
    engine = HttpEngine("http://gpu-box:8000", flavor="vllm")                # `vllm serve`
    engine = HttpEngine("http://gpu-box:30000", flavor="sglang")             # SGLang server
    out = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=128, seed=0))
    engine.sync("runs/demo/checkpoints/step_000010", 10)

`engines_from_config(config.engine)` makes one engine per URL; a URL may name its flavor as a
scheme prefix (`vllm+http://host:8000`, `sglang+http://host:30000`; plain `http://` = rlpipe).

Failures: connection errors (refused, reset, DNS, connect timeout) and 502/503/504 answers are
retried `retries` times with exponential backoff (backoff_s × 2^attempt, at most 8 s); then
`EngineUnavailableError` names the URL, the attempts and the last error. A read timeout is not
retried (the server may still be working on a long generation): `EngineTimeoutError`. Any other
error answer raises `EngineResponseError` with the server's message.

Request shapes per flavor, checked against source and docs (not against live servers: no GPU
here, and the vLLM / SGLang snapshots were read in GitHub's stored copies, 2026-11):

- rlpipe: `engines/server.py` (this repository) — POST /v1/completions with `prompt` as a batch of
  token ids and `logprobs: 0`, reading `choices[i].token_ids` and
  `choices[i].logprobs.token_logprobs`; sync: POST /update_weights_from_disk
  {"model_path", "weight_version"} → {"success", "message", "policy_version"}.
- vllm: `vllm/entrypoints/openai/protocol.py` (CompletionRequest: `prompt` may be token ids,
  `logprobs`, `return_tokens_as_token_ids`, `return_token_ids`, `top_k` -1 = off,
  `stop_token_ids`, `ignore_eos`, `seed`); token ids are read from `choices[i].token_ids`
  (`return_token_ids`, vLLM ≥ 0.10.2) or else from the "token_id:<id>" strings of
  `logprobs.tokens`. vLLM reports raw log-probs by default; start it with
  `--logprobs-mode processed_logprobs` (vllm/config/model.py `LogprobsMode`) to get rlpipe's
  convention (tempered, untruncated when top-k/top-p are off). Weight reload uses the dev-mode
  endpoints (server started with `VLLM_SERVER_DEV_MODE=1`):
  POST /collective_rpc {"method": "update_config", "args": [{"model_config": {"model": DIR}}]}
  then {"method": "reload_weights"} (`vllm/entrypoints/serve/rpc/api_router.py`;
  Worker.update_config / Worker.reload_weights in `vllm/v1/worker/gpu_worker.py`; the same pair
  as `examples/offline_inference/skip_loading_weights_in_engine_init.py`), then
  POST /reset_prefix_cache so no KV computed with the old weights is reused. Newer vLLM main
  also has a weight-transfer API (/init_weight_transfer_engine, /update_weights; a "disk"
  backend in `vllm/distributed/weight_transfer/disk_engine.py`) that was not yet registered in
  the snapshot read; it is not used here.
- sglang: `python/sglang/srt/managers/io_struct.py` — sync: POST /update_weights_from_disk
  {"model_path", "weight_version"} → UpdateWeightFromDiskReqOutput {"success", "message",
  "num_paused_requests"}; sampling through the native POST /generate {"input_ids",
  "sampling_params", "return_logprob": true}, reading `meta_info.output_token_logprobs`
  ([logprob, token_id, text] per token) and `meta_info.finish_reason.type`. Each prompt is sent
  n times (n = 1 each) so outputs keep prompt-major order; `seed` is not forwarded (SGLang's
  `sampling_seed` needs deterministic-inference mode), so SGLang rollouts are not reproducible.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import httpx

from engines.base import Completion, SamplingParams

Flavor = Literal["rlpipe", "vllm", "sglang"]
FLAVORS: tuple[str, ...] = ("rlpipe", "vllm", "sglang")
_RETRY_STATUS = (502, 503, 504)
_MAX_BACKOFF_S = 8.0


class EngineUnavailableError(RuntimeError):
    """The server could not be reached (after retries)."""


class EngineTimeoutError(RuntimeError):
    """The server did not answer within the timeout."""


class EngineResponseError(RuntimeError):
    """The server answered with an error, or with a body this engine cannot read."""


def parse_engine_url(url: str) -> tuple[Flavor, str]:
    """('rlpipe' | 'vllm' | 'sglang', base URL) from 'http://h:p' or 'vllm+http://h:p'."""
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"engine url {url!r} is not an http(s) URL")
    scheme, rest = url.split("://", 1)
    flavor = "rlpipe"
    if "+" in scheme:
        flavor, scheme = scheme.split("+", 1)
        if flavor not in FLAVORS:
            raise ValueError(f"engine url {url!r}: flavor {flavor!r} is not one of {FLAVORS}")
    if scheme not in ("http", "https") or not rest.strip("/"):
        raise ValueError(f"engine url {url!r} is not an http(s) URL")
    return flavor, f"{scheme}://{rest.rstrip('/')}"  # type: ignore[return-value]


class HttpEngine:
    """Engine protocol over HTTP (see module docstring for flavors, retries and errors).

    url: server base URL (no /v1), optionally flavor-prefixed ('vllm+http://...').
    flavor: 'rlpipe' | 'vllm' | 'sglang' (default: from the url, else 'rlpipe'). timeout_s: per-request timeout. retries: extra attempts on
    connection errors. api_token: bearer token, if the server needs one. name: shown in errors
    and the `syncs` table (default: the URL). model: model id for vLLM (default: the first of
    GET /v1/models). client: an httpx.Client to use instead of a new one (tests); its own
    timeout applies then.
    """

    shares_weights = False
    syncs_from_checkpoint = True

    def __init__(
        self,
        url: str,
        timeout_s: float = 60.0,
        retries: int = 3,
        api_token: str | None = None,
        name: str | None = None,
        *,
        flavor: Flavor | None = None,
        model: str | None = None,
        backoff_s: float = 0.5,
        policy_version: int = 0,
        client: httpx.Client | None = None,
    ) -> None:
        url_flavor, self.url = parse_engine_url(url)
        if flavor is not None and flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {FLAVORS}, got {flavor!r}")
        if flavor is not None and "+" in url.split("://", 1)[0] and flavor != url_flavor:
            raise ValueError(f"flavor {flavor!r} contradicts the url {url!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        if backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {backoff_s}")
        self.flavor: Flavor = flavor or url_flavor
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.backoff_s = backoff_s
        self.name = name or self.url
        self.model = model
        self._headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
        self._client = client or httpx.Client(timeout=self.timeout_s)
        self._owns_client = client is None
        self._policy_version = policy_version
        self._closed = False

    # -- Engine protocol ------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """For each prompt (in order), `params.n` completions (in order)."""
        self._check_open()
        if not prompts:
            return []
        if self.flavor == "sglang":
            return self._generate_sglang(prompts, params)
        body = completions_request(prompts, params, self.flavor, self._model_id())
        answer = self._request("POST", "/v1/completions", body)
        out = parse_completions(answer, len(prompts), params.n, self._where("/v1/completions"))
        if self.flavor == "rlpipe" and isinstance(answer.get("policy_version"), int):
            self._policy_version = answer["policy_version"]
        return out

    def sync(self, checkpoint_path: str | None, policy_version: int) -> None:
        """Make the server load `checkpoint_path` (a checkpoint folder visible to the server)."""
        self._check_open()
        if checkpoint_path is None:
            raise ValueError(
                f"{self.name}: an HTTP engine cannot share in-process weights; "
                "sync needs a checkpoint path"
            )
        path = str(checkpoint_path)
        if self.flavor == "vllm":
            self._request(
                "POST",
                "/collective_rpc",
                {"method": "update_config", "args": [{"model_config": {"model": path}}]},
            )
            self._request("POST", "/collective_rpc", {"method": "reload_weights"})
            self._request("POST", "/reset_prefix_cache", None)
        else:
            answer = self._request(
                "POST",
                "/update_weights_from_disk",
                {"model_path": path, "weight_version": str(policy_version)},
            )
            if answer.get("success") is not True:
                raise EngineResponseError(
                    f"{self._where('/update_weights_from_disk')} did not load "
                    f"{path!r}: {answer.get('message', answer)}"
                )
            loaded = answer.get("policy_version")
            if self.flavor == "rlpipe" and loaded != policy_version:
                raise EngineResponseError(
                    f"{self._where('/update_weights_from_disk')} loaded {path!r} as policy_version "
                    f"{loaded}, expected {policy_version}"
                )
        self._policy_version = policy_version

    def close(self) -> None:
        if not self._closed and self._owns_client:
            self._client.close()
        self._closed = True

    # -- extras ---------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """GET /health (vLLM answers an empty 200: {} then)."""
        self._check_open()
        return self._request("GET", "/health", None)

    # -- internals ------------------------------------------------------------------------

    def _where(self, path: str) -> str:
        return f"engine {self.name!r} ({self.url}{path})"

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"engine {self.name!r} is closed")

    def _model_id(self) -> str | None:
        if self.flavor != "vllm":
            return self.model
        if self.model is None:
            data = self._request("GET", "/v1/models", None).get("data") or []
            if not data or "id" not in data[0]:
                raise EngineResponseError(f"{self._where('/v1/models')} lists no model")
            self.model = str(data[0]["id"])
        return self.model

    def _request(self, method: str, path: str, body: Any) -> dict[str, Any]:
        """One call with retries on connection errors; the JSON answer ({} for an empty body)."""
        url = self.url + path
        attempts = self.retries + 1
        last: str = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), _MAX_BACKOFF_S))
            try:
                response = self._client.request(method, url, json=body, headers=self._headers)
            except httpx.ConnectTimeout as exc:
                last = f"connect timeout: {exc}"
                continue
            except httpx.TimeoutException as exc:
                raise EngineTimeoutError(
                    f"{self._where(path)} gave no answer within timeout_s={self.timeout_s:g}: "
                    f"{type(exc).__name__}"
                ) from exc
            except httpx.TransportError as exc:  # refused, reset, DNS, protocol errors
                last = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code in _RETRY_STATUS:
                last = f"HTTP {response.status_code}: {response.text[:200]}"
                continue
            if response.status_code >= 400:
                raise EngineResponseError(
                    f"{self._where(path)} answered HTTP {response.status_code}: "
                    f"{_error_message(response)}"
                )
            if not response.content:
                return {}
            try:
                answer = response.json()
            except ValueError as exc:
                raise EngineResponseError(
                    f"{self._where(path)} answered non-JSON: {response.text[:200]!r}"
                ) from exc
            return answer if isinstance(answer, dict) else {"items": answer}
        raise EngineUnavailableError(
            f"{self._where(path)} unreachable after {attempts} attempt(s) "
            f"({self.retries} retries): {last}"
        )

    def _generate_sglang(
        self, prompts: list[list[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        body = sglang_generate_request(prompts, params)
        answer = self._request("POST", "/generate", body)
        items = answer.get("items", [answer] if "meta_info" in answer else [])
        return parse_sglang(items, len(prompts), params.n, self._where("/generate"))


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body.get("message", body)))
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(error)
    return str(body)[:500]


# ----------------------------------------------------------------------------- request shapes


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
    if flavor == "vllm":
        # Our engines stop only on stop_token_ids; vLLM would also stop on the model's EOS.
        body.update(return_token_ids=True, ignore_eos=True, skip_special_tokens=False)
    return body


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


# ----------------------------------------------------------------------------- config


def engines_from_config(engine_config: Any) -> list[HttpEngine]:
    """One HttpEngine per URL of an `EngineConfig` (urls, timeout_s, retries, api_token)."""
    urls = list(engine_config.urls)
    if not urls:
        raise ValueError("engine.urls lists no server")
    engines = []
    for url in urls:
        flavor, base = parse_engine_url(url)
        engines.append(
            HttpEngine(
                base,
                timeout_s=engine_config.timeout_s,
                retries=engine_config.retries,
                api_token=engine_config.api_token or None,
                name=base,
                flavor=flavor,
            )
        )
    return engines

