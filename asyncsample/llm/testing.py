"""A small OpenAI-compatible chat-completions server on localhost, for tests and examples.

No model weights can be assumed where tests run, so :class:`ChatServer` stands in for vLLM:
real HTTP (aiohttp) on an ephemeral port, ``POST /v1/chat/completions`` answered with a reply
that is a function of the messages (deterministic), token ids and log-probabilities in vLLM's
shape when asked for, and faults injected by a rule (429s, 5xx, stalls). It counts the
requests in flight and the most seen at once, so a test can check a client's cap.

The token ids are the UTF-8 bytes of the reply (a byte-level tokenizer: ids 0-255), and each
token's log-probability is a fixed function of its id and position, so both are reproducible.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import pickle
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Self

from asyncsample.llm._extra import web

__all__ = [
    "ChatRequest",
    "ChatServer",
    "Fault",
    "LocalApp",
    "echo_reply",
    "serve_in_process",
    "token_ids",
    "token_logprobs",
]

Messages = list[dict[str, Any]]
"""A conversation: ``{"role": ..., "content": ...}`` dicts, oldest first."""


def echo_reply(messages: Messages) -> str:
    """The default reply: ``"echo: "`` and the last message's content."""
    return f"echo: {messages[-1].get('content', '') if messages else ''}"


def token_ids(text: str) -> list[int]:
    """The server's tokens of ``text``: its UTF-8 bytes."""
    return list(text.encode())


def token_logprobs(ids: list[int]) -> list[float]:
    """The server's log-probability of each of the token ``ids`` (a function of the id and its
    position, in ``(-1, 0]``)."""
    return [-(((7 * t + 13 * k) % 100) / 100.0) for k, t in enumerate(ids)]


@dataclass(frozen=True)
class ChatRequest:
    """A request as a :class:`ChatServer`'s rules see it.

    Attributes:
        messages: the conversation sent.
        body: the whole JSON body.
        attempt: how many times these messages were sent to this server so far, this one
            included (1 the first time; a client's retry is 2, 3, ...).
        number: the request's number on this server, from 0.
    """

    messages: Messages
    body: dict[str, Any]
    attempt: int
    number: int

    @property
    def prompt(self) -> str:
        """The content of the last message (``""`` if none)."""
        return str(self.messages[-1].get("content", "")) if self.messages else ""


@dataclass(frozen=True)
class Fault:
    """What a :class:`ChatServer` does instead of answering at once (a rule returns one).

    Attributes:
        status: the HTTP status to answer with; 200 answers the reply (after ``stall``).
        retry_after: seconds for a ``Retry-After`` header, if any.
        stall: seconds to wait before answering (past a client's timeout: a stalled request).
    """

    status: int = 500
    retry_after: float | None = None
    stall: float = 0.0

    @classmethod
    def throttle(cls, retry_after: float | None = None) -> Fault:
        """429 Too Many Requests, with a ``Retry-After`` of ``retry_after`` seconds if given."""
        return cls(429, retry_after)

    @classmethod
    def error(cls, status: int = 500) -> Fault:
        """A server error (500 unless said)."""
        return cls(status)

    @classmethod
    def hang(cls, seconds: float = 3600.0) -> Fault:
        """No answer for ``seconds``, then the reply."""
        return cls(200, stall=seconds)


Rule = Callable[[ChatRequest], "Fault | None"]
"""A fault rule: what to do with a request (``None``: answer it)."""


@dataclass
class _Counts:
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    attempts: collections.Counter[str] = field(default_factory=collections.Counter)


