"""ChatAgent against the project's own OpenAI-compatible server (asyncsample.llm.testing), called
directly as the sampler calls an agent: replies, token ids and log-probabilities, the model
reported, retries of 429 and 5xx, a failure after the retries and a stall cut at the timeout as
that row's fault alone (AgentRowsError), the cap on requests in flight, and the extra's import.
"""

from __future__ import annotations

import asyncio
import pickle
import time
from typing import Any

import cloudpickle
import numpy as np
import pytest
from helpers import run_python, wait_until

from asyncsample import AgentRowsError, ChatRequestError, ChatTimeoutError
from asyncsample.llm import ChatAgent, parse_completion
from asyncsample.llm.testing import ChatRequest, ChatServer, Fault, token_ids, token_logprobs

pytestmark = pytest.mark.both_loops


def _prompts(n: int) -> np.ndarray:
    return np.array([f"task {k}" for k in range(n)])


async def test_replies_token_ids_logprobs_and_model() -> None:
    async with (
        ChatServer(lambda m: f"answer to {m[-1]['content']}", model="served/model") as server,
        ChatAgent(server.base_url, "asked/model", logprobs=True, return_token_ids=True) as agent,
    ):
        actions, infos = await agent.get_actions(_prompts(3))
    assert [str(a) for a in actions] == [f"answer to task {k}" for k in range(3)]
    assert [str(m) for m in infos["model"]] == ["served/model"] * 3  # what the server reported
    for k in range(3):
        ids = token_ids(f"answer to task {k}")
        np.testing.assert_array_equal(infos["token_ids"][k], ids)
        np.testing.assert_allclose(infos["logprobs"][k], token_logprobs(ids), rtol=1e-6)
        assert infos["token_ids"][k].dtype == np.int64
        assert infos["logprobs"][k].dtype == np.float32


async def test_token_ids_from_vllm_token_strings_and_no_logprobs_without_asking() -> None:
    async with ChatServer() as server:
        async with ChatAgent(
            server.base_url, "m", logprobs=True, return_tokens_as_token_ids=True
        ) as agent:
            _, infos = await agent.get_actions(["hi"])
        np.testing.assert_array_equal(infos["token_ids"][0], token_ids("echo: hi"))
        async with ChatAgent(server.base_url, "m") as plain:
            actions, infos = await plain.get_actions(["hi"])
    assert str(actions[0]) == "echo: hi"
    assert set(infos) == {"model"}  # the server returned neither: no such columns


def test_parse_completion_reads_each_servers_shape() -> None:
    # SGLang: a token_id on each logprobs entry
    sglang = {
        "model": "s",
        "choices": [
            {
                "message": {"content": "ab"},
                "logprobs": {
                    "content": [
                        {"token": "a", "token_id": 7, "logprob": -0.5},
                        {"token": "b", "token_id": 9, "logprob": -0.25},
                    ]
                },
            }
        ],
    }
    reply = parse_completion(sglang)
    assert reply.text == "ab" and reply.model == "s"
    np.testing.assert_array_equal(reply.token_ids, [7, 9])
    np.testing.assert_allclose(reply.logprobs, [-0.5, -0.25])
    # plain OpenAI: logprobs but no ids; a null content (a tool call) is ""
    openai = {"model": "o", "choices": [{"message": {"content": None}, "logprobs": None}]}
    assert parse_completion(openai).text == ""
    assert parse_completion(openai).token_ids is None
    with pytest.raises(ValueError, match="not a chat completion"):
        parse_completion({"error": "nope"})


async def test_a_conversation_is_sent_as_it_is() -> None:
    seen: list[list[dict[str, str]]] = []

    def reply(messages: list[dict[str, str]]) -> str:
        seen.append(messages)
        return str(len(messages))

    conversation = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    observations = np.empty(2, dtype=object)
    observations[:] = [conversation, "alone"]
    async with ChatServer(reply) as server, ChatAgent(server.base_url, "m") as agent:
        actions, _ = await agent.get_actions(observations)
    assert [str(a) for a in actions] == ["2", "1"]
    assert conversation in seen and [{"role": "user", "content": "alone"}] in seen
    with pytest.raises(TypeError, match=r"override ChatAgent\.messages"):
        agent.messages(3.0)


