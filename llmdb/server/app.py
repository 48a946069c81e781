"""`llmdb serve`: an OpenAI-compatible HTTP server over one in-process engine.

Built on FastAPI (request validation, OpenAPI description) and served by uvicorn. Each HTTP
request becomes one engine request on the engine's background loop; tokens come back
through the engine's per-token callback onto the event loop, so a stream is sent as the
tokens are made, and a client that goes away aborts its request (its blocks are freed as
the step under way ends). Limits answer 4xx in OpenAI's error shape before any work is queued.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmdb.engine.compute import run_on_compute_thread
from llmdb.engine.engine import LLMEngine, refusal_text
from llmdb.engine.outputs import RequestAborted, RequestResult
from llmdb.engine.params import SamplingParams

from .metrics import EngineMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, ServerError, TokenizeRequest
from .text import IncrementalText

_LOGPROB_ROWS = 256  # prompt log-probabilities are worked out this many rows at a time


@dataclass
class Limits:
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # None: the model's context
    max_tokens: int = 4096
    default_max_tokens: int = 256
    max_concurrent: int = 256


@dataclass
class _Call:
    """One engine request as the event loop sees it."""

    request_id: str
    tokens: asyncio.Queue  # token ids, then None at the end
    # Each token's (logprob, top logprobs), where asked for: in place before its token.
    logprobs: list = field(default_factory=list)
    closed: bool = False


def create_app(engine: LLMEngine, model_name: str, api_key: str | None = None,
               limits: Limits | None = None, shutdown_timeout_s: float = 10.0) -> FastAPI:
    """The app; api_key None serves without authentication (the caller decides when that is
    allowed: `llmdb serve` only on a loopback address)."""
    limits = limits or Limits()
    created = int(time.time())
    metrics = EngineMetrics(engine)
    inflight: set[str] = set()  # ids of this app's engine requests: shutdown aborts them
    slots = asyncio.Semaphore(limits.max_concurrent)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        # An engine whose loop already runs is shared with others: it is left running.
        owns_loop = not engine.background_loop_running
        engine.start_background_loop()
        yield
        engine.abort(*inflight)  # (after drain(): nothing should be left)
        if owns_loop:
            engine.stop_background_loop()

    async def drain() -> None:
        """Graceful shutdown's first half (run.py calls it before closing connections): new
        requests get 503, in-flight ones have shutdown_timeout_s to finish, then the rest are
        aborted and answered 503 (a client retries them elsewhere, as llmdb's does), so every
        caller gets an answer and every block is freed."""
        state.draining = True
        deadline = time.monotonic() + shutdown_timeout_s
        while inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # All in one call (they end with one step), off the event loop: see end_soon.
        threading.Thread(target=engine.abort, args=tuple(inflight), daemon=True).start()
        while inflight:  # their handlers answer
            await asyncio.sleep(0.01)

    app = FastAPI(title="llmdb", version=engine.version, lifespan=lifespan)
    state = app.state
    state.draining = False
    state.drain = drain

    @app.exception_handler(ServerError)
    async def _server_error(_req: Request, exc: ServerError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        """A path or method that is not served: in OpenAI's error shape too."""
        err = ServerError(exc.status_code, str(exc.detail))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        # (a JSON syntax error's loc is the character offset, not a parameter)
        loc = [] if first.get("type") == "json_invalid" else first.get("loc", ())[1:]
        param = ".".join(str(p) for p in loc) or None
        err = ServerError(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param)
        return JSONResponse(err.body(), status_code=400)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created,
            "owned_by": "llmdb", "max_model_len": engine.config.max_context}]}

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ServerError(404, f"model {name!r} is not served here; this server serves "
                              f"{model_name!r}", "model", code="model_not_found")

    def submit(prompt, body, params: SamplingParams) -> _Call:
        """Queue on the engine, with the limits checked first."""
        if params.max_tokens > limits.max_tokens:
            raise ServerError(400, f"max_tokens is {params.max_tokens}; at most "
                              f"{limits.max_tokens} here", "max_tokens")
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue = asyncio.Queue()
        logprobs: list = []
        rid = f"srv-{uuid.uuid4().hex}"
        try:
            ids = engine.encode_prompt(prompt)
            cap = limits.max_prompt_tokens or engine.config.max_context
            if len(ids) > cap:
                raise ServerError(400, f"the prompt is {len(ids)} tokens; at most {cap} here",
                                  "prompt", code="context_length_exceeded")
            engine.add_request(
                ids, params, request_id=rid,
                on_token=lambda tok: loop.call_soon_threadsafe(tokens.put_nowait, tok),
                on_logprobs=(lambda lp: loop.call_soon_threadsafe(logprobs.append, lp))
                if body.stream and params.logprobs is not None else None,
                priority=body.scheduling_class())
        except ValueError as e:
            raise ServerError(400, refusal_text(e, rid)) from e
        inflight.add(rid)
        return _Call(rid, tokens, logprobs)

    async def finish(call: _Call) -> RequestResult:
        while await call.tokens.get() is not None:
            pass
        return await asyncio.to_thread(engine.wait, call.request_id)

    def end_soon(rid: str) -> None:
        """Abort the request if it still runs (its blocks are freed) and drop a result no
        one will collect. In a thread of its own, not awaited: engine.abort waits for the
        step under way, so on the event loop it held up every other request, in a shared
        pool requests ended together waited a step each in turn, and an await in a handler
        cancelled mid-way (a client that left) was skipped, its request left running."""
        def run() -> None:
            engine.abort(rid)
            try:
                engine.wait(rid, timeout=0)
            except KeyError:  # already collected
                pass

        threading.Thread(target=run, name="llmdb-end", daemon=True).start()

    def close(call: _Call) -> None:
        """End the request, free its concurrency slot; once per call, whatever ended it."""
        if call.closed:
            return
        call.closed = True
        end_soon(call.request_id)
        inflight.discard(call.request_id)
        slots.release()

    async def run(request: Request, body, prompt, params: SamplingParams, render,
                  prepare=None) -> Any:
        """Answer one completion: a JSON body, or a server-sent event stream. prepare: work
        done first, once the request is admitted (prompt log-probabilities)."""
        check_model(body.model)
        if state.draining:
            raise ServerError(503, "the server is shutting down", type_="server_error")
        if slots.locked():
            raise ServerError(429, f"{limits.max_concurrent} requests are running; retry later",
                              type_="rate_limit_error", code="too_many_requests",
                              headers={"Retry-After": "1"})
        await slots.acquire()
        try:
            if prepare is not None:
                await watch_disconnect(request, prepare())
            call = submit(prompt, body, params)
        except BaseException:
            slots.release()
            raise
        if body.stream:
            # The background task closes the call too when the stream never started.
            return StreamingResponse(stream(call, params, render), media_type="text/event-stream",
                                     background=BackgroundTask(close, call))
        try:
            return render.final(await watch_disconnect(request, finish(call)))
        finally:
            close(call)

    async def watch_disconnect(request: Request, work):
        task = asyncio.ensure_future(work)
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if not done and await request.is_disconnected():
                task.cancel()
                # Its cleanup (aborting its engine request) is done before the answer.
                await asyncio.wait({task})
                raise ServerError(499, "the client closed the connection")
        return task.result()

    async def stream(call: _Call, params: SamplingParams, render) -> AsyncIterator[str]:
        text = IncrementalText(engine.tokenizer, params.stop)
        unsent: list[int] = []  # tokens whose log-probabilities are not sent yet
        try:
            yield _sse(render.first_chunk())
            while (tok := await call.tokens.get()) is not None:
                unsent.append(tok)
                piece = text.push(tok)
                if piece:
                    yield _sse(render.chunk(piece, tokens=sent(call, unsent)))
            result = await asyncio.to_thread(engine.wait, call.request_id)
            try:
                yield _sse(render.chunk(text.flush(result), result, sent(call, unsent)))
                if render.stream_usage:
                    yield _sse(render.usage_chunk(result))
            except ServerError as e:  # headers are sent: the error goes in the stream
                yield _sse(e.body())
            yield "data: [DONE]\n\n"
        finally:  # also when the client disconnects: the generator is closed
            close(call)

    def sampling(body, logprobs: int | None) -> SamplingParams:
        # A request that names no max_tokens gets the default, within this server's limit.
        return body.sampling(min(limits.default_max_tokens, limits.max_tokens), logprobs)

    def sent(call: _Call, unsent: list[int]) -> list[tuple[int, tuple]] | None:
        """The unsent tokens with their log-probabilities, for a chunk (None unless asked)."""
        first = len(call.logprobs) - len(unsent)  # (each token's came before it)
        out = list(zip(unsent, call.logprobs[first:], strict=True)) if call.logprobs else None
        unsent.clear()
        return out

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        params = sampling(body, body.logprobs)
        render = _CompletionRender(model_name, engine, body.logprobs, usage(body))
        prepare = None
        if body.prompt_logprobs is not None:
            if body.stream:
                raise ServerError(400, "prompt_logprobs is not available with stream",
                                  "prompt_logprobs")

            async def prepare() -> None:
                render.prompt_logprobs = await prompt_logprobs(body.prompt,
                                                               body.prompt_logprobs)

        return await run(request, body, body.prompt, params, render, prepare)

    async def prompt_logprobs(prompt, k: int) -> list:
        """vLLM's prompt_logprobs: None for the first token, then per prompt token a dict of
        its own and the k most likely ids' {"logprob", "rank", "decoded_token"}. The logits
        are an engine request like a completion's: a client that goes away (this task is
        cancelled) aborts it, and so does shutdown."""
        rid = f"srv-{uuid.uuid4().hex}"
        try:
            ids = await asyncio.to_thread(engine.encode_prompt, prompt)
            cap = limits.max_prompt_tokens or engine.config.max_context
            if len(ids) > cap:
                raise ValueError(f"the prompt is {len(ids)} tokens; at most {cap} here")
            # Queued here on the event loop, not in the thread: a cancel then finds it queued
            # (and aborts it) or not yet made, never about to be.
            engine.add_logits_request(ids, request_id=rid)
        except ValueError as e:
            raise ServerError(400, refusal_text(e, rid), "prompt") from e
        inflight.add(rid)
        abandoned = threading.Event()
        try:
            return await asyncio.to_thread(ranked_prompt, rid, ids, k, abandoned)
        except RequestAborted as e:  # by drain(): retried elsewhere, whole
            raise ServerError(503, "the server stopped before the request finished; retry it",
                              type_="server_error") from e
        except RuntimeError as e:  # its step failed: as a completion's failure is answered
            raise ServerError(500, f"prompt log-probabilities failed: {e}",
                              type_="server_error") from e
        finally:
            abandoned.set()
            end_soon(rid)  # (its abort is a no-op unless this task was cancelled mid-way)
            inflight.discard(rid)

    def ranked_prompt(rid: str, ids: list[int], k: int, abandoned: threading.Event) -> list:
        """prompt_logprobs' rows from the logits request rid. (Off the event loop: a long
        prompt's loop takes seconds, so it stops early once nobody waits for it.)"""
        logits = engine.collect_logits(rid)[:-1]
        text = engine.tokenizer.token_text
        out: list = [None]
        for i in range(0, len(logits), _LOGPROB_ROWS):  # ([rows, vocab] fp32 copies: bounded)
            if abandoned.is_set():
                raise RequestAborted(rid, "logits request")
            own = ids[i + 1 : i + 1 + _LOGPROB_ROWS]
            rows = run_on_compute_thread(_ranked, logits[i : i + len(own)], own, k)
            out += [{t: {"logprob": lp, "rank": rank, "decoded_token": text(t)}
                     for t, lp, rank in row} for row in rows]
        return out

    def usage(body) -> bool:
        """A stream's usage, in a last chunk of its own, only where stream_options asks."""
        return bool(body.stream_options and body.stream_options.include_usage)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatCompletionRequest):
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling(body, k)
        return await run(request, body, encode_chat(body), params,
                         _ChatRender(model_name, engine, k, usage(body)))

    def encode_chat(body: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        try:
            return engine.tokenizer.encode_chat([m.model_dump() for m in body.messages],
                                                **body.template_options())
        except ValueError as e:
            raise ServerError(400, str(e)) from e

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        """vLLM's /tokenize, which clients scoring through prompt_logprobs need: the ids the
        completion endpoints would see (chat messages encoded as /v1/chat/completions does)."""
        check_model(body.model)
        if body.messages is not None:
            ids = encode_chat(body)
        else:
            ids = engine.tokenizer.encode(body.prompt, add_special=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.config.max_context, "tokens": ids}

    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes)
    return app


