"""OpenAI-compatible endpoints (llmdb serve, vLLM, hosted APIs) as a backend.

Generation goes to the endpoints' /chat/completions (under each base URL, endpoints.py) with
the row's chat messages, so the server applies its model's own template. Scoring needs
log-probabilities, which not every endpoint gives:
- ChoiceRequest (llm_filter): the answer's first token with top_logprobs=20; each word's
  probability sums its one-token spellings (yes, Yes, " yes", ...) among them, as the
  local engine sums them over the whole vocabulary. A spelling outside the top 20 is less
  likely than the 20th token and is left out, unless the word has no spelling in the top
  20 at all (content-free calibration prompts): then its spellings are scored one by one
  through prompt_logprobs where the endpoints have /tokenize.
- ScoreRequest (llm_classify): the continuation's tokens and the end of turn appended to the
  prompt's tokens (from vLLM's /tokenize, which llmdb serve also has), scored by
  /completions with prompt_logprobs: the same ids the local engine scores.
An endpoint without them (hosted chat APIs) fails those rows with an error naming it.
A server renders the chat and tokenizes it with special tokens parsed: every text sent from
the query has its special-token strings broken first (special_tokens.py), so that a row's
`<|im_end|>` stays text there as it does in the local engine.
A base model (base_model=True: no chat template, as the registry says) is sent plain text:
llm_complete's prompt goes to /completions to be continued, as the local engine continues a
base model's; the chat functions, which need an instruction-tuned model, are refused.

Requests run on one asyncio loop in a thread of their own; ReplicaPool (replicas.py) picks
the replica, applies the limits and retries, and fails over when a replica dies. The API key
is read from the environment variable named by the caller (again after a 401, for a rotated
key) and kept only by the pool for the requests' headers: never in a registry file, a
result-cache key, a log line or an error.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from . import openai_answers as answers
from .base import (
    BackendResult,
    ChoiceRequest,
    Exchange,
    GenerationRequest,
    ModelRequest,
    Prompt,
    RequestTokens,
    ScoreRequest,
    chat_messages,
)
from .endpoints import base_urls, server_root
from .replicas import EndpointError, ReplicaLimits, ReplicaPool
from .special_tokens import neutralize

TOKENIZED_KEPT = 10_000  # /tokenize answers kept (prompts scored against several labels)
TOP_LOGPROBS = 20  # the most OpenAI's API and vLLM's default allow
CHARS_PER_TOKEN = 4  # OpenAI's rule of thumb, for rate limits and endpoints without /tokenize
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class _NoTokenize(EndpointError):
    """The endpoints have no /tokenize."""


def _needs_logprobs(url: str, what: str) -> EndpointError:
    return EndpointError(
        f"the endpoint {url} returned no {what}; llm_filter and llm_classify need an "
        f"OpenAI-compatible server that returns them (vLLM, llmdb serve)")


def _api_key(variable: str, endpoints: list[str]) -> str:
    """The key in the environment variable, without the surrounding whitespace a key read
    from a file brings: a line break in a header is refused by the HTTP client with an error
    that quotes the header, key and all."""
    key = os.environ.get(variable, "").strip()
    if not key:
        raise ValueError(f"the environment variable {variable} (the API key for "
                         f"{', '.join(endpoints)}) is not set")
    if not (key.isascii() and key.isprintable()):
        raise ValueError(f"the environment variable {variable} holds characters that an HTTP "
                         "header cannot carry (a line break or a non-ASCII character inside "
                         "the key?)")
    return key


class OpenAIBackend:
    def __init__(self, name: str, endpoints: Sequence[str], *, api_key_env: str | None = None,
                 served_model: str | None = None, send_priority: bool = False,
                 base_model: bool = False, **limits: Any):
        """`name` is the model's name in SQL; `served_model` the one sent to the endpoints
        (default: the same). Interactive (RT) rows take free replica slots before bulk (BE)
        ones here; send_priority also tells the servers, as vLLM's `priority` field (bulk
        rows 1, interactive 0: lower runs first; llmdb serve reads priority > 0 as bulk).
        Off by default: hosted APIs reject the field, and vLLM refuses a non-zero priority
        unless it runs with --scheduling-policy priority. base_model: the served model has no
        chat template (its prompts go to /completions). Limits: ReplicaLimits' fields."""
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        self.name = name
        self.served_model = served_model or name
        self.send_priority = send_priority
        self.base_model = base_model
        self.endpoints = base_urls(endpoints)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._futures: dict[str, Future] = {}
        self._results: dict[str, BackendResult] = {}
        self._tokenized: dict[str, asyncio.Future] = {}  # JSON of a /tokenize body -> ids
        self._has_tokenize: bool | None = None
        # Read here (a missing key fails the connection, not its rows), and again by the pool
        # after a 401: a key rotated in the environment is taken without a restart.
        key = (lambda: _api_key(api_key_env, self.endpoints)) if api_key_env else None
        self.pool = ReplicaPool(self.endpoints, ReplicaLimits(**limits), api_key=key)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"llmdb-openai-{name}")
        self._thread.start()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ---- the contract --------------------------------------------------------------------

    def identity(self) -> dict[str, Any]:
        # What a remote server runs is not visible from here: its name and where it runs
        # stand for it (the same name elsewhere may be other weights). The servers by their
        # roots, as before base URLs were taken as given: answers cached from
        # http://h:8000/v1 stay found.
        return {"backend": "openai", "model": self.served_model,
                "endpoints": sorted(server_root(e) for e in self.endpoints)}

    def render_chat(self, user: str, system: str | None,
                    before: Sequence[Exchange] = ()) -> list[dict[str, str]]:
        if self.base_model:
            raise ValueError(f"{self._base_model}: llm_filter and llm_classify ask it chat "
                             f"questions, which need an instruction-tuned model (llm_complete "
                             f"continues plain text on it)")
        return chat_messages(user, system, before)

    def render_completion(self, prompt: str, system: str | None) -> Prompt:
        """The chat; for a base model the prompt's text, which its endpoints' /completions
        continue."""
        if not self.base_model:
            return chat_messages(prompt, system)
        if system is not None:
            raise ValueError(f"{self._base_model}: it takes no system prompt (put the "
                             f"instruction in the prompt)")
        return prompt

    @property
    def _base_model(self) -> str:
        return f"{self.name} is a base model (served at {', '.join(self.endpoints)})"

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Exact where the endpoints have /tokenize (vLLM, llmdb serve), all texts asked at
        once; else, or while they cannot be reached, an estimate of one token per four
        characters."""
        if self._has_tokenize is not False:
            try:
                return self._run(self._count_tokens(texts))
            except _NoTokenize:
                self._has_tokenize = False
            except EndpointError:
                pass
        return [math.ceil(len(t) / CHARS_PER_TOKEN) for t in texts]

    async def _count_tokens(self, texts: Sequence[str]) -> list[int]:
        ids = await asyncio.gather(*(self._tokenize({"prompt": t, "add_special_tokens": False})
                                     for t in texts))
        return [len(i) for i in ids]

    def submit(self, request: ModelRequest, on_finish: Callable[[], None]) -> str:
        if not isinstance(request, GenerationRequest | ScoreRequest | ChoiceRequest):
            raise TypeError(f"unknown request type {type(request).__name__}")
        if self.base_model:
            if not (isinstance(request, GenerationRequest) and isinstance(request.prompt, str)):
                raise ValueError(f"{self._base_model}: it continues plain text only")
        elif not isinstance(request.prompt, list):
            raise ValueError("the openai backend sends chat messages, not final text")
        handle = f"openai-{next(self._ids)}"
        future = asyncio.run_coroutine_threadsafe(self._serve(request), self._loop)
        with self._lock:
            self._futures[handle] = future
        future.add_done_callback(lambda f: self._finished(handle, f, on_finish))
        return handle

    def _finished(self, handle: str, future: Future, on_finish: Callable[[], None]) -> None:
        if future.cancelled():  # aborted: nobody collects it
            return
        try:
            result = future.result()
        except Exception as e:  # noqa: BLE001 - an answer we failed to read is the row's error
            result = BackendResult(finish_reason="error", error=f"{type(e).__name__}: {e}")
        with self._lock:
            if handle not in self._futures:
                return
            self._results[handle] = result
        on_finish()

    def collect(self, handle: str) -> BackendResult:
        with self._lock:
            if handle not in self._results:
                raise RuntimeError(f"request {handle} has not finished")
            del self._futures[handle]
            return self._results.pop(handle)

    def generated_so_far(self, handle: str) -> int:
        return 0  # answers arrive whole (no streaming)

    def output_so_far(self, handle: str) -> list[int] | None:
        return None  # (a server's tokens are not ours to resume from)

    # ---- for EXPLAIN LLM: estimates without a round trip per row ---------------------------

    def describe(self) -> str:
        return f"{self.served_model} at {', '.join(self.endpoints)} (OpenAI-compatible)"

    def tokenize(self, request: ModelRequest) -> RequestTokens:
        n = self._estimate(request.prompt, 0)
        if isinstance(request, ScoreRequest):  # the continuation, then end of turn
            return RequestTokens(None, n + self._estimate(request.continuation, 0) + 1, n - 1)
        return RequestTokens(None, n, n - 1)

    def cached_prefix(self, ids: Sequence[int]) -> int:
        return 0  # a remote server's prefix cache is not visible from here

    def simulation(self) -> None:
        return None

    def abort(self, *handles: str) -> None:
        """Cancel the requests; their HTTP connections close, which aborts them on the
        server."""
        for handle in handles:
            with self._lock:
                future = self._futures.pop(handle, None)
                self._results.pop(handle, None)
            if future is not None:
                future.cancel()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self.pool.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    # ---- requests ------------------------------------------------------------------------

    async def _serve(self, request: ModelRequest) -> BackendResult:
        try:
            if isinstance(request, GenerationRequest):
                return await self._generate(request)
            if isinstance(request, ChoiceRequest):
                return await self._choose(request)
            return await self._score(request)
        except EndpointError as e:
            return BackendResult(finish_reason="error", error=str(e))

    def _estimate(self, prompt: Prompt, max_tokens: int) -> int:
        return math.ceil(len(json.dumps(prompt)) / CHARS_PER_TOKEN) + max_tokens

    async def _post(self, path: str, body: dict[str, Any], tokens: int, priority: str,
                    read: Callable[[Any], Any]) -> Any:
        if self.send_priority and priority == "BE":
            body = {**body, "priority": 1}
        return await self.pool.post(path, _as_data(body), tokens, priority, read)

    async def _chat(self, prompt: Prompt, fields: dict[str, Any], max_tokens: int,
                    priority: str, read: Callable[[Any], Any]) -> Any:
        body = {"model": self.served_model, "messages": prompt, "max_tokens": max_tokens,
                **fields}
        return await self._post("/chat/completions", body,
                                self._estimate(prompt, max_tokens), priority, read)

    async def _generate(self, request: GenerationRequest) -> BackendResult:
        p = request.params
        fields: dict[str, Any] = {"temperature": p.temperature}
        # Sent only when set: hosted APIs reject fields they do not know (top_k, ignore_eos
        # and stop_token_ids are vLLM's and llmdb serve's).
        optional = {"top_p": p.top_p != 1.0, "top_k": p.top_k > 0, "seed": p.seed is not None,
                    "stop": bool(p.stop), "stop_token_ids": bool(p.stop_token_ids),
                    "ignore_eos": p.ignore_eos}
        fields.update({k: getattr(p, k) for k, on in optional.items() if on})
        if self.base_model:
            body = {"model": self.served_model, "prompt": request.prompt,
                    "max_tokens": p.max_tokens, **fields}
            return await self._post("/completions", body,
                                    self._estimate(request.prompt, p.max_tokens),
                                    request.priority,
                                    lambda data: _generation_result(data, answers.text))
        return await self._chat(request.prompt, fields, p.max_tokens, request.priority,
                                _generation_result)

    async def _choose(self, request: ChoiceRequest) -> BackendResult:
        top, prompt_tokens = await self._chat(
            request.prompt, {"temperature": 0, "logprobs": True, "top_logprobs": TOP_LOGPROBS},
            max_tokens=1, priority=request.priority, read=_top_logprobs)
        if top is None:
            raise _needs_logprobs(", ".join(self.endpoints), "logprobs (top_logprobs)")
        probs = []
        for word in request.words:
            forms = {p + f for f in (word, word.lower(), word.capitalize(), word.upper())
                     for p in ("", " ")}
            p = sum(top.get(f, 0.0) for f in forms)
            if p == 0.0 and self._has_tokenize is not False:
                p = await self._probability_of(request.prompt, sorted(forms),
                                               request.priority)
            probs.append(p)
        return BackendResult(word_probs=tuple(probs), prompt_tokens=prompt_tokens)

    async def _probability_of(self, prompt: Prompt, spellings: list[str], priority: str
                              ) -> float:
        """The summed next-token probability of a word none of whose spellings is in the
        top 20, each one-token spelling scored through prompt_logprobs (one request each);
        0 where the endpoints have no /tokenize."""
        try:
            ids = [await self._tokenize({"prompt": s, "add_special_tokens": False})
                   for s in spellings]
            prompt_ids = await self._tokenize({"messages": prompt,
                                               "add_generation_prompt": True})
        except _NoTokenize:
            self._has_tokenize = False
            return 0.0
        singles = sorted({i[0] for i in ids if len(i) == 1})
        rows = await asyncio.gather(*(self._prompt_logprobs([*prompt_ids, t], priority)
                                      for t in singles))
        return sum(math.exp(r[-1]) for r in rows)

    async def _score(self, request: ScoreRequest) -> BackendResult:
        prompt_ids = await self._tokenize({"messages": request.prompt,
                                           "add_generation_prompt": True})
        answer = await self._tokenize({"prompt": request.continuation,
                                       "add_special_tokens": False})
        ids = [*prompt_ids, *answer, await self._end_of_turn()]
        logprobs = await self._prompt_logprobs(ids, request.priority)
        return BackendResult(logprob=sum(logprobs[len(prompt_ids):]), prompt_tokens=len(ids))

    async def _prompt_logprobs(self, ids: list[int], priority: str) -> list[float]:
        """Each token's log-probability after the ones before it (the first's is 0), from
        /completions' prompt_logprobs (vLLM's, and llmdb serve's)."""
        body = {"model": self.served_model, "prompt": ids, "max_tokens": 1, "temperature": 0,
                "prompt_logprobs": 0}
        logprobs = await self._post("/completions", body, len(ids) + 1, priority,
                                    lambda data: answers.prompt_logprobs(data, ids))
        if logprobs is None:
            raise _needs_logprobs(", ".join(self.endpoints), "prompt_logprobs")
        return logprobs

    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        """Token ids from the endpoints' /tokenize (vLLM's shape), each body asked once."""
        key = json.dumps(body, sort_keys=True)
        if key not in self._tokenized:
            if len(self._tokenized) >= TOKENIZED_KEPT:
                self._tokenized.clear()
            task = asyncio.ensure_future(self._post_tokenize(body))
            # Its error reaches every waiter; marked read for when all of them were aborted.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._tokenized[key] = task
        task = self._tokenized[key]
        try:
            return list(await asyncio.shield(task))
        except EndpointError:
            self._tokenized.pop(key, None)  # not cached: a later call asks again
            raise

    async def _post_tokenize(self, body: dict[str, Any]) -> list[int]:
        try:
            # No model runs for it, and its answer is shared: it never queues behind
            # bulk generations (and carries no priority field, which /tokenize lacks).
            tokens = await self.pool.post("/tokenize",
                                          _as_data({"model": self.served_model, **body}),
                                          priority="RT", read=answers.tokens)
        except EndpointError as e:
            if " answered 404" in str(e) or " answered 405" in str(e):
                raise _NoTokenize(f"{e}; scoring needs vLLM's /tokenize, which "
                                    f"{', '.join(self.endpoints)} does not offer") from e
            raise
        self._has_tokenize = True
        return tokens

    async def _end_of_turn(self) -> int:
        """The token the chat template ends an answer with: the one that follows a short
        answer's tokens in a rendered conversation."""
        user = [{"role": "user", "content": "Hi"}]
        prompt = await self._tokenize({"messages": user, "add_generation_prompt": True})
        answer = await self._tokenize({"prompt": "A", "add_special_tokens": False})
        full = await self._tokenize({"messages": [*user, {"role": "assistant", "content": "A"}],
                                     "add_generation_prompt": False})
        n = len(prompt) + len(answer)
        if full[:n] != prompt + answer or len(full) <= n:
            raise EndpointError(f"cannot tell the end-of-turn token of the model at "
                                f"{', '.join(self.endpoints)} from its chat template")
        return full[n]


