"""The `http` engine: sampling and weight sync against an OpenAI-compatible server.

    engine = HttpEngine("http://127.0.0.1:8001", HttpOptions(timeout_s=60, retries=3))  # `rlpipe serve`
    engine = HttpEngine("http://gpu-box:8000", HttpOptions(flavor="vllm"))               # `vllm serve`
    engine = HttpEngine("http://gpu-box:30000", HttpOptions(flavor="sglang"))            # SGLang server
    out = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=128, seed=0))
    engine.sync("runs/demo/checkpoints/step_000010", 10)

`engines_from_config(config.engine)` makes one engine per URL; a URL may name its flavor as a
scheme prefix (`vllm+http://host:8000`, `sglang+http://host:30000`; plain `http://` = rlpipe).

Failures: connection errors (refused, reset, DNS, connect timeout) and 502/503/504 answers are
retried `retries` times with exponential backoff (backoff_s × 2^attempt, at most 8 s); then
`EngineUnavailableError` names the URL, the attempts and the last error. A read timeout is not
retried (the server may still be working on a long generation): `EngineTimeoutError`. Any other
error answer raises `EngineResponseError` with the server's message.

Request shapes per flavor, and where they were checked: `engines/http_wire.py`.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from rlpipe.core.config import options_from
from rlpipe.engines.base import Completion, SamplingParams, prompt_seed
from rlpipe.engines.http_wire import (
    FLAVORS,
    EngineResponseError,
    EngineTimeoutError,
    EngineUnavailableError,
    Flavor,
    completions_request,
    parse_completions,
    parse_sglang,
    sglang_generate_request,
    vllm_legacy_reload_requests,
    vllm_reload_request,
)

_RETRY_STATUS = (502, 503, 504)
_MAX_BACKOFF_S = 8.0
_MAX_CONCURRENT_REQUESTS = 64  # the server batches them; more threads buy nothing


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


@dataclass(frozen=True)
class HttpOptions:
    """How an HttpEngine talks to its server (the same for every request)."""

    timeout_s: float = 60.0
    """Per-request timeout (a given client's own timeout applies instead)."""
    retries: int = 3
    """Extra attempts on connection errors and 502/503/504 answers."""
    backoff_s: float = 0.5
    """The first retry's wait; doubled each retry, at most 8 s."""
    api_token: str | None = None
    """Bearer token, if the server needs one."""
    flavor: Flavor | None = None
    """'rlpipe' | 'vllm' | 'sglang' (None: from the url, else 'rlpipe')."""
    model: str | None = None
    """Model id for vLLM (None: the first of GET /v1/models)."""

    def __post_init__(self) -> None:
        if self.flavor is not None and self.flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {FLAVORS}, got {self.flavor!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {self.retries!r}")
        if self.backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {self.backoff_s}")


class HttpEngine:
    """Engine protocol over HTTP (see module docstring for flavors, retries and errors).

    url: server base URL (no /v1), optionally flavor-prefixed ('vllm+http://...').
    options: timeout, retries, token, flavor and model (`HttpOptions`). name: shown in errors
    and the `syncs` table (default: the URL). client: an httpx.Client to use instead of a new one
    (tests); its own timeout applies then.
    """

    shares_weights = False
    syncs_from_checkpoint = True

    def __init__(
        self,
        url: str,
        options: HttpOptions = HttpOptions(),
        *,
        name: str | None = None,
        policy_version: int = 0,
        client: httpx.Client | None = None,
    ) -> None:
        url_flavor, self.url = parse_engine_url(url)
        flavor = options.flavor
        if flavor is not None and "+" in url.split("://", 1)[0] and flavor != url_flavor:
            raise ValueError(f"flavor {flavor!r} contradicts the url {url!r}")
        self.flavor: Flavor = flavor or url_flavor
        self.timeout_s = float(options.timeout_s)
        self.retries = options.retries
        self.backoff_s = options.backoff_s
        self.name = name or self.url
        self.model = options.model
        self._headers = {"Authorization": f"Bearer {options.api_token}"} if options.api_token else {}
        self._client = client or httpx.Client(timeout=self.timeout_s)
        self._owns_client = client is None
        self._policy_version = policy_version
        self._closed = False
        self._vllm_reload_takes_path: bool | None = None  # learnt at the first vLLM sync

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
        if self.flavor == "vllm" and params.seed is not None and len(prompts) > 1:
            return self._generate_seeded_per_prompt(prompts, params)
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
            self._vllm_reload(path)
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

    def _generate_seeded_per_prompt(
        self, prompts: list[list[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        """One concurrent request per prompt, each with its own seed (`prompt_seed`): a batched
        request has one seed, so sample j of every prompt would share its noise."""
        model, where = self._model_id(), self._where("/v1/completions")

        def one(index: int) -> list[Completion]:
            seeded = replace(params, seed=prompt_seed(params, index))
            body = completions_request([prompts[index]], seeded, self.flavor, model)
            return parse_completions(
                self._request("POST", "/v1/completions", body), 1, params.n, where
            )[0]

        with ThreadPoolExecutor(max_workers=min(len(prompts), _MAX_CONCURRENT_REQUESTS)) as pool:
            return list(pool.map(one, range(len(prompts))))

    def _vllm_reload(self, path: str) -> None:
        """Worker.reload_weights(weights_path=...) (vLLM >= 0.19, where update_config of the
        model path fails); older vLLM lacks the argument: point model_config there, then reload."""
        if self._vllm_reload_takes_path is not False:
            try:
                self._request("POST", "/collective_rpc", vllm_reload_request(path))
                self._vllm_reload_takes_path = True
                return
            except EngineResponseError as exc:
                if self._vllm_reload_takes_path or "weights_path" not in str(exc):
                    raise
                self._vllm_reload_takes_path = False
        for body in vllm_legacy_reload_requests(path):
            self._request("POST", "/collective_rpc", body)

    def close(self) -> None:
        if not self._closed and self._owns_client:
            self._client.close()
        self._closed = True

    # -- extras ---------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """GET /health (vLLM answers an empty 200: {} then)."""
        self._check_open()
        return self._request("GET", "/health", None)

    def request(self, method: str, path: str, body: Any) -> dict[str, Any]:
        """One call to the server with this engine's retries and errors (the JSON answer)."""
        self._check_open()
        return self._request(method, path, body)

    def model_id(self) -> str | None:
        """The model name requests carry (vLLM: its first served model, asked once)."""
        return self._model_id()

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


# ----------------------------------------------------------------------------- config


def read_token(token_file: str = "", env_var: str = "") -> str | None:
    """A bearer token from a file (its first line) or else an environment variable; None if
    neither gives one. Tokens never live in configs: those are written to disk and MLflow."""
    if token_file:
        path = Path(token_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"cannot read the token file {token_file!r}: {err}") from err
        token = lines[0].strip() if lines else ""
        if not token:
            raise ValueError(f"the token file {token_file!r} is empty")
        return token
    if not env_var:
        return None
    return (os.environ.get(env_var) or "").strip() or None


def engines_from_config(engine_config: Any) -> list[HttpEngine]:
    """One HttpEngine per URL of an `EngineConfig` (urls, timeout_s, retries, and the token from
    api_token_file or the api_token_env variable)."""
    urls = list(engine_config.urls)
    if not urls:
        raise ValueError("engine.urls lists no server")
    token = read_token(engine_config.api_token_file, engine_config.api_token_env)
    engines = []
    for url in urls:
        flavor, base = parse_engine_url(url)
        engines.append(
            HttpEngine(
                base,
                options_from(HttpOptions, engine_config, api_token=token, flavor=flavor),
                name=base,
            )
        )
    return engines
