"""Starting the server: authentication rules, the engine, uvicorn."""

from __future__ import annotations

import ipaddress
import logging
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


def listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address of host, as uvicorn would open them. Opened
    before the model loads, so that a taken port fails at once, not after the load, and is
    this server's during it (a socket only bound, not listening, could still be taken by
    another server that reuses addresses, as uvicorn does)."""
    where = _address(host, port)
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot serve on {where}: {e.strerror}") from e
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # (its IPv4 twin, if any, is an address of its own)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen()
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise ValueError(f"cannot serve on {where}: {e.strerror}") from e
    return sockets


def serve(model: str, host: str, port: int, api_key: str | None, limits: Limits,
          shutdown_timeout_s: float, **engine_options) -> None:
    from llmdb.engine.engine import LLMEngine

    sockets = listen(host, port)
    try:
        engine = LLMEngine(model, **engine_options)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    app = create_app(engine, model, api_key, limits, shutdown_timeout_s)
    server = uvicorn_server(app, host, port)
    # (uvicorn names the address it serves on only when it opens the sockets itself)
    logging.getLogger("uvicorn.error").info(
        "llmdb serve: %s on http://%s (Ctrl-C to stop)", model,
        _address(*sockets[0].getsockname()[:2]))
    server.run(sockets=sockets)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
