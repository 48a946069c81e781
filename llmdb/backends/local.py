"""The in-process engine as a backend: one shared engine per model per process."""

from __future__ import annotations

import atexit
import functools
import hashlib
import itertools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from llmdb.engine.engine import LLMEngine, refusal_text
from llmdb.engine.process_engines import shared_engine, shutdown_engines
from llmdb.engine.research.sim import SimConfig

from .base import (
    BackendResult,
    ChoiceRequest,
    Exchange,
    GenerationRequest,
    ModelRequest,
    Prompt,
    RequestTokens,
    ScoreRequest,
    Simulation,
)
from .own_tokenizer import chat_prompt, completion_prompt

# Request ids of every LocalBackend (several may share an engine).
_request_ids = itertools.count()
# Label words whose token ids a backend keeps, the most recently used: kept for the
# process's life, they grew without bound in a server or notebook classifying into free-text
# labels. A query's labels are a handful, and a word's ids take a few encodes to find again.
LABEL_WORDS_KEPT = 4096


class LocalBackend:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.name = engine.model_name
        tok = engine.tokenizer
        self._end_of_turn = tok.token_id(tok.eos_token) if tok.eos_token else None
        if self._end_of_turn is None:
            self._end_of_turn = engine.config.eos_token_ids[0]
        self._variants = functools.lru_cache(maxsize=LABEL_WORDS_KEPT)(self._word_variants)
        self._choices: dict[str, list[list[int]]] = {}  # handle -> token ids per word
        self._lock = threading.Lock()
        template = tok.chat_template or ""
        self._identity = {
            "model": self.name,
            "fingerprint": engine.fingerprint,
            "dtype": str(engine.dtype).removeprefix("torch."),
            # Another device's kernels round differently: its answers are cached apart.
            "device": engine.device.type,
            "engine_version": engine.version,
            "chat_template": hashlib.sha256(template.encode()).hexdigest()[:16],
        }

    def identity(self) -> dict[str, Any]:
        return dict(self._identity)

    def render_chat(self, user: str, system: str | None,
                    before: Sequence[Exchange] = ()) -> list[dict[str, str]]:
        return chat_prompt(self.engine.tokenizer, self.name, user, system, before)

    def render_completion(self, prompt: str, system: str | None) -> Prompt:
        return completion_prompt(self.engine.tokenizer, self.name, prompt, system)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [len(self.engine.tokenizer.encode_plain(t)) for t in texts]

    def _continuation(self, text: str) -> list[int]:
        """A scored continuation's tokens: the text, then end of turn."""
        return [*self.engine.tokenizer.encode_plain(text), self._end_of_turn]

    def _word_variants(self, word: str) -> list[int]:
        """A label word's one-token spellings (cached per backend as self._variants)."""
        ids = self.engine.tokenizer.single_token_variants(word)
        if not ids:
            raise ValueError(f"the vocabulary has no one-token spelling of {word!r}")
        return ids

    def submit(self, request: ModelRequest, on_finish: Callable[[], None]) -> str:
        # A refusal is the row's error: the engine's request id at its end would be noise
        # there (and differ from run to run).
        rid = f"llmdb-{next(_request_ids)}"
        try:
            return self._submit(request, rid, lambda _rid: on_finish())
        except (TypeError, ValueError) as e:
            if e.args and isinstance(e.args[0], str):
                e.args = (refusal_text(e, rid), *e.args[1:])
            raise

    def _submit(self, request: ModelRequest, rid: str, done: Callable[[str], None]) -> str:
        eng = self.engine
        if isinstance(request, GenerationRequest):
            return eng.add_request(request.prompt, request.params, request_id=rid,
                                   on_finish=done, priority=request.priority,
                                   resume_from=request.resume_from)
        if isinstance(request, ScoreRequest):
            return eng.add_score_request(request.prompt,
                                         self._continuation(request.continuation),
                                         request_id=rid, on_finish=done,
                                         priority=request.priority)
        if isinstance(request, ChoiceRequest):
            groups = [self._variants(w) for w in request.words]
            with self._lock:  # the callback may fire before add_choice_request returns
                handle = eng.add_choice_request(
                    request.prompt, [t for g in groups for t in g], request_id=rid,
                    on_finish=done, priority=request.priority)
                self._choices[handle] = groups
            return handle
        raise TypeError(f"unknown request type {type(request).__name__}")

    def collect(self, handle: str) -> BackendResult:
        r = self.engine.wait(handle, timeout=0)
        if r is None:
            raise RuntimeError(f"request {handle} has not finished")
        with self._lock:
            groups = self._choices.pop(handle, None)
        out = BackendResult(
            text=r.text, finish_reason=r.finish_reason,
            prompt_tokens=r.usage.prompt_tokens, generated_tokens=r.usage.generated_tokens,
            cached_tokens=r.usage.cached_tokens, resumed_tokens=r.usage.resumed_tokens,
            error=r.error,
        )
        if r.finish_reason in ("abort", "error"):  # its scores so far are no answer
            return out
        out.logprob = r.score
        if groups is not None:
            lps = iter(r.candidate_logprobs)
            out.word_probs = tuple(sum(math.exp(next(lps)) for _ in g) for g in groups)
        return out

    def generated_so_far(self, handle: str) -> int:
        return self.engine.num_generated(handle)

    def output_so_far(self, handle: str) -> list[int] | None:
        return self.engine.output_so_far(handle)

    def abort(self, *handles: str) -> None:
        self.engine.abort(*handles)
        for handle in handles:
            with self._lock:
                self._choices.pop(handle, None)
            try:  # drop the aborted result so that nothing accumulates in the engine
                self.engine.wait(handle, timeout=0)
            except KeyError:
                pass

    # ---- for EXPLAIN LLM -----------------------------------------------------------------

    def describe(self) -> str:
        d = self.engine.describe()
        return f"{d['model']} on {d['device']}, {d['dtype']}, {d['kernels']} kernels"

    def tokenize(self, request: ModelRequest) -> RequestTokens:
        ids = self.engine.encode_prompt(request.prompt)
        cacheable = len(ids) - 1  # the engine computes the last prompt token's logits
        if isinstance(request, ScoreRequest):
            ids = ids + self._continuation(request.continuation)
        return RequestTokens(tuple(ids), len(ids), cacheable)

    def cached_prefix(self, ids: Sequence[int]) -> int:
        return self.engine.cached_prefix_tokens(ids)

    def simulation(self) -> Simulation:
        sched, pool = self.engine.scheduler, self.engine.pool
        ttft, tbt = self.engine.rt_slos
        config = SimConfig(
            num_blocks=pool.num_blocks, block_size=pool.block_size,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_prefill_tokens=sched.max_prefill_tokens, max_num_seqs=sched.max_num_seqs,
            hidden_ratio=sched.hidden_ratio, slo_ttft_s=ttft, slo_tbt_s=tbt,
            prefix_caching=pool.enable_prefix_caching)
        return Simulation(config, sched.policy.name, self.engine.cost_model)


_backends: dict[str, LocalBackend] = {}
_backends_lock = threading.Lock()

# An engine thread still inside a step when the interpreter exits (right after Ctrl-C, say)
# aborts the process with "terminate called without an active exception": stop it first.
atexit.register(shutdown_engines)


def local_backend(model: str, **engine_options: Any) -> LocalBackend:
    """The backend over this process's shared engine for `model`."""
    engine = shared_engine(model, **engine_options)
    with _backends_lock:
        if model not in _backends or _backends[model].engine is not engine:
            _backends[model] = LocalBackend(engine)
        return _backends[model]
