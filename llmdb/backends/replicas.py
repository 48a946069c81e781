"""OpenAI-compatible endpoints as replicas of one model: which replica takes a request, how
many each takes at once, the rate limits, and what a failure means.

Everything here runs on one asyncio loop (the openai backend's thread). A request waits for
the rate limits, then for a free slot on a replica that is in rotation (the least busy one).
A replica that cannot be reached (connection refused, reset, dropped mid-answer) leaves the
rotation for a while and the request goes straight to another replica: a killed server loses
no row, and since a request counts once it is answered, none is counted twice. A replica
that fails FAILURES_OUT requests in a row (5xx, 408, timeouts) leaves the rotation too.
429, 408 and 5xx answers are retried after the server's Retry-After, else after an
exponential backoff with jitter; any other 4xx is the request's own error, never retried.
A request held by a replica that has stopped answering is sent to an idle one too, the first
answer winning (hedging.py): a hung server does not hold its rows for timeout_s.

httpx rather than the openai client: the openai client retries inside each call (on the same
endpoint, with its own backoff), which would hide a dead replica from the failover above, and
scoring needs endpoints outside the OpenAI API (vLLM's /tokenize, prompt_logprobs).
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import logging
import math
import random
import ssl
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from aiolimiter import AsyncLimiter

from .endpoints import base_url, route_url
from .hedging import StallRule
from .openai_answers import MalformedAnswer, usage

log = logging.getLogger(__name__)
T = TypeVar("T")

# A connection that fails like this means the replica is gone, not that the request is bad.
_UNREACHABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                httpx.ReadError, httpx.WriteError)
# A request lost with its replica's connection, or not answered in time.
_LOST = (*_UNREACHABLE, httpx.TimeoutException, TimeoutError)
# A replica that fails this many requests in a row (5xx, 408, no answer in time) leaves the
# rotation as an unreachable one does: a server whose engine died answers 500 to everything,
# and each row sent there paid a backoff before going elsewhere.
FAILURES_OUT = 3
# The most of an answer read (decoded): far above any answer's size (prompt_logprobs of a
# 100k-token prompt are about 10 MB), so that a broken server's endless body fails its
# row instead of filling memory, or becoming the row's answer.
MAX_ANSWER_BYTES = 64 << 20


class EndpointError(Exception):
    """A request that did not succeed: its row's error (the message names the endpoint)."""


@dataclass
class ReplicaLimits:
    max_concurrency: int = 16  # requests in flight per replica
    requests_per_minute: float | None = None  # for all replicas together (a key's quota)
    tokens_per_minute: float | None = None  # estimated prompt + max_tokens, all replicas
    timeout_s: float = 300.0  # per attempt, whole: a long generation on a busy server is slow
    max_retries: int = 6  # attempts after the first, for 429, 5xx, timeouts, all replicas down
    backoff_s: float = 0.5  # first backoff; doubles each retry
    max_backoff_s: float = 30.0
    max_retry_after_s: float = 300.0  # a Retry-After beyond this is cut to it
    down_s: float = 30.0  # how long an unreachable replica stays out of rotation
    # A request held by a replica that has answered nothing for stall_factor x the slowest
    # recent answer (scaled up to the request's max_tokens), and at least stall_s, is sent
    # to an idle replica too (hedging.py); None: never, a hung replica holds its requests
    # for timeout_s.
    stall_s: float | None = 10.0
    stall_factor: float = 3.0

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.stall_s is not None and self.stall_s <= 0:
            raise ValueError(f"stall_s must be positive (None: no hedged requests), got "
                             f"{self.stall_s}")
        if self.stall_factor < 1:
            raise ValueError(f"stall_factor must be >= 1, got {self.stall_factor}")


class Replica:
    def __init__(self, url: str, limits: ReplicaLimits):
        self.url = base_url(url)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(limits.timeout_s, connect=min(10.0, limits.timeout_s)),
            limits=httpx.Limits(max_connections=limits.max_concurrency))
        self.in_flight = 0
        self.down_until = 0.0
        self.down_cause = ""  # why it last left the rotation
        self.answered: Counter[str] = Counter()  # URL path -> requests it answered with 200
        self.dispatched = 0
        self.unreachable = 0  # requests lost here with the connection (and sent elsewhere)
        self.failures = 0  # requests failed in a row (5xx, 408, timeouts, stalls)
        self.last_answer = 0.0  # when it last answered a request (time.monotonic())

    def up(self, now: float) -> bool:
        return self.down_until <= now


