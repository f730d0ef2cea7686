"""The OpenAI-compatible backend of `dflash generate`: the target runs in `vllm serve` or SGLang.

    vllm serve Qwen/Qwen3-8B --port 8000
    dflash generate --config C --model Qwen/Qwen3-8B --endpoint http://localhost:8000/v1 \\
        --data train.jsonl --out gen/

For targets too large for transformers' `generate`. Every prompt is one `/v1/completions`
request whose `prompt` is the token ids our own chat-template rendering produced (the server
applies no template of its own), with the stop ids as `stop_token_ids` (a vLLM/SGLang
extension), and `skip_special_tokens` false (another special token the target writes stays in
the reply's text), so the rows equal the local backend's. `endpoint.concurrency` requests are in
flight at once: a thread pool over keep-alive connections of the standard library's
`http.client` (the HTTP library that transformers' hub client brings differs between versions:
requests, httpx, httpx2; and a local server should not go through `$http_proxy`, which
`http.client` ignores). Connection errors, 429 and 5xx are retried with exponential backoff;
any other failure is one ValueError, and the chunks committed before it stay (a rerun resumes).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import queue
import random
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any
from urllib.parse import urlsplit

from stage1_generate.config import EndpointConfig, SamplingConfig
from stage1_generate.local_backend import Completion

CHECK_TIMEOUT_S = 30.0  # the `/models` check at start: an unreachable server fails fast
BACKOFF_S, BACKOFF_MAX_S = 1.0, 60.0  # retry k waits about BACKOFF_S * 2**k, at most the max
Connection = http.client.HTTPConnection


def _server_message(body: bytes) -> str:
    """The error text of an OpenAI-style error body (vLLM, SGLang, FastAPI), else the raw text."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode(errors="replace").strip()[:500]
    if not isinstance(data, dict):
        return str(data)[:500]
    error = data.get("error")
    if isinstance(error, dict):  # OpenAI and newer vLLM: {"error": {"message": ...}}
        error = error.get("message")
    return str(error or data.get("message") or data.get("detail") or data)[:500]