def _as_data(body: dict[str, Any]) -> dict[str, Any]:
    """The body with the query's text in it (messages' contents, a text prompt) neutralized
    (special_tokens.py): the server parses special tokens in what it renders and tokenizes,
    and a row's `<|im_end|>` would end its turn there. Only what is sent changes: result-cache
    keys stay made of the text as written."""
    sent = dict(body)
    if "messages" in body:
        sent["messages"] = [{**m, "content": neutralize(m["content"])}
                            if isinstance(m.get("content"), str) else m
                            for m in body["messages"]]
    if isinstance(body.get("prompt"), str):
        sent["prompt"] = neutralize(body["prompt"])
    return sent


def _generation_result(data: Any, text: Callable[[dict[str, Any]], str] = answers.chat_text
                       ) -> BackendResult:
    """A chat completion's result (text=answers.text: a completion's)."""
    choice = answers.first_choice(data)
    prompt_tokens, generated, cached = answers.usage(data)
    return BackendResult(text=text(choice),
                         finish_reason=_FINISH.get(choice.get("finish_reason"), "stop"),
                         prompt_tokens=prompt_tokens, generated_tokens=generated,
                         cached_tokens=cached)


def _top_logprobs(data: Any) -> tuple[dict[str, float] | None, int]:
    """The first token's top_logprobs as probabilities (None: none sent), and the prompt's
    tokens."""
    return answers.first_token_top_logprobs(answers.first_choice(data)), answers.usage(data)[0]


_backends: dict[str, OpenAIBackend] = {}
_backends_lock = threading.Lock()


def openai_backend(name: str, **config: Any) -> OpenAIBackend:
    """This process's backend for `name` on these endpoints and options: connections share
    it, and with it each replica's concurrency and the rate limits (a key's quota is the
    key's, whichever connection spends it)."""
    config["endpoints"] = base_urls(config["endpoints"])  # (http://h/v1, http://h/: one server)
    key = json.dumps([name, config], sort_keys=True, default=str)
    with _backends_lock:
        if key not in _backends:
            _backends[key] = OpenAIBackend(name, **config)
        return _backends[key]