async def test_429_is_retried_after_retry_after() -> None:
    def throttle_first(request: ChatRequest) -> Fault | None:
        return Fault.throttle(retry_after=0.2) if request.attempt == 1 else None

    async with ChatServer(fault=throttle_first) as server:
        async with ChatAgent(server.base_url, "m", retries=2) as agent:
            start = time.monotonic()
            actions, _ = await agent.get_actions(_prompts(4))
            waited = time.monotonic() - start
    assert [str(a) for a in actions] == [f"echo: task {k}" for k in range(4)]
    assert server.statuses == {429: 4, 200: 4}
    assert waited >= 0.2  # Retry-After honoured (a lower bound: never flaky on a busy machine)


def test_backoff_is_exponential_with_jitter_and_honours_retry_after() -> None:
    agent = ChatAgent("http://localhost:1/v1", "m")
    for attempt in range(6):
        ceiling = min(agent.BACKOFF_MAX, agent.BACKOFF_BASE * 2**attempt)
        delays = [agent._backoff(attempt, None) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(set(delays)) > 1  # jitter
    assert all(3.0 <= agent._backoff(0, 3.0) <= 3.3 for _ in range(20))


async def test_500_after_the_retries_fails_that_row_alone() -> None:
    def broken_task_1(request: ChatRequest) -> Fault | None:
        return Fault.error(503) if request.prompt == "task 1" else None

    async with ChatServer(fault=broken_task_1) as server:
        async with ChatAgent(server.base_url, "m", retries=2) as agent:
            agent.BACKOFF_BASE = 0.01
            with pytest.raises(AgentRowsError) as caught:
                await agent.get_actions(_prompts(3))
    err = caught.value
    assert set(err.failures) == {1}
    cause = err.failures[1]
    assert isinstance(cause, ChatRequestError) and cause.status == 503 and cause.attempts == 3
    assert "HTTP 503 after 3 attempt(s)" in str(cause)
    assert server.statuses[503] == 3  # the first try and two retries
    assert [str(a) for a in err.actions[[0, 2]]] == ["echo: task 0", "echo: task 2"]
    assert str(err.agent_infos["model"][0]) == "asyncsample/echo"


async def test_a_stalled_request_is_cut_at_its_timeout_as_that_rows_fault() -> None:
    def stall_task_2(request: ChatRequest) -> Fault | None:
        return Fault.hang() if request.prompt == "task 2" else None

    async with ChatServer(fault=stall_task_2) as server:
        async with ChatAgent(server.base_url, "m", timeout=0.5, retries=3) as agent:
            with pytest.raises(AgentRowsError) as caught:
                await agent.get_actions(_prompts(4))
        # the server saw the client go: the stalled handler is cancelled
        await wait_until(lambda: server.in_flight == 0, "the stalled request to be dropped")
    err = caught.value
    assert set(err.failures) == {2}
    assert isinstance(err.failures[2], ChatTimeoutError)
    assert isinstance(err.failures[2], TimeoutError)
    assert server.requests == 4  # a timeout is not retried: the env is rebuilt instead
    assert [str(a) for a in err.actions[[0, 1, 3]]] == [f"echo: task {k}" for k in (0, 1, 3)]


async def test_requests_in_flight_never_pass_the_cap_across_calls() -> None:
    async with ChatServer(latency=0.01) as server:
        async with ChatAgent(server.base_url, "m", max_in_flight=3) as agent:
            outputs = await asyncio.gather(*(agent.get_actions(_prompts(10)) for _ in range(4)))
    assert all(len(actions) == 10 for actions, _ in outputs)
    assert server.requests == 40
    assert 1 <= server.max_in_flight <= 3


async def test_wrong_url_or_key_fails_the_whole_call() -> None:
    async with ChatServer() as server:
        base = server.base_url.removesuffix("/v1")
        async with ChatAgent(f"{base}/nope", "m") as agent:
            with pytest.raises(ChatRequestError, match="HTTP 404") as caught:
                await agent.get_actions(_prompts(2))
    assert caught.value.status == 404 and not isinstance(caught.value, AgentRowsError)


async def test_no_server_fails_each_row_after_the_retries() -> None:
    async with ChatServer() as server:
        url = server.base_url
    async with ChatAgent(url, "m", retries=1) as agent:  # the port is closed now
        agent.BACKOFF_BASE = 0.01
        with pytest.raises(AgentRowsError) as caught:
            await agent.get_actions(_prompts(2))
    assert set(caught.value.failures) == {0, 1}
    assert all(e.status is None and e.attempts == 2 for e in caught.value.failures.values())  # type: ignore[attr-defined]


async def test_the_agent_pickles_without_its_connections() -> None:
    async with ChatServer() as server:
        agent = ChatAgent(server.base_url, "m", max_in_flight=2, temperature=0.5)
        await agent.get_actions(["a"])
        copy = pickle.loads(cloudpickle.dumps(agent))
        await agent.aclose()
        assert copy._session is None and copy.request_fields == {"temperature": 0.5}
        async with copy:
            actions, _ = await copy.get_actions(["b"])
    assert str(actions[0]) == "echo: b"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"base_url": "localhost:8000"}, ValueError, "base_url must be an http"),
        ({"model": ""}, ValueError, "model must be a non-empty str"),
        ({"max_in_flight": 0}, ValueError, "max_in_flight must be >= 1"),
        ({"timeout": -1}, ValueError, "timeout must be a finite number of seconds > 0"),
        ({"retries": -1}, ValueError, "retries must be >= 0"),
        ({"api_key": 3}, TypeError, "api_key must be a str or None"),
        ({"messages": []}, ValueError, "set by ChatAgent itself"),
        ({"stop": object()}, TypeError, "request_fields must be JSON-serialisable"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], error: type, match: str) -> None:
    args = {"base_url": "http://localhost:8000/v1", "model": "m", **kwargs}
    with pytest.raises(error, match=match):
        ChatAgent(**args)  # type: ignore[arg-type]


