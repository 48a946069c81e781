"""A scripted OpenAI-compatible endpoint for the openai backend's tests: what a real server
cannot be made to do on demand (answer 429 or 503, drop logprobs, stall) it does here.

A test gives an async handler(path, body) -> (status, headers, json body, or a starlette
Response of its own); the stub serves it under uvicorn on a free loopback port and records
every request it got.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

Handler = Callable[[str, dict], Awaitable[tuple[int, dict[str, str], Any]]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat_answer(text: str, logprobs: list[dict] | None = None) -> dict:
    """A /v1/chat/completions body; `logprobs`: the first token's top_logprobs."""
    lp = None if logprobs is None else {"content": [
        {"token": logprobs[0]["token"], "logprob": logprobs[0]["logprob"],
         "top_logprobs": logprobs}]}
    return {"id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": "stub",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop", "logprobs": lp}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}


@dataclass
class Seen:
    path: str
    body: dict
    at: float
    headers: dict[str, str] = field(default_factory=dict)


class StubEndpoint:
    def __init__(self, handler: Handler, tokenize: bool = False,
                 tls: tuple[str, str] | None = None, api_path: str = "/v1"):
        """tokenize: the handler also answers vLLM's /tokenize (else a 404, as hosted APIs
        answer). tls: (certificate file, key file) to serve HTTPS with. api_path: where the
        OpenAI API is (its url's path); /tokenize is beside it, as vLLM behind a proxy's
        prefix has it (/prefix/v1, /prefix/tokenize)."""
        self.handler = handler
        self.seen: list[Seen] = []
        self.active = 0
        self.most_active = 0  # the most requests it held at once

        async def endpoint(request: Request) -> Response:
            body = await request.json()
            self.seen.append(Seen(request.url.path, body, time.monotonic(),
                                  dict(request.headers)))
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            try:
                status, headers, payload = await self.handler(request.url.path, body)
            finally:
                self.active -= 1
            if isinstance(payload, Response):  # (one the test made: a stream, say)
                return payload
            return JSONResponse(payload, status_code=status, headers=headers)

        paths = [f"{api_path}/chat/completions", f"{api_path}/completions"] + \
            [f"{api_path.removesuffix('/v1')}/tokenize"] * tokenize
        app = Starlette(routes=[Route(p, endpoint, methods=["POST"]) for p in paths])
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}{api_path}"
        cert, key = tls or (None, None)
        # A request the stub holds (a hung server's) is cut off 1 s into the shutdown.
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", ssl_certfile=cert,
                                                    ssl_keyfile=key,
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the stub endpoint did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self) -> StubEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def generate(backend: Any, prompt: str = "hello", max_tokens: int = 4) -> Any:
    """One chat generation through an openai backend: its BackendResult."""
    from llmdb.backends import GenerationRequest
    from llmdb.engine.params import SamplingParams

    done = threading.Event()
    req = GenerationRequest([{"role": "user", "content": prompt}],
                            SamplingParams(max_tokens=max_tokens))
    handle = backend.submit(req, done.set)
    assert done.wait(30), "the request never finished"
    return backend.collect(handle)


def self_signed_certificate(directory: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 signed by itself, and its key (made by openssl)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return str(cert), str(key)
