"""Starting the server: authentication rules, the engine, uvicorn."""

from __future__ import annotations

import ipaddress
import os
import socket

from .app import Limits, create_app


def is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False


def api_key_for(host: str, api_key_env: str, no_auth: bool) -> str | None:
    """The key clients must send, from the environment (never the command line, where other
    users of the machine could read it). Serving without one is allowed on loopback only."""
    if no_auth:
        if not is_loopback(host):
            raise ValueError(f"--no-auth serves without an API key, which is allowed on a "
                             f"loopback address only, not {host!r}")
        return None
    key = os.environ.get(api_key_env)
    if not key:
        raise ValueError(f"set the API key clients must send in the environment variable "
                         f"{api_key_env} (or serve on 127.0.0.1 with --no-auth)")
    return key


def uvicorn_server(app, host: str, port: int, log_level: str = "info"):
    """A uvicorn server that drains the app's requests (app.state.drain) when asked to stop,
    before it closes connections: uvicorn alone would wait for them with no way to abort."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            await app.state.drain()
            await super().shutdown(sockets)

    return _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))


def serve(model: str, host: str, port: int, api_key: str | None, limits: Limits,
          shutdown_timeout_s: float, **engine_options) -> None:
    from llmdb.engine.engine import LLMEngine

    engine = LLMEngine(model, **engine_options)
    app = create_app(engine, model, api_key, limits, shutdown_timeout_s)
    uvicorn_server(app, host, port).run()
