"""Reading an OpenAI-compatible server's answers: each function takes the JSON of a 200 answer
and returns what the openai backend needs from it, or raises MalformedAnswer saying what is
wrong. The replica pool turns that into the row's error, naming the replica and the path that
answered (a misconfigured proxy, a server of another API, a truncated answer), where reading
on would make an empty answer out of a missing message or fail the whole query on a count
that is not a number."""

from __future__ import annotations

import math
from typing import Any


class MalformedAnswer(ValueError):
    """A 200 answer without what its request asks for, in words ("without choices")."""


def first_choice(data: Any) -> dict[str, Any]:
    """The first choice of a (chat) completion."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices:
        raise MalformedAnswer("without choices")
    if not isinstance(choices[0], dict):
        raise MalformedAnswer("with a choice that is not an object")
    return choices[0]


def chat_text(choice: dict[str, Any]) -> str:
    """The answer's text; a message without content (a reasoning model that spent max_tokens
    thinking) is an empty answer."""
    message = choice.get("message")
    if not isinstance(message, dict):
        raise MalformedAnswer("a choice without a message (is it a chat completions API?)")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise MalformedAnswer(f"a message whose content is a {type(content).__name__}, "
                              "not text")
    return content or ""


def text(choice: dict[str, Any]) -> str:
    """A (text) completion's answer."""
    value = choice.get("text")
    if not isinstance(value, str):
        raise MalformedAnswer("a choice without text (is it a completions API?)")
    return value


def usage(data: dict[str, Any]) -> tuple[int, int, int]:
    """Prompt, completion and prefix-cached prompt tokens; 0 for a count the server does not
    give (usage is reported, not relied on)."""
    u = data.get("usage")
    u = u if isinstance(u, dict) else {}
    details = u.get("prompt_tokens_details")
    details = details if isinstance(details, dict) else {}
    return (_count(u.get("prompt_tokens")), _count(u.get("completion_tokens")),
            _count(details.get("cached_tokens")))


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def first_token_top_logprobs(choice: dict[str, Any]) -> dict[str, float] | None:
    """token -> probability among the answer's first token's top_logprobs; None where the
    server sent no logprobs (not every endpoint can)."""
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not content:
        return None
    if not isinstance(content, list) or not isinstance(content[0], dict):
        raise MalformedAnswer("logprobs whose content is not a list of tokens")
    top = content[0].get("top_logprobs")
    if not top:
        return None
    if not isinstance(top, list):
        raise MalformedAnswer("top_logprobs that are not a list")
    probs = {}
    for t in top:
        if not (isinstance(t, dict) and isinstance(t.get("token"), str)
                and _is_logprob(t.get("logprob"))):
            raise MalformedAnswer(f"a top_logprobs entry that is not a token and its "
                                  f"logprob: {str(t)[:80]}")
        probs[t["token"]] = math.exp(min(t["logprob"], 0.0))
    return probs


def prompt_logprobs(data: Any, ids: list[int]) -> list[float] | None:
    """Each prompt token's log-probability after the ones before it (the first's is 0), from
    vLLM's prompt_logprobs; None where the server sent none."""
    rows = first_choice(data).get("prompt_logprobs")
    if rows is None:
        return None
    if not isinstance(rows, list) or len(rows) != len(ids):
        raise MalformedAnswer(f"prompt_logprobs that are not one per prompt token "
                              f"({len(ids)})")
    out = [0.0]
    for i in range(1, len(ids)):
        entry = rows[i].get(str(ids[i])) if isinstance(rows[i], dict) else None
        lp = entry.get("logprob") if isinstance(entry, dict) else None
        if not _is_logprob(lp):
            raise MalformedAnswer(f"prompt_logprobs without the logprob of prompt token {i} "
                                  f"(id {ids[i]})")
        out.append(lp)
    return out


def tokens(data: Any) -> list[int]:
    """The token ids of vLLM's /tokenize answer."""
    ids = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise MalformedAnswer("without tokens (a list of token ids)")
    return ids


def _is_logprob(value: Any) -> bool:
    """A number <= 0, or a rounding error above it (exp() of a large one overflowed)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and \
        not math.isnan(value) and value <= 1e-3