def test_core_imports_no_http_client_and_a_missing_extra_is_named() -> None:
    result = run_python(
        """
        import sys
        import asyncsample
        assert "aiohttp" not in sys.modules, "import asyncsample imported aiohttp"
        sys.modules["aiohttp"] = None  # as if the extra were not installed
        try:
            import asyncsample.llm
        except ImportError as exc:
            print(exc)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'asyncsample[llm]'" in result.stdout


def test_a_server_in_a_thread_of_its_own_serves_and_stops() -> None:
    async def ask(url: str) -> np.ndarray:
        async with ChatAgent(url, "m", max_in_flight=2) as agent:
            actions, _ = await agent.get_actions(_prompts(5))
        return actions

    with ChatServer(latency=0.01).in_thread() as server:
        actions = asyncio.run(ask(server.base_url))
        assert 1 <= server.max_in_flight <= 2
    assert [str(a) for a in actions] == [f"echo: task {k}" for k in range(5)]
    with pytest.raises(RuntimeError, match="not started"):
        server.base_url  # noqa: B018 - closed: no address


async def test_a_dict_observation_reaches_an_override_of_messages_row_by_row() -> None:
    class Briefed(ChatAgent):
        def messages(self, observation: Any) -> list[dict[str, Any]]:
            return [
                {"role": "system", "content": str(observation["system"])},
                {"role": "user", "content": str(observation["prompt"])},
            ]

    observations = {"system": np.array(["s0", "s1"]), "prompt": np.array(["p0", "p1"])}
    async with ChatServer(lambda m: f"{m[0]['content']}+{m[1]['content']}") as server:
        async with Briefed(server.base_url, "m") as agent:
            actions, _ = await agent.get_actions(observations)
            with pytest.raises(TypeError, match=r"override ChatAgent\.messages"):
                await ChatAgent(server.base_url, "m").get_actions(observations)
    assert [str(a) for a in actions] == ["s0+p0", "s1+p1"]
