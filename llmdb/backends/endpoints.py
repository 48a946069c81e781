"""Endpoint URLs, checked where they come in (the registry, a connection's options).

An endpoint is an OpenAI base URL, taken as the openai client takes its base_url: requests go
to BASE/chat/completions and BASE/completions. A URL with a path is used as given (.../v1,
Gemini's .../v1beta/openai, a proxy's prefix); only a bare host (http://gpu1:8000) gets /v1,
where every OpenAI-compatible server (vLLM, llmdb serve, Ollama) serves the API. vLLM's own
routes outside the OpenAI API (/tokenize) are at its server's root, beside the /v1.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlparse

# Paths of the API itself, which a base URL goes before: one given with them was posted to
# .../v1/chat/completions/v1/chat/completions, a 404 for every row.
_API_PATHS = ("/chat/completions", "/completions", "/models", "/tokenize")
# vLLM's routes at the server's root rather than under the API's base URL (llmdb serve has
# them there too).
SERVER_ROUTES = ("/tokenize",)


def base_url(url: str) -> str:
    """The OpenAI base URL of an endpoint: as given, without a trailing /; a bare host's
    with /v1."""
    url = url.strip()
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"endpoint {url!r} is not an http(s) URL")
    if parsed.username or parsed.password:
        raise ValueError("put no credentials in an endpoint URL (it is part of cache keys "
                         "and messages); name the variable that holds the API key instead")
    if parsed.query or parsed.fragment or parsed.params:
        raise ValueError(f"endpoint {url!r}: give the base URL without a ?query, ;params or "
                         "#fragment (requests are sent to paths under it)")
    try:
        parsed.port  # noqa: B018 - raises on a port out of range
    except ValueError as e:
        raise ValueError(f"endpoint {url!r}: {e}") from None
    path = parsed.path.rstrip("/")
    if path.endswith(_API_PATHS):
        raise ValueError(f"endpoint {url!r} is an API path; give the base URL it starts "
                         f"with (such as http://host:8000/v1)")
    return url.rstrip("/") + ("" if path else "/v1")


def server_root(base: str) -> str:
    """The server a base URL belongs to: without its /v1 (a base URL that does not end in
    /v1 is its own root)."""
    return base.removesuffix("/v1")


def route_url(base: str, route: str) -> str:
    """The URL of an API route (/chat/completions) or a server route (/tokenize)."""
    return (server_root(base) if route in SERVER_ROUTES else base) + route


def base_urls(urls: Sequence[str]) -> list[str]:
    """Each endpoint's base URL, refusing one given twice (as http://h/v1 and http://h, say):
    it would be two replicas, each taking max_concurrency requests, of one server."""
    bases = [base_url(u) for u in urls]
    for i, base in enumerate(bases):
        if base in bases[:i]:
            raise ValueError(f"endpoint {urls[i]!r} is given twice (as {base})")
    return bases