class _PriorityTurn:
    """A turn that one holder has at a time, handed to the longest-waiting interactive
    taker before any bulk one. asyncio's locks and aiolimiter's bucket wake waiters in
    arrival order; this puts a query's request ahead of a bulk job's queued rows."""

    def __init__(self) -> None:
        self._held = False
        self._waiting: dict[bool, deque[asyncio.Future]] = {True: deque(), False: deque()}

    async def acquire(self, interactive: bool) -> None:
        if not self._held:
            self._held = True
            return
        turn = asyncio.get_running_loop().create_future()
        queue = self._waiting[interactive]
        queue.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()  # handed over as the taker was cancelled: pass it on
            elif turn in queue:
                queue.remove(turn)
            raise

    def release(self) -> None:
        for queue in (self._waiting[True], self._waiting[False]):
            while queue:
                turn = queue.popleft()
                if not turn.done():  # (a cancelled taker's turn is done)
                    turn.set_result(None)
                    return
        self._held = False


class _Limiter:
    """Requests or tokens per minute as a leaky bucket holding one second's worth (or one
    unit), so that a minute's budget is never spent in one burst. One taker at a time
    waits on the bucket, interactive ones first; a large take goes in bucket-sized parts,
    each a turn of its own, so an interactive taker gets in between a bulk one's parts."""

    def __init__(self, per_minute: float):
        window = max(1.0, 60.0 / per_minute)
        self.bucket = AsyncLimiter(per_minute * window / 60.0, window)
        self._turn = _PriorityTurn()

    async def take(self, amount: float, interactive: bool = False) -> None:
        while amount > 0:
            part = min(amount, self.bucket.max_rate)
            await self._turn.acquire(interactive)
            try:
                await self.bucket.acquire(part)
            finally:
                self._turn.release()
            amount -= part


def _certificate_refused(e: BaseException | None) -> bool:
    """Whether a connection failed on the server's certificate (httpx's ConnectError is
    raised from httpcore's, raised from ssl's)."""
    while e is not None:
        if isinstance(e, ssl.SSLCertVerificationError):
            return True
        e = e.__cause__ or e.__context__
    return False


class _TooLong(Exception):
    """An answer longer than MAX_ANSWER_BYTES."""


class _Lost(Exception):
    """A copy of a request lost with its replica's connection, or not answered in time: the
    cause in words, the replica's bookkeeping done (ReplicaPool._lost)."""

    def __init__(self, cause: str, error: BaseException):
        super().__init__(cause)
        self.cause, self.error = cause, error


async def _exchange(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                    key: str | None) -> httpx.Response:
    """POST body to url, with the API key; the answer read whole, up to MAX_ANSWER_BYTES."""
    headers = {"Authorization": f"Bearer {key}"} if key else None
    request = client.build_request("POST", url, json=body, headers=headers)
    response = await client.send(request, stream=True)
    chunks, size = [], 0
    try:
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > MAX_ANSWER_BYTES:
                raise _TooLong
            chunks.append(chunk)
    finally:
        await response.aclose()
    # The body is decoded already: the copy must not decode it again.
    headers = [(k, v) for k, v in response.headers.multi_items() if k != "content-encoding"]
    return httpx.Response(response.status_code, headers=headers, content=b"".join(chunks),
                          request=request)


def retry_after(response: httpx.Response) -> float | None:
    """Seconds the server asked us to wait (Retry-After as seconds or a date, or OpenAI's
    retry-after-ms), or None."""
    ms = response.headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):  # neither seconds nor a date: as if it were absent
        return None
    return max(0.0, when.timestamp() - time.time())


def _message(response: httpx.Response) -> str:
    """The error text of an answer in OpenAI's shape, else the start of the body."""
    if response.is_redirect:  # (not followed: a POST's body and key would go on elsewhere)
        return (f"a redirect to {response.headers.get('location')}; give the URL it "
                "redirects to as the endpoint")
    try:
        err = response.json().get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    except (ValueError, AttributeError):
        pass
    return response.text[:200] or response.reason_phrase


def _max_tokens(body: dict[str, Any]) -> int:
    """The most tokens a request asks the server to generate (0: none, /tokenize)."""
    n = body.get("max_tokens")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def _generated(data: Any, body: dict[str, Any]) -> int:
    """The tokens an answer generated: its usage's, else the most it was asked for."""
    return (usage(data)[1] if isinstance(data, dict) else 0) or _max_tokens(body)


