"""Endpoint URLs, checked where they come in (the registry, a connection's options)."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlparse

# Paths of the API itself, which a base URL goes before: one given with them was posted to
# .../v1/chat/completions/v1/chat/completions, a 404 for every row.
_API_PATHS = ("/chat/completions", "/completions", "/models", "/tokenize")


def base_url(url: str) -> str:
    """The server's root: endpoints are given as OpenAI base URLs (.../v1) or roots."""
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
    return url.rstrip("/").removesuffix("/v1")


def base_urls(urls: Sequence[str]) -> list[str]:
    """Each endpoint's root, refusing one given twice (as http://h/v1 and http://h, say):
    it would be two replicas, each taking max_concurrency requests, of one server."""
    roots = [base_url(u) for u in urls]
    for i, root in enumerate(roots):
        if root in roots[:i]:
            raise ValueError(f"endpoint {urls[i]!r} is given twice (as {root})")
    return roots