class LocalApp:
    """An aiohttp ``app`` served on localhost over real HTTP: ``async with LocalApp(app) as
    served:`` on the running loop, or ``with LocalApp(app).in_thread() as served:`` from a
    thread with its own event loop (as a separate service would run). :attr:`url` is then
    ``http://<host>:<port><path>``; port 0 takes an ephemeral one.
    """

    def __init__(
        self, app: web.Application, *, host: str = "127.0.0.1", port: int = 0, path: str = ""
    ) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.path = path
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        """``http://<host>:<port><path>`` (once started)."""
        if self._runner is None:
            raise RuntimeError(
                f"{type(self).__name__}: not started (use 'async with' or in_thread())"
            )
        return f"http://{self.host}:{self.port}{self.path}"

    async def start(self) -> str:
        """Start serving on the running loop; returns :attr:`url`."""
        runner = web.AppRunner(
            self.app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5
        )
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        return self.url

    async def close(self) -> None:
        """Stop serving (requests still being answered are cancelled)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @contextlib.contextmanager
    def in_thread(self) -> Iterator[Self]:
        """Serve from a thread with its own event loop while the block runs."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=loop.run_forever, name=f"asyncsample-{type(self).__name__}", daemon=True
        )
        thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.start(), loop).result()
            yield self
        finally:
            try:
                asyncio.run_coroutine_threadsafe(self.close(), loop).result()
            finally:
                loop.call_soon_threadsafe(loop.stop)
                thread.join()
                loop.close()


@contextlib.contextmanager
def serve_in_process(make: Callable[[], LocalApp], start_timeout: float = 60.0) -> Iterator[str]:
    """Serve the :class:`LocalApp` (or :class:`ChatServer`) that ``make()`` builds from a child
    process of its own, as a separate service runs (no share of the caller's GIL); yields its
    URL (:attr:`LocalApp.url`). ``make`` travels by cloudpickle; the server's counters stay in
    the child. The child stops when the block ends, or when this process goes."""
    import cloudpickle

    from asyncsample.backends._procs import forkserver_context, start_hidden

    ctx = forkserver_context()
    here, there = ctx.Pipe()
    process = ctx.Process(
        target=_serve_child,
        args=(cloudpickle.dumps(make), there),
        name="asyncsample-local-server",
        daemon=True,
    )
    start_hidden(process)  # (the child must not run the caller's script again)
    there.close()
    try:
        if not here.poll(start_timeout):
            raise RuntimeError(f"serve_in_process: the server did not start in {start_timeout} s")
        status, value = here.recv()
        if status != "ok":
            raise RuntimeError(f"serve_in_process: the server failed to start: {value}")
        yield str(value)
    finally:
        with contextlib.suppress(OSError):
            here.send("stop")
        process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join()
        here.close()


def _serve_child(blob: bytes, conn: Any) -> None:
    """The child of :func:`serve_in_process`."""
    asyncio.run(_serve(pickle.loads(blob), conn))


async def _serve(make: Callable[[], LocalApp], conn: Any) -> None:
    try:
        server = make()
        url = await server.start()
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", url))
    loop = asyncio.get_running_loop()
    stop: asyncio.Future[None] = loop.create_future()

    def readable() -> None:  # a message, or the parent's end (EOF)
        if not stop.done():
            stop.set_result(None)

    loop.add_reader(conn.fileno(), readable)
    try:
        await stop
    finally:
        loop.remove_reader(conn.fileno())
        await server.close()