class OpenAIBackend:
    """Replies from an OpenAI-compatible server; the same interface as `LocalBackend`."""

    # the server's context (vLLM's model card says it: max_model_len), else None: the server
    # refuses a prompt past it with an HTTP 400 that names it
    max_positions: int | None = None
    max_positions_source = "the server's max_model_len"

    def __init__(
        self,
        endpoint: EndpointConfig,
        sampling: SamplingConfig,
        stop_ids: list[int],
        target_model: str,
        eos_id: int | None = None,
    ) -> None:
        assert endpoint.url, "config validation requires endpoint.url for run.backend=openai"
        self.url = endpoint.url.rstrip("/")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"endpoint.url {endpoint.url!r} is not an http(s) URL; pass the server's API "
                "root, e.g. --endpoint http://localhost:8000/v1"
            )
        self.https, self.host, self.port = parts.scheme == "https", parts.hostname, parts.port
        self.prefix = parts.path
        self.endpoint, self.sampling, self.stop_ids = endpoint, sampling, stop_ids
        self.eos_id = eos_id  # the tokenizer's end of sequence: vLLM's stop_reason None
        self.model = endpoint.model or target_model
        self.headers = {"Content-Type": "application/json"}
        api_key = os.environ.get(endpoint.api_key_env) if endpoint.api_key_env else None
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._idle: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        self._check_model()

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        on_batch: Callable[[int, int], None] | None = None,
        stop: bool = True,
    ) -> list[Completion]:
        """Replies to `prompts` (token ids), in their order; `on_batch(1, new_tokens)` is
        called (on this thread) as each request finishes. `stop` false: the server is asked
        to ignore the end of sequence (vLLM's and SGLang's `ignore_eos`)."""
        out: list[Completion | None] = [None] * len(prompts)
        pool = ThreadPoolExecutor(max(1, min(self.endpoint.concurrency, len(prompts))))
        try:
            pending = {
                pool.submit(self._complete, p, max_new_tokens, stop): i
                for i, p in enumerate(prompts)
            }
            while pending:
                done, _ = wait(pending, return_when=FIRST_EXCEPTION)
                for future in done:
                    out[pending.pop(future)] = completion = future.result()
                    if on_batch is not None:
                        on_batch(1, completion.num_tokens)
        finally:
            # on a failure the queued requests are dropped, not sent; in-flight ones finish
            # on their own threads (their chunk is not committed either way)
            pool.shutdown(wait=all(c is not None for c in out), cancel_futures=True)
            self._close_idle()
        return [c for c in out if c is not None]

    def _complete(self, prompt: list[int], max_new: int, stop: bool = True) -> Completion:
        payload: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_new,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            # vLLM applies the target's generation_config.json defaults to what a request leaves
            # out (Qwen2.5-Instruct's repetition penalty 1.05, Qwen3's top_k 20): the rows follow
            # sampling.* alone, as the local backend's (greedy: the target's argmax, after
            # sampling.repetition_penalty where set; SGLang penalizes the reply's tokens only,
            # vLLM and the local backend the prompt's too)
            "repetition_penalty": self.sampling.repetition_penalty,
            "top_k": self.sampling.top_k or -1,  # vLLM's and SGLang's "every token"
            "min_p": 0.0,
            "stop_token_ids": self.stop_ids if stop else [],
            "ignore_eos": not stop,
            # the special tokens the target wrote stay in the text, as the local backend's
            # (vLLM and SGLang leave them out by default, and the stop token out either way),
            # with no space put between two of them (vLLM's slow-tokenizer decoding would)
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "return_token_ids": True,  # vLLM: the reply's ids, so text rows decode without a seam
        }
        if not self.sampling.greedy:
            # a seed from the prompt itself: a resumed chunk samples what the first run would
            digest = hashlib.sha256(json.dumps([self.sampling.seed, prompt]).encode()).digest()
            payload["seed"] = int.from_bytes(digest[:4], "little") >> 1
        body = json.dumps(payload).encode()
        attempts = self.endpoint.max_retries + 1
        for attempt in range(attempts):
            try:
                status, data = self._request("POST", "/completions", body, self.endpoint.timeout_s)
            except (OSError, http.client.HTTPException) as err:
                problem = f"{type(err).__name__}: {err}"
            else:
                if status == 200:
                    completion = self._parse(data, stop)
                    if completion is not None:
                        return completion
                    problem = "the server aborted the request"
                elif status == 429 or status >= 500:  # overloaded or restarting: worth a retry
                    problem = f"HTTP {status}: {_server_message(data)}"
                else:
                    raise ValueError(
                        f"endpoint {self.url}/completions: HTTP {status}: "
                        f"{_server_message(data)} (finished chunks are kept; fix the cause and "
                        "rerun to resume)"
                    )
            if attempt + 1 < attempts:
                time.sleep(min(BACKOFF_MAX_S, BACKOFF_S * 2**attempt) * random.uniform(0.5, 1.0))
        raise ValueError(
            f"endpoint {self.url}/completions failed {attempts} time(s), last: {problem}; check "
            "that the server is up and not overloaded (--set endpoint.max_retries=N, "
            "endpoint.concurrency=N), then rerun the same command: finished chunks are kept"
        )

    def _parse(self, data: bytes, stop: bool = True) -> Completion | None:
        """The completion of a 200 answer; None when the server aborted it (vLLM's "abort")."""
        try:
            answer = json.loads(data)
            choice = answer["choices"][0]
            text, reason, ids = choice["text"], choice["finish_reason"], choice.get("token_ids")
            num_tokens = int(answer["usage"]["completion_tokens"])
        except (ValueError, KeyError, IndexError, TypeError) as err:
            raise ValueError(
                f"endpoint {self.url}/completions answered without choices[0].text, "
                f"finish_reason or usage.completion_tokens ({err!r}): {data[:300]!r}"
            ) from None
        if reason not in ("stop", "length"):
            return None
        finished = reason == "stop"
        if finished and not stop:
            raise ValueError(
                f"endpoint {self.url}/completions ended a reply at a stop token although asked "
                "to ignore the end of sequence (ignore_eos): this server cannot write past it; "
                "use vLLM or SGLang (both honour ignore_eos), the local backend, or "
                "text.stop_at_eos=true"
            )
        # vLLM and SGLang count (and return) the stop token; the local backend's reply ends
        # before it, and so do ours
        stop_id = self._stop_id(choice, ids) if finished else None
        if ids is not None:
            ids = ids[:-1] if finished and ids and ids[-1] in self.stop_ids else list(ids)
            num_tokens = len(ids)
        elif finished:
            num_tokens = max(num_tokens - 1, 0)
        return Completion(text, num_tokens, finished, ids, stop_id)

    def _stop_id(self, choice: dict[str, Any], ids: list[int] | None) -> int | None:
        """The stop id that ended a finished reply: the last of its ids when returned, else
        SGLang's `matched_stop` or vLLM's `stop_reason` (None there: the server's end of
        sequence, the tokenizer's), else the only stop id; None when none of them says."""
        for said in (
            ids[-1] if ids else None,
            choice.get("matched_stop"),
            choice.get("stop_reason"),
        ):
            if said in self.stop_ids:
                return said
        if (
            "stop_reason" in choice
            and choice["stop_reason"] is None
            and self.eos_id in self.stop_ids
        ):
            return self.eos_id
        return self.stop_ids[0] if len(self.stop_ids) == 1 else None

    def _request(
        self, method: str, path: str, body: bytes | None, timeout: float
    ) -> tuple[int, bytes]:
        """One HTTP exchange on an idle keep-alive connection (or a new one)."""
        try:
            conn = self._idle.get_nowait()
        except queue.Empty:
            kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            conn = kind(self.host, self.port, timeout=timeout)
        try:
            conn.request(method, self.prefix + path, body=body, headers=self.headers)
            response = conn.getresponse()
            data = response.read()
        except BaseException:
            conn.close()  # a half-used connection is never reused
            raise
        self._idle.put(conn)
        return response.status, data

    def _close_idle(self) -> None:
        # an idle keep-alive socket goes stale (the server drops it after a few seconds), and
        # a request on it would fail; the next call opens fresh ones
        while not self._idle.empty():
            self._idle.get().close()

    def _check_model(self) -> None:
        """Fail before any chunk: the server answers and serves the model we will ask for."""
        try:
            status, data = self._request("GET", "/models", None, CHECK_TIMEOUT_S)
            self._close_idle()
        except (OSError, http.client.HTTPException) as err:
            raise ValueError(
                f"endpoint {self.url} is unreachable ({type(err).__name__}: {err}); start the "
                f"server (e.g. `vllm serve {self.model}`) or check --endpoint (endpoint.url)"
            ) from None
        if status != 200:
            hint = {
                401: f"set the server's API key in ${self.endpoint.api_key_env} "
                "(endpoint.api_key_env)",
                403: f"set the server's API key in ${self.endpoint.api_key_env} "
                "(endpoint.api_key_env)",
                404: "pass the API root as --endpoint, e.g. http://localhost:8000/v1",
            }.get(status, "check --endpoint (endpoint.url) and the server's log")
            raise ValueError(
                f"endpoint {self.url}/models: HTTP {status}: {_server_message(data)}; {hint}"
            )
        try:
            cards = {m["id"]: m for m in json.loads(data)["data"]}
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f"endpoint {self.url}/models did not answer an OpenAI model list "
                f"({data[:200]!r}); is --endpoint an OpenAI-compatible server's API root?"
            ) from None
        served = list(cards)
        if self.model not in served:
            raise ValueError(
                f"endpoint {self.url} serves {served}, not {self.model!r}; pass "
                "--set endpoint.model=NAME with one of those, or serve the target under that "
                f"name (vllm serve ... --served-model-name {self.model})"
            )
        # a row past the context is then an invalid row (too_long, data.on_invalid), as with
        # the local backend, not a 400 that stops the run at the same chunk on every rerun
        limit = cards[self.model].get("max_model_len")
        if isinstance(limit, int) and limit > 0:
            self.max_positions = limit
