""":class:`ChatAgent`: an async agent for an OpenAI-compatible chat-completions endpoint (vLLM,
SGLang, hosted APIs), one request per env, a cap on requests in flight, retries with backoff,
and a timeout per request whose expiry fails that env's row alone
(:class:`~asyncsample.AgentRowsError`).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncsample import _validate
from asyncsample.columns import text_array
from asyncsample.errors import AgentRowsError, ChatRequestError, ChatTimeoutError
from asyncsample.llm._extra import aiohttp

__all__ = ["ChatAgent", "ChatReply", "parse_completion"]

#: Statuses retried with backoff: rate limited, and the server's own errors.
RETRIED = frozenset({429, 500, 502, 503, 504})
#: Statuses that fail the whole call at once: no retry and no env rebuild can fix them.
FATAL = frozenset({401, 403, 404})
#: Fields the agent sets itself (refused among ``request_fields``).
_OWN_FIELDS = ("model", "messages", "stream", "n")
#: The most characters of an error reply's body kept in its :class:`ChatRequestError`.
BODY_CHARS = 500


@dataclass(frozen=True)
class ChatReply:
    """One parsed chat completion.

    Attributes:
        text: the reply's ``choices[0].message.content`` (``""`` when null).
        model: the model the server reported.
        token_ids: the reply's token ids, if the server returned them.
        logprobs: each reply token's log-probability, if the server returned them.
    """

    text: str
    model: str
    token_ids: np.ndarray | None = None
    logprobs: np.ndarray | None = None


def parse_completion(data: Any) -> ChatReply:
    """A :class:`ChatReply` from a chat-completion JSON object; ``ValueError`` if it is not one.

    Token ids are read from, in order: ``choices[0].token_ids`` (vLLM's ``return_token_ids``),
    the ``token_id`` of each ``logprobs.content`` entry (SGLang), or its ``token`` written as
    ``"token_id:<id>"`` (vLLM's ``return_tokens_as_token_ids``). Log-probabilities from each
    ``logprobs.content`` entry's ``logprob`` (OpenAI's shape, which vLLM and SGLang follow).
    """
    try:
        choice = data["choices"][0]
        content = choice["message"].get("content")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise ValueError(
            f"not a chat completion (no choices[0].message): {json.dumps(data)[:BODY_CHARS]}"
        ) from None
    text = "" if content is None else str(content)
    model = str(data.get("model") or "")
    entries = (choice.get("logprobs") or {}).get("content") or None
    logprobs = None
    ids: list[int] | None = choice.get("token_ids")
    if entries is not None:
        logprobs = np.array([float(e["logprob"]) for e in entries], dtype=np.float32)
        if ids is None:
            ids = _entry_ids(entries)
    token_ids = None if ids is None else np.asarray(ids, dtype=np.int64).reshape(-1)
    return ChatReply(text, model, token_ids, logprobs)


def _entry_ids(entries: list[dict[str, Any]]) -> list[int] | None:
    """The token ids of ``logprobs.content`` entries, where each carries one."""
    ids: list[int] = []
    for e in entries:
        if "token_id" in e:
            ids.append(int(e["token_id"]))
            continue
        token = e.get("token")
        if isinstance(token, str) and token.startswith("token_id:"):
            ids.append(int(token[len("token_id:") :]))
            continue
        return None
    return ids


class ChatAgent:
    """An async agent that asks an OpenAI-compatible ``POST {base_url}/chat/completions``.

    ``get_actions`` sends one request per row (env) and returns the replies' texts as actions
    (a text column) and agent infos: ``model`` (what the server reported, per row), and, when
    the server returns them, ``token_ids`` and ``logprobs`` (one array per row, recorded as
    ragged columns). A string observation becomes one user message; a list of
    ``{"role", "content"}`` dicts is sent as the conversation (override :meth:`messages` for
    other observations).

    At most ``max_in_flight`` requests are in flight at once (one cap for every call the agent
    serves); a 429 or 5xx reply, or a failed connection, is retried up to ``retries`` times
    with exponential backoff and jitter, after ``Retry-After`` when the server sends one. A
    request that gets no whole reply within ``timeout`` seconds, or fails after its retries,
    fails its row alone: the call raises :class:`~asyncsample.AgentRowsError` with the other
    rows' replies, and the sampler drops that env's episode and rebuilds the env (as for an env
    fault, within ``max_restarts``). A 401, 403 or 404 (wrong key, URL or model) fails the
    whole call with :class:`~asyncsample.ChatRequestError`.

    On the lanes (async envs, ``backend="thread"``) each env's request is a call of its own
    (:attr:`merge_rows` is false), so no env waits for another's reply. The agent version of
    the batch stays the sampler's count of updates; the server's model name is an agent info.
    Close it with ``await agent.aclose()`` or ``async with``. It pickles without its
    connections (``inference="host"`` with async envs: each env host has its own cap).

    Args:
        base_url: the API's base, e.g. ``http://localhost:8000/v1`` for ``vllm serve``.
        model: the model name sent in every request.
        max_in_flight: the most requests in flight at once.
        timeout: seconds one attempt may take, from sending it to the whole reply (the wait
            for a free slot under ``max_in_flight`` does not count).
        retries: how many times a 429, a 5xx or a failed connection is retried.
        api_key: sent as ``Authorization: Bearer <api_key>`` if given.
        **request_fields: more JSON fields of every request, e.g. ``temperature=0.7``,
            ``max_tokens=256``, ``logprobs=True``, vLLM's ``return_token_ids=True``.
    """

    merge_rows = False
    """Each env's row is a call of its own on the lanes (none waits for another's reply)."""

    #: Backoff before retry ``k`` (from 0): ``min(BACKOFF_MAX, BACKOFF_BASE * 2**k)`` seconds,
    #: times a jitter drawn uniformly from [0.5, 1].
    BACKOFF_BASE = 0.25
    BACKOFF_MAX = 8.0

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        max_in_flight: int = 64,
        timeout: float = 60.0,
        retries: int = 3,
        api_key: str | None = None,
        **request_fields: Any,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"base_url must be an http:// or https:// URL such as "
                f"'http://localhost:8000/v1', got {base_url!r}"
            )
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty str, got {model!r}")
        max_in_flight = _validate.positive_int("max_in_flight", max_in_flight)
        timeout = _validate.seconds("timeout", timeout)
        retries = _validate.nonnegative_int("retries", retries)
        _validate.optional_str("api_key", api_key)
        own = [k for k in _OWN_FIELDS if k in request_fields]
        if own:
            raise ValueError(
                f"request_fields: {own} are set by ChatAgent itself (model from its argument, "
                "messages from the observations, one non-streamed choice per request)"
            )
        try:
            json.dumps(request_fields)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"request_fields must be JSON-serialisable: {exc}") from None
        self.base_url = base_url.rstrip("/")
        self.url = f"{self.base_url}/chat/completions"
        self.model = model
        self.max_in_flight = max_in_flight
        self.timeout = timeout
        self.retries = retries
        self.api_key = api_key
        self.request_fields = dict(request_fields)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._random = random.Random()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None

    def __repr__(self) -> str:
        return f"ChatAgent({self.base_url!r}, {self.model!r}, max_in_flight={self.max_in_flight})"

    # -- the agent protocol -------------------------------------------------------------------

    async def get_actions(self, observations: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One request per row of ``observations``; the replies' texts and agent infos.

        Raises:
            AgentRowsError: some rows failed (timeout, or an error after the retries); it holds
                the other rows' output and each failed row's :class:`ChatRequestError`.
            ChatRequestError: a 401, 403 or 404: the whole call fails.
        """
        conversations = [self.messages(o) for o in _rows(observations)]
        session, slots = self._connection()
        outcomes: list[ChatReply | BaseException]
        if len(conversations) == 1:  # the lanes' call per env: no task for one request
            try:
                outcomes = [await self._ask(session, slots, conversations[0])]
            except Exception as exc:
                outcomes = [exc]
        else:
            outcomes = await asyncio.gather(
                *(self._ask(session, slots, c) for c in conversations), return_exceptions=True
            )
        replies: list[ChatReply | None] = []
        failures: dict[int, BaseException] = {}
        for j, outcome in enumerate(outcomes):
            if isinstance(outcome, ChatReply):
                replies.append(outcome)
                continue
            if isinstance(outcome, ChatRequestError) and outcome.status in FATAL:
                raise outcome
            if not isinstance(outcome, Exception):  # a BaseException: not the row's alone
                raise outcome
            failures[j] = outcome
            replies.append(None)
        actions, infos = self._output(replies)
        if failures:
            raise AgentRowsError(actions, infos, failures)
        return actions, infos

    def messages(self, observation: Any) -> list[dict[str, Any]]:
        """The conversation to send for one env's ``observation``: a string is one user
        message; a sequence of ``{"role", "content"}`` mappings is sent as it is."""
        if isinstance(observation, (str, np.str_)):
            return [{"role": "user", "content": str(observation)}]
        if isinstance(observation, Sequence | np.ndarray) and all(
            isinstance(m, Mapping) and "role" in m for m in observation
        ):
            return [dict(m) for m in observation]
        raise TypeError(
            "observation: ChatAgent sends a str as one user message, or a list of "
            f"{{'role', 'content'}} dicts as the conversation; got {type(observation).__name__}"
            " (override ChatAgent.messages to build the conversation from it)"
        )

    # -- connections --------------------------------------------------------------------------

    def _connection(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        """The session and the cap of the running loop (made on first use in it)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._session is None or self._session.closed:
            # A loop of its own (a new sampler's, an env host's): connections do not cross.
            self._loop = loop
            connector = aiohttp.TCPConnector(limit=self.max_in_flight, limit_per_host=0)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None),  # each attempt's own, in _send
                headers=self._headers,
            )
            self._slots = asyncio.Semaphore(self.max_in_flight)
        assert self._slots is not None
        return self._session, self._slots

    async def aclose(self) -> None:
        """Close the connections (idempotent); the agent opens new ones if used again."""
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()

    async def __aenter__(self) -> ChatAgent:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_loop=None, _session=None, _slots=None)
        return state

    # -- one request --------------------------------------------------------------------------

    async def _ask(
        self,
        session: aiohttp.ClientSession,
        slots: asyncio.Semaphore,
        messages: list[dict[str, Any]],
    ) -> ChatReply:
        """One env's request, retried on 429, 5xx and failed connections."""
        body = {**self.request_fields, "model": self.model, "messages": messages}
        attempt = 0
        while True:
            async with slots:
                status, data, text, wait = await self._send(session, body, attempt)
            if status == 200:
                try:
                    return parse_completion(data)
                except ValueError as exc:
                    raise ChatRequestError(
                        f"POST {self.url}: {exc}", status=200, body=text, attempts=attempt + 1
                    ) from None
            retried = status is None or status in RETRIED
            if not retried or attempt >= self.retries:
                what = "no connection" if status is None else f"HTTP {status}"
                raise ChatRequestError(
                    f"POST {self.url}: {what} after {attempt + 1} attempt(s): {text}",
                    status=status,
                    body=text,
                    attempts=attempt + 1,
                )
            await asyncio.sleep(self._backoff(attempt, wait))
            attempt += 1

    async def _send(
        self, session: aiohttp.ClientSession, body: dict[str, Any], attempt: int
    ) -> tuple[int | None, Any, str, float | None]:
        """One attempt: ``(status, json, text, retry_after)``; status ``None``: no connection.
        Past :attr:`timeout`, a :class:`ChatTimeoutError`."""
        try:
            async with asyncio.timeout(self.timeout):
                async with session.post(self.url, json=body) as response:
                    if response.status == 200:
                        raw = await response.read()
                        try:
                            return 200, json.loads(raw), "", None
                        except ValueError:
                            return 200, None, raw[:BODY_CHARS].decode(errors="replace"), None
                    text = (await response.text(errors="replace"))[:BODY_CHARS]
                    after = _retry_after(response.headers.get("Retry-After"))
                    return response.status, None, text, after
        except TimeoutError:
            raise ChatTimeoutError(
                f"POST {self.url}: no whole reply within timeout={self.timeout:g}s "
                f"(attempt {attempt + 1})",
                attempts=attempt + 1,
            ) from None
        except aiohttp.ClientError as exc:  # refused, reset, a bad reply's framing
            return None, None, f"{type(exc).__name__}: {exc}", None

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        """Seconds before retry ``attempt + 1``: the server's ``Retry-After`` if it sent one
        (plus up to 10% jitter), else exponential backoff with jitter."""
        if retry_after is not None:
            return retry_after * (1.0 + 0.1 * self._random.random())
        ceiling = min(self.BACKOFF_MAX, self.BACKOFF_BASE * 2.0**attempt)
        return ceiling * self._random.uniform(0.5, 1.0)

    # -- output -------------------------------------------------------------------------------

    def _output(self, replies: list[ChatReply | None]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Actions and agent infos of ``replies`` (``None``: a failed row, placeholders)."""
        got = [r for r in replies if r is not None]
        actions = text_array("" if r is None else r.text for r in replies)
        infos: dict[str, np.ndarray] = {
            "model": text_array(self.model if r is None else r.model or self.model for r in replies)
        }
        for key, dtype in (("token_ids", np.int64), ("logprobs", np.float32)):
            if got and all(getattr(r, key) is not None for r in got):
                column = np.empty(len(replies), dtype=object)
                empty = np.zeros(0, dtype=dtype)
                column[:] = [empty if r is None else getattr(r, key) for r in replies]
                infos[key] = column
        return actions, infos


def _rows(observations: Any) -> list[Any]:
    """The rows of a batch of observations (an array's, or a list's items; of a ``Dict``
    space's batch, one dict per row, for an override of :meth:`ChatAgent.messages`)."""
    if isinstance(observations, Mapping):
        keys = list(observations)
        columns = [_rows(observations[k]) for k in keys]
        return [dict(zip(keys, row)) for row in zip(*columns)]
    if isinstance(observations, np.ndarray):
        if observations.ndim == 0:
            raise ValueError(
                "observations: ChatAgent needs a batch (one row per env), got a scalar"
            )
        return list(observations) if observations.dtype == object else observations.tolist()
    if isinstance(observations, (list, tuple)):
        return list(observations)
    raise TypeError(
        "observations: ChatAgent takes a batch of observations (an array or list with one "
        f"string or conversation per env), got {type(observations).__name__}"
    )


def _retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds (delta-seconds or an HTTP date), ``None`` if absent
    or unreadable."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return max(seconds, 0.0) if math.isfinite(seconds) else None