class ChatServer(LocalApp):
    """An OpenAI-compatible chat-completions endpoint on localhost (module docstring).

    ``async with ChatServer(reply) as server:`` serves on the running loop; ``with
    ChatServer(reply).in_thread() as server:`` serves from a thread of its own (its own event
    loop), as a separate inference server would. ``server.base_url`` is then
    ``http://127.0.0.1:<port>/v1``, what :class:`~asyncsample.llm.ChatAgent` takes.

    The reply carries ``choices[0].message.content``, the ``model`` and ``usage``; with
    ``"logprobs": true`` in the request, ``choices[0].logprobs.content`` (a ``token`` and its
    ``logprob`` each, vLLM's and OpenAI's shape); with vLLM's ``"return_token_ids": true``,
    ``choices[0].token_ids`` and ``prompt_token_ids``; with vLLM's
    ``"return_tokens_as_token_ids": true``, each ``token`` is ``"token_id:<id>"``.

    Args:
        reply: the reply's text as a function of the messages (default :func:`echo_reply`).
        model: the model name the replies report.
        fault: a rule that may answer a request with a :class:`Fault` instead.
        latency: seconds each reply takes (a number, or a function of the request).
        host: the address to listen on.
        port: the port (0: an ephemeral one).

    Attributes:
        requests: requests received.
        in_flight: requests being answered now.
        max_in_flight: the most requests in flight at once so far.
        statuses: how many replies had each HTTP status.
    """

    def __init__(
        self,
        reply: Callable[[Messages], str] | None = None,
        *,
        model: str = "asyncsample/echo",
        fault: Rule | None = None,
        latency: float | Callable[[ChatRequest], float] = 0.0,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        super().__init__(app, host=host, port=port, path="/v1")
        self.reply = reply or echo_reply
        self.model = model
        self.fault = fault
        self.latency = latency
        self._counts = _Counts()
        self._lock = threading.Lock()

    # -- counters -----------------------------------------------------------------------------

    @property
    def requests(self) -> int:
        """Requests received so far."""
        return self._counts.requests

    @property
    def in_flight(self) -> int:
        """Requests being answered now."""
        return self._counts.in_flight

    @property
    def max_in_flight(self) -> int:
        """The most requests in flight at once so far."""
        return self._counts.max_in_flight

    @property
    def statuses(self) -> collections.Counter[int]:
        """How many replies had each HTTP status (a copy)."""
        with self._lock:
            return collections.Counter(self._counts.statuses)

    @property
    def base_url(self) -> str:
        """``http://<host>:<port>/v1`` (once started): what ``ChatAgent`` takes."""
        return self.url

    @contextlib.asynccontextmanager
    async def _counted(self) -> AsyncIterator[None]:
        counts = self._counts
        with self._lock:
            counts.requests += 1
            counts.in_flight += 1
            counts.max_in_flight = max(counts.max_in_flight, counts.in_flight)
        try:
            yield
        finally:
            with self._lock:
                counts.in_flight -= 1

    def _answered(self, status: int) -> None:
        with self._lock:
            self._counts.statuses[status] += 1

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        )

    async def _completions(self, request: web.Request) -> web.Response:
        async with self._counted():
            try:
                body = await request.json()
                messages = body["messages"]
                if not isinstance(messages, list) or not all(
                    isinstance(m, dict) and "role" in m for m in messages
                ):
                    raise ValueError("messages must be a list of {'role', 'content'} objects")
            except (ValueError, KeyError, TypeError) as exc:
                self._answered(400)
                return _error(400, f"bad request: {exc}")
            key = json.dumps(messages, sort_keys=True)
            with self._lock:
                self._counts.attempts[key] += 1
                attempt = self._counts.attempts[key]
                number = self._counts.requests - 1
            seen = ChatRequest(messages, body, attempt, number)
            fault = self.fault(seen) if self.fault is not None else None
            latency = self.latency(seen) if callable(self.latency) else self.latency
            if fault is not None and fault.stall:
                latency += fault.stall
            if latency > 0:
                await asyncio.sleep(latency)
            if fault is not None and fault.status != 200:
                self._answered(fault.status)
                headers = {}
                if fault.retry_after is not None:
                    headers["Retry-After"] = f"{fault.retry_after:g}"
                return _error(fault.status, "injected fault", headers)
            try:
                text = self.reply(messages)
            except Exception as exc:  # the reply function's bug: a 500 that names it
                self._answered(500)
                return _error(500, f"reply function raised {type(exc).__name__}: {exc}")
            self._answered(200)
            return web.json_response(self._completion(body, messages, text, number))

    def _completion(
        self, body: dict[str, Any], messages: Messages, text: str, number: int
    ) -> dict[str, Any]:
        ids = token_ids(text)
        prompt_ids = token_ids("".join(str(m.get("content", "")) for m in messages))
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop",
        }
        if body.get("logprobs"):
            as_ids = bool(body.get("return_tokens_as_token_ids"))
            choice["logprobs"] = {
                "content": [
                    {
                        "token": f"token_id:{t}" if as_ids else bytes([t]).decode("latin-1"),
                        "logprob": lp,
                        "bytes": [t],
                        "top_logprobs": [],
                    }
                    for t, lp in zip(ids, token_logprobs(ids))
                ]
            }
        out: dict[str, Any] = {
            "id": f"chatcmpl-{number}",
            "object": "chat.completion",
            "created": 0,
            "model": self.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt_ids) + len(ids),
            },
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
            out["prompt_token_ids"] = prompt_ids
        return out


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-style error reply."""
    kind = "rate_limit_error" if status == 429 else "server_error" if status >= 500 else "invalid"
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}},
        status=status,
        headers=headers,
    )