class _Guard:
    """Authentication and the body-size limit for /v1/ and /tokenize, before any handler runs.

    A plain ASGI middleware, so that a body sent without a content-length (chunked) is
    limited too: it is read here, up to the limit, and replayed to the app. Streaming
    responses pass through untouched (BaseHTTPMiddleware would wrap each in another stream)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(("/v1/", "/tokenize")):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None:
            scheme, _, given = headers.get("authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    given.strip().encode(), self.api_key.encode()):
                return await _reject(send, ServerError(
                    401, "missing or wrong API key (Authorization: Bearer ...)",
                    type_="authentication_error", code="invalid_api_key"))
        too_big = ServerError(413, f"the request body is over {self.max_body_bytes} bytes")
        size = headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > self.max_body_bytes):
            return await _reject(send, too_big)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await _reject(send, too_big)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _reject(send, err: ServerError) -> None:
    payload = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def _ranked(logits: torch.Tensor, own: list[int], k: int) -> list[list[tuple[int, float, int]]]:
    """Per row of logits: (id, log-probability, rank) of its own next token, then of the k
    most likely ones. On the compute thread (engine/compute.py: torch work on another thread
    gives it an OpenMP team of its own, which slows every engine step after it)."""
    lp = logits.log_softmax(-1)
    own_lp = lp.gather(1, torch.tensor(own)[:, None])[:, 0]
    own_rank = (lp > own_lp[:, None]).sum(-1) + 1
    rows = [[(t, v, r)] for t, v, r in zip(own, own_lp.tolist(), own_rank.tolist(), strict=True)]
    if k:
        top = lp.topk(k, dim=-1)
        # Every value above a top-k value is in the top k: its rank counts those.
        top_rank = (top.values[:, None, :] > top.values[:, :, None]).sum(-1) + 1
        for row, ids, values, ranks in zip(rows, top.indices.tolist(), top.values.tolist(),
                                           top_rank.tolist(), strict=True):
            row += [e for e in zip(ids, values, ranks, strict=True) if e[0] != row[0][0]]
    return rows


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(r: RequestResult) -> dict:
    return {"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.generated_tokens,
            "total_tokens": r.usage.prompt_tokens + r.usage.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": r.usage.cached_tokens}}


def _finish_reason(r: RequestResult) -> str:
    if r.finish_reason == "error":
        raise ServerError(500, f"generation failed: {r.error}", type_="server_error")
    if r.finish_reason == "abort":  # (the server is shutting down: retried elsewhere, whole)
        raise ServerError(503, "the server stopped before the request finished; retry it",
                          type_="server_error")
    return "length" if r.finish_reason == "length" else "stop"


class _Render:
    """The OpenAI objects of one endpoint: a final body, or stream chunks."""

    def __init__(self, model: str, engine: LLMEngine, logprobs: int | None,
                 stream_usage: bool = False):
        self.model, self.engine, self.logprobs = model, engine, logprobs
        self.stream_usage = stream_usage
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    prefix = "cmpl"
    chunk_object = "text_completion"  # the "object" of a stream's chunks

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage_chunk(self, r: RequestResult) -> dict:
        """The whole request's usage after the last choice chunk, as OpenAI sends it: no
        choices, so that a client reading it as the end loses no text."""
        return {**self._base(self.chunk_object), "choices": [], "usage": _usage(r)}

    tokens_written = 0  # output tokens whose logprobs entries are written so far

    def _token_texts(self, ids: list[int]) -> list[str]:
        """The texts of the next output tokens, which join into the answer's text: the
        answer's first token as the answer starts (a SentencePiece model's loses the space
        its text drops), the others as they read after it."""
        tok = self.engine.tokenizer
        texts = [tok.decode([t], skip_special=False) if self.tokens_written == 0 and k == 0
                 else tok.token_text(t) for k, t in enumerate(ids)]
        self.tokens_written += len(ids)
        return texts


class _CompletionRender(_Render):
    prompt_logprobs: list | None = None
    streamed_chars = 0  # text_offset of the next token streamed

    def final(self, r: RequestResult) -> dict:
        choice = {"index": 0, "text": r.text, "finish_reason": _finish_reason(r),
                  "logprobs": self._logprobs(r)}
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs
        return {**self._base("text_completion"), "choices": [choice], "usage": _usage(r)}

    def _logprobs(self, r: RequestResult) -> dict | None:
        if self.logprobs is None or r.logprobs is None:
            return None
        return self._logprobs_of(list(zip(r.token_ids, r.logprobs, strict=True)), 0)

    def _logprobs_of(self, tokens: list[tuple[int, tuple]], start: int) -> dict:
        """OpenAI's completion logprobs of (token, (logprob, top)) pairs, the first at
        text offset `start`."""
        text = self.engine.tokenizer.token_text
        texts = self._token_texts([t for t, _ in tokens])
        # The sampled token is in its position's top_logprobs even outside the top k (k + 1
        # entries then), as OpenAI's and vLLM's legacy completions have it.
        return {"tokens": texts, "token_logprobs": [lp for _, (lp, _) in tokens],
                "top_logprobs": [{text(t): v for t, v in (top | {tok: lp}).items()}
                                 for tok, (lp, top) in tokens],
                "text_offset": [start + o for o in _offsets(texts)]}

    def first_chunk(self) -> dict:
        return {**self._base(self.chunk_object),
                "choices": [{"index": 0, "text": "", "finish_reason": None, "logprobs": None}]}

    def chunk(self, text: str, result: RequestResult | None = None,
              tokens: list[tuple[int, tuple]] | None = None) -> dict:
        """tokens: those of this chunk, with their log-probabilities (where asked for)."""
        logprobs = None
        if tokens is not None:
            logprobs = self._logprobs_of(tokens, self.streamed_chars)
            self.streamed_chars += sum(len(t) for t in logprobs["tokens"])
        return {**self._base(self.chunk_object), "choices": [{
            "index": 0, "text": text, "logprobs": logprobs,
            "finish_reason": _finish_reason(result) if result else None}]}


class _ChatRender(_Render):
    prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def final(self, r: RequestResult) -> dict:
        return {**self._base("chat.completion"), "choices": [{
            "index": 0, "message": {"role": "assistant", "content": r.text},
            "finish_reason": _finish_reason(r), "logprobs": self._logprobs(r)}],
            "usage": _usage(r)}

    def _logprobs(self, r: RequestResult) -> dict | None:
        if self.logprobs is None or r.logprobs is None:
            return None
        return self._logprobs_of(list(zip(r.token_ids, r.logprobs, strict=True)))

    def _logprobs_of(self, tokens: list[tuple[int, tuple]]) -> dict:
        """OpenAI's chat logprobs: top_logprobs holds the k most likely tokens only."""
        text = self.engine.tokenizer.token_text
        return {"content": [{
            **_chat_token(written, lp),
            "top_logprobs": [_chat_token(text(i), v) for i, v in top.items()]}
            for written, (_, (lp, top)) in zip(self._token_texts([t for t, _ in tokens]),
                                               tokens, strict=True)]}

    def first_chunk(self) -> dict:
        return {**self._base(self.chunk_object), "choices": [{
            "index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}

    def chunk(self, text: str, result: RequestResult | None = None,
              tokens: list[tuple[int, tuple]] | None = None) -> dict:
        """tokens: those of this chunk, with their log-probabilities (where asked for)."""
        choice = {"index": 0, "delta": {"content": text} if text else {},
                  "finish_reason": _finish_reason(result) if result else None}
        if tokens is not None:
            choice["logprobs"] = self._logprobs_of(tokens)
        return {**self._base(self.chunk_object), "choices": [choice]}


def _chat_token(text: str, logprob: float) -> dict:
    # (bytes from the decoded text, as vLLM's: a token that is part of a character reads as
    # U+FFFD, whose bytes are not the token's own)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _offsets(tokens: list[str]) -> list[int]:
    out, pos = [], 0
    for t in tokens:
        out.append(pos)
        pos += len(t)
    return out
