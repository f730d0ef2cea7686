"""A small OpenAI-compatible server for the tests of `dflash generate --endpoint`.

Serves `GET /v1/models` and `POST /v1/completions` (token-id prompts, `stop_token_ids`) from a
local model through the local backend itself, greedily and one prompt at a time, so its replies
are the local backend's with `run.batch_size=1`. It answers as vLLM does: the stop token counts
in `usage.completion_tokens` and ends `token_ids` (returned when `return_ids`, else omitted as
SGLang does); the text keeps the special tokens of the reply (not the stop token) only when the
request sets `skip_special_tokens` false, as vLLM's. `fail(n)` true makes the n-th completion
request (from 1) answer HTTP 500; a prompt plus `max_tokens` longer than `max_model_len` gets
vLLM's HTTP 400; `advertise_len` puts `max_model_len` in the model card, as vLLM does;
`ignore_eos` is honoured unless `ignores_eos=False`. `requests` holds every completion request.

    with OpenAIServer(model_dir, served_name="tiny") as server:
        ... --endpoint server.url ...
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from stage1_extract.config import TargetConfig
from stage1_extract.target import load_target
from stage1_generate.config import SamplingConfig
from stage1_generate.local_backend import LocalBackend


class OpenAIServer:
    """The server on 127.0.0.1, an OS-chosen port, in a background thread."""

    def __init__(
        self,
        model_dir: Path,
        served_name: str | None = None,
        return_ids: bool = True,
        fail: Callable[[int], bool] | None = None,
        max_model_len: int = 4096,
        advertise_len: bool = False,
        ignores_eos: bool = True,
    ) -> None:
        self.served_name = served_name or str(model_dir)
        self.return_ids, self.fail, self.max_model_len = return_ids, fail, max_model_len
        self.advertise_len, self.ignores_eos = advertise_len, ignores_eos
        self.requests: list[dict[str, Any]] = []
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # loaded as the local backend loads it, so both compute the same logits
        target = TargetConfig(model=str(model_dir), dtype="float32")
        self.model = load_target(target, torch.device("cpu"), ["cpu"])
        self.lock = threading.Lock()  # one generation at a time: the CPU is shared
        self.num_completions = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.owner = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> OpenAIServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def complete(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.num_completions += 1
            self.requests.append(request)
            if self.fail is not None and self.fail(self.num_completions):
                return 500, {"error": {"message": "injected failure"}}
            wanted = len(request["prompt"]) + request["max_tokens"]
            if wanted > self.max_model_len:
                message = (
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, you requested {wanted} tokens."
                )
                return 400, {"object": "error", "message": message, "code": 400}
            stops = request["stop_token_ids"]
            # vLLM's ignore_eos (the server's own EOS: here the tokenizer's); `ignores_eos`
            # false: a server that does not honour it
            stop = not (request.get("ignore_eos") and self.ignores_eos)
            own = stops or [self.tokenizer.eos_token_id]
            backend = LocalBackend(self.model, self.tokenizer, SamplingConfig(), own, 1, 1 << 20)
            reply = backend.generate([request["prompt"]], request["max_tokens"], stop=stop)[0]
            # the text as vLLM writes it: the stop token never, other special tokens only when
            # skip_special_tokens is false (vLLM's default: true)
            skip = request.get("skip_special_tokens", True)
            text = self.tokenizer.decode(reply.token_ids or [], skip_special_tokens=skip)
            reply = dataclasses.replace(reply, text=text)
            stops = own
        choice: dict[str, Any] = {
            "index": 0,
            "text": reply.text,
            "finish_reason": "stop" if reply.finished else "length",
        }
        ids = (reply.token_ids or []) + stops[:1] * reply.finished  # which stop: immaterial here
        if self.return_ids and request.get("return_token_ids"):
            choice["token_ids"] = ids
        return 200, {"choices": [choice], "usage": {"completion_tokens": len(ids)}}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's uvicorn

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            owner = self.server.owner  # type: ignore[attr-defined]
            card: dict[str, Any] = {"id": owner.served_name}
            if owner.advertise_len:
                card["max_model_len"] = owner.max_model_len
            self._send(200, {"object": "list", "data": [card]})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/completions":
            self._send(*self.server.owner.complete(request))  # type: ignore[attr-defined]
        else:
            self._send(404, {"detail": "Not Found"})

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:  # quiet: pytest shows stderr on failure
        pass
