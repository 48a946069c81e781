"""Endpoint URLs, checked where they come in (the registry, a connection's options)."""

from __future__ import annotations

from urllib.parse import urlparse


def base_url(url: str) -> str:
    """The server's root: endpoints are given as OpenAI base URLs (.../v1) or roots."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"endpoint {url!r} is not an http(s) URL")
    if parsed.username or parsed.password:
        raise ValueError("put no credentials in an endpoint URL (it is part of cache keys "
                         "and messages); name the variable that holds the API key instead")
    return url.rstrip("/").removesuffix("/v1")