def _retried(response: httpx.Response) -> bool:
    """Whether an error answer may go otherwise when asked again: 408, 429 and 5xx, except
    OpenAI's 429 for a spent quota or budget (insufficient_quota), which no wait mends."""
    if response.status_code == 429:
        try:
            err = response.json().get("error")
            return not (isinstance(err, dict) and "insufficient_quota" in
                        (err.get("code"), err.get("type")))
        except (ValueError, AttributeError):
            return True
    return response.status_code == 408 or response.status_code >= 500


class ReplicaPool:
    def __init__(self, urls: list[str], limits: ReplicaLimits,
                 api_key: Callable[[], str] | None = None):
        """api_key reads the API key, sent as `Authorization: Bearer KEY`: once here, and
        again after a 401, so that a key rotated where it comes from (the environment) is
        taken without a restart. Every key read is cut out of every error text (a server
        may quote what it was sent)."""
        if not urls:
            raise ValueError("the openai backend needs at least one endpoint URL")
        self.limits = limits
        self._read_key = api_key
        self._key = api_key() if api_key else None
        self._keys_read = {self._key} if self._key else set()
        self.replicas = [Replica(u, limits) for u in urls]
        self._changed = asyncio.Condition()
        self._rpm = _Limiter(limits.requests_per_minute) if limits.requests_per_minute else None
        self._tpm = _Limiter(limits.tokens_per_minute) if limits.tokens_per_minute else None
        self._rt_waiting = 0  # interactive requests waiting for a slot: bulk ones let them by
        self._waiting = 0  # requests waiting for a slot: no hedged copy takes one from them
        self._stall = StallRule(limits.stall_s, limits.stall_factor) \
            if limits.stall_s is not None else None

    async def post(self, path: str, body: dict[str, Any], tokens: int = 0,
                   priority: str = "BE", read: Callable[[Any], T] = lambda data: data) -> T:
        """What `read` makes of the JSON answer of the first replica that gives one to `path`
        (an API route such as /chat/completions, or a server route: endpoints.route_url); a
        MalformedAnswer from it is the request's error, naming that replica; EndpointError
        otherwise.
        An RT (interactive) request takes the rate limits' next turn and the next free slot
        before any waiting BE (bulk) one, so a query beside a bulk job does not queue behind
        its rows."""
        retries = 0
        causes: dict[Replica, str] = {}  # what this request last met at each replica
        interactive = priority == "RT"
        while True:
            await self._take_budget(tokens, interactive)
            replica = await self._acquire(interactive)
            key = self._key
            replica, answer = await self._answer(replica, path, body, key, tokens, interactive)
            url = route_url(replica.url, path)
            response = None
            if isinstance(answer, _Lost):
                last = causes[replica] = answer.cause
                if isinstance(answer.error, _UNREACHABLE):
                    if any(r.up(time.monotonic()) for r in self.replicas):
                        continue  # others are up: resubmit there at once, no retry spent
                    if _certificate_refused(answer.error):  # (no retry mends that)
                        raise self._failed(causes) from None
            elif isinstance(answer, httpx.HTTPError):  # (an answer the client cannot read)
                raise EndpointError(self._redact(
                    f"{url} failed: {type(answer).__name__}: {answer}")) from None
            elif isinstance(answer, _TooLong):
                raise EndpointError(f"{url} answered with more than "
                                    f"{MAX_ANSWER_BYTES:,} bytes") from None
            elif isinstance(answer, BaseException):
                raise answer
            else:
                response = answer
                if response.status_code == 401 and self._key_rotated(key):
                    continue  # (sent again at once, with the new key: no retry spent)
                if response.status_code == 200:
                    replica.answered[httpx.URL(url).path] += 1
                    try:
                        data = response.json()
                    except ValueError:
                        raise EndpointError(self._redact(
                            f"{url} answered with invalid JSON: "
                            f"{response.text[:100]!r}")) from None
                    if self._stall is not None:
                        self._stall.observe(path, response.elapsed.total_seconds(),
                                            _generated(data, body))
                    try:
                        return read(data)
                    except MalformedAnswer as e:
                        raise EndpointError(self._redact(
                            f"{url} answered {e}: {str(data)[:200]}")) from None
                last = causes[replica] = self._redact(
                    f"{url} answered {response.status_code}: {_message(response)}")
                if not _retried(response):
                    raise EndpointError(last)
            if retries >= self.limits.max_retries:
                raise self._failed(causes, f" (gave up after {retries + 1} attempts)")
            wait = retry_after(response) if response is not None else None
            if wait is None:
                wait = min(self.limits.max_backoff_s, self.limits.backoff_s * 2 ** retries)
                wait *= random.uniform(0.5, 1.0)  # spread out the retries of many rows
            retries += 1
            await asyncio.sleep(min(wait, self.limits.max_retry_after_s))

    async def _take_budget(self, tokens: int, interactive: bool) -> None:
        if self._rpm is not None:
            await self._rpm.take(1, interactive)
        if self._tpm is not None:
            await self._tpm.take(tokens, interactive)

    async def _send(self, replica: Replica, path: str, body: dict[str, Any], key: str | None,
                    hedge_tokens: int | None = None, interactive: bool = False
                    ) -> httpx.Response:
        """One copy of a request on a replica whose slot it holds (released here). A hedged
        copy (hedge_tokens: the request's estimate) takes its rate-limit budget first: the
        provider counts it too."""
        url = route_url(replica.url, path)
        # What the answer says of the replica is noted before its slot is free: a failing
        # replica gets no new row meanwhile.
        try:
            if hedge_tokens is not None:
                await self._take_budget(hedge_tokens, interactive)
            sent = time.monotonic()
            # The whole exchange, not only each read (httpx's timeout): an answer that
            # trickles in never timed out.
            async with asyncio.timeout(self.limits.timeout_s):
                response = await _exchange(replica.client, url, body, key)
            replica.last_answer = time.monotonic()
            response.elapsed = datetime.timedelta(seconds=replica.last_answer - sent)
            status = response.status_code
            if status == 408 or status >= 500:
                await self._count_failure(replica, self._redact(
                    f"{url} answered {status}: {_message(response)}"))
            elif status != 429:  # (rate limited: the replica works)
                replica.failures = 0
            return response
        except _LOST as e:
            raise _Lost(await self._lost(replica, e), e) from None
        finally:
            await self._release(replica)

    async def _answer(self, first: Replica, path: str, body: dict[str, Any], key: str | None,
                      tokens: int, interactive: bool
                      ) -> tuple[Replica, httpx.Response | BaseException]:
        """The first answer to the request from `first` (whose slot it holds), or, once that
        replica has stalled, from the copy sent to another (hedging.py): that replica and
        its response, or what failed there. A copy whose connection fails while the other
        runs is noted, and the other awaited."""
        sent = time.monotonic()
        asked = _max_tokens(body)
        copies = {asyncio.ensure_future(self._send(first, path, body, key)): first}
        hedged = False
        try:
            while True:
                wait = None if hedged or self._stall is None else \
                    self._until_stalled(first, sent, path, asked)
                done, _ = await asyncio.wait(copies, timeout=wait,
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    replica = copies.pop(task)
                    error = task.exception()
                    if copies and isinstance(error, _Lost):
                        continue
                    if copies and replica is not first:  # the copy won: first had stalled
                        await self._count_failure(first, f"{first.url} answered nothing in "
                                                         f"{time.monotonic() - sent:.1f} s")
                    return replica, task.result() if error is None else error
                if not hedged and not done and \
                        self._until_stalled(first, sent, path, asked) == 0:
                    other = self._hedge_to(first, path)
                    if other is not None:
                        log.info("%s answered nothing for %.1f s: the request is sent to %s "
                                 "too", first.url, time.monotonic() - sent, other.url)
                        copies[asyncio.ensure_future(self._send(
                            other, path, body, key, tokens, interactive))] = other
                        hedged = True
        finally:
            for task in copies:  # (the copy that lost)
                task.cancel()
            await asyncio.gather(*copies, return_exceptions=True)

    def _until_stalled(self, replica: Replica, sent: float, path: str, asked: int) -> float:
        """Seconds until the replica has answered nothing for the stall time of a request
        asking `asked` tokens since it was sent; once it has, 0 if a copy may go now
        (hedging.py), else a while before looking again."""
        stall = self._stall.stall_s(path, asked) if self._stall is not None else math.inf
        quiet = time.monotonic() - max(sent, replica.last_answer)
        if quiet < stall:
            return stall - quiet
        return 0.0 if self._hedge_to(replica, path, reserve=False) else min(1.0, stall / 4)

    def _hedge_to(self, stalled: Replica, path: str, reserve: bool = True) -> Replica | None:
        """A replica that takes a copy of a request held by a stalled one at no row's
        expense (its slot reserved): in rotation, not stalled, with a free slot, while no
        request waits for one."""
        if self._waiting or self._stall is None:
            return None
        now = time.monotonic()
        stall = self._stall.stall_s(path)
        idle = [r for r in self.replicas if r is not stalled and r.up(now)
                and r.in_flight < self.limits.max_concurrency
                and (r.in_flight == 0 or now - r.last_answer < stall)]
        if not idle:
            return None
        r = min(idle, key=lambda r: (r.in_flight, r.dispatched))
        if reserve:
            r.in_flight += 1
            r.dispatched += 1
        return r

    async def _lost(self, replica: Replica, error: BaseException) -> str:
        """What a lost connection or a timeout means for a replica, and its cause in words:
        unreachable, it leaves the rotation; timed out, it failed once more."""
        if isinstance(error, _UNREACHABLE):
            cause = f"{replica.url} is unreachable ({type(error).__name__}: {error})"
            if _certificate_refused(error):
                cause += (" (its certificate failed verification: for a private CA, set "
                          "SSL_CERT_FILE to its certificate)")
            replica.unreachable += 1
            await self._take_out(replica, cause)
            return cause
        cause = f"{replica.url} did not answer in {self.limits.timeout_s:g} s " \
                f"({type(error).__name__})"
        await self._count_failure(replica, cause)
        return cause

    async def _count_failure(self, replica: Replica, cause: str) -> None:
        replica.failures += 1
        if replica.failures >= FAILURES_OUT:
            await self._take_out(replica, f"{replica.failures} requests failed in a row, "
                                          f"the last: {cause}")

    def _failed(self, causes: dict[Replica, str], tail: str = "") -> EndpointError:
        """A request's error once it gives up: with several replicas, each one and what
        this request met there, or why it was not tried (the last cause alone hid a dead
        server behind an overloaded one)."""
        if len(self.replicas) == 1:
            return EndpointError(causes[self.replicas[0]] + tail)
        now = time.monotonic()
        each = [causes.get(r) or (f"{r.url} was not tried" if r.up(now) else
                                  f"{r.url} is out of rotation: {r.down_cause}")
                for r in self.replicas]
        return EndpointError(f"no endpoint answered{tail}: {'; '.join(each)}")

    def _key_rotated(self, sent: str | None) -> bool:
        """After a 401: whether the key read now differs from the one sent (it is sent from
        now on). A 401 with an unchanged key, or none to read, is the row's error."""
        if self._read_key is None:
            return False
        try:
            self._key = self._read_key()
        except ValueError:  # (unset or unusable now: the key sent stays)
            return False
        self._keys_read.add(self._key)
        return self._key != sent

    def _redact(self, text: str) -> str:
        for key in self._keys_read:
            text = text.replace(key, "***")
        return text

    async def _acquire(self, interactive: bool) -> Replica:
        """The least busy replica in rotation with a free slot (waiting for one; a bulk
        request also while an interactive one waits). With none in rotation, all are tried
        again."""
        async with self._changed:
            self._rt_waiting += interactive
            self._waiting += 1
            try:
                while True:
                    now = time.monotonic()
                    up = [r for r in self.replicas if r.up(now)]
                    candidates = up or self.replicas
                    free = [r for r in candidates if r.in_flight < self.limits.max_concurrency]
                    if free and (interactive or not self._rt_waiting):
                        r = min(free, key=lambda r: (r.in_flight, r.dispatched))
                        r.in_flight += 1
                        r.dispatched += 1
                        return r
                    back = [r.down_until - now for r in self.replicas if not r.up(now)]
                    try:  # a replica coming back into rotation frees slots too
                        await asyncio.wait_for(self._changed.wait(),
                                               timeout=min(back) if back and up else None)
                    except TimeoutError:
                        pass
            finally:
                self._rt_waiting -= interactive
                self._waiting -= 1
                if interactive:
                    self._changed.notify_all()  # bulk requests may go again

    async def _release(self, replica: Replica) -> None:
        async with self._changed:
            replica.in_flight -= 1
            self._changed.notify_all()

    async def _take_out(self, replica: Replica, why: str) -> None:
        async with self._changed:
            if replica.up(time.monotonic()):
                log.warning("taking %s out of rotation for %.0f s: %s", replica.url,
                            self.limits.down_s, why)
            replica.down_until = time.monotonic() + self.limits.down_s
            replica.down_cause = why
            self._changed.notify_all()

    async def aclose(self) -> None:
        for r in self.replicas:
            await r.client.aclose()
