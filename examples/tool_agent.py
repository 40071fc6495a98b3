"""A multi-turn tool-use env driven by an LLM agent: 1,000 concurrent episodes in env-host
processes, against a local OpenAI-compatible chat server.

Each episode is an arithmetic question ("What is 12 * 7 + 3?"). The model answers in text: a
reply ``CALL calc(<expression>)`` is a tool call, which the env sends to a calculator, a real
HTTP service on localhost; the result comes back as the next observation. A reply
``ANSWER <number>`` ends the episode and a verifier scores it (reward 1 when right, else 0).

The "model" here is :class:`asyncsample.llm.testing.ChatServer` with a deterministic policy,
:func:`scripted_model`, served from a process of its own as the calculator is
(:func:`~asyncsample.llm.testing.serve_in_process`): it calls the tool once per operator, left
to right, then answers. Left
to right is not always right ("2 + 3 * 4" is 14, not 20), so the verifier has work to do. Point
the agent at vLLM instead with ``--base-url http://localhost:8000/v1 --model <name>``.

    python examples/tool_agent.py                      # 1,000 envs, 2,000 episodes
    python examples/tool_agent.py --envs 32 --episodes 64 --hosts 1

The summary gives the episodes, the turns, the tool calls per second and the mean reward;
``--json PATH`` also writes it, with each episode's task and reward.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import functools
import json
import operator
import re
import string
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from aiohttp import ClientSession, ClientTimeout, TCPConnector, web
from tqdm import tqdm

import asyncsample
from asyncsample.llm import ChatAgent
from asyncsample.llm.testing import ChatServer, LocalApp, serve_in_process

#: The longest observation or reply, in characters (the conversation so far, as JSON).
MAX_CHARS = 4096
#: Turns an episode may take before it is cut (truncated).
MAX_TURNS = 8
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
SYSTEM = (
    "Answer the question. To compute, reply exactly CALL calc(<a> <op> <b>) and wait for the "
    "result; when you know the answer, reply ANSWER <number>."
)


# -- the task, its verifier and the tool --------------------------------------------------------


def question(task: int) -> tuple[str, int]:
    """Task ``task``'s expression (three numbers, two operators, drawn from the task id) and
    its value with the usual precedence."""
    rng = np.random.default_rng(task)
    a, b, c = (int(x) for x in rng.integers(1, 20, 3))
    op1, op2 = (str(o) for o in rng.choice(list(_OPS), 2))
    expression = f"{a} {op1} {b} {op2} {c}"
    return expression, evaluate(expression)


def evaluate(expression: str) -> int:
    """The value of an integer expression of ``+``, ``-``, ``*`` and parentheses (no names, no
    calls: a parsed tree, never ``eval``); ``ValueError`` for anything else."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp):
            ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
            op = ops.get(type(node.op))
            if op is not None:
                return int(op(value(node.left), value(node.right)))
        raise ValueError(f"not an integer expression of +, - and *: {expression!r}")

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an expression: {expression!r}") from None
    return value(tree.body)


def verify(reply: str, answer: int) -> float:
    """The verifier: 1.0 if ``reply`` is ``ANSWER <answer>``, else 0.0."""
    found = re.fullmatch(r"\s*ANSWER\s+(-?\d+)\s*", reply)
    return float(found is not None and int(found.group(1)) == answer)


def calculator_app() -> web.Application:
    """The tool: ``POST /calc {"expression": "12 * 7"}`` answers ``{"value": 84}`` (400 with an
    ``error`` for what it cannot compute)."""

    async def calc(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            return web.json_response({"value": evaluate(str(body["expression"]))})
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)

    app = web.Application()
    app.router.add_post("/calc", calc)
    return app


# -- the model (the local chat server's reply function) -----------------------------------------


def scripted_model(messages: list[dict[str, Any]]) -> str:
    """A deterministic stand-in for an LLM: one tool call per operator of the question, left
    to right, each on the last result, then the answer (the last result)."""
    asked = re.search(r"What is (.+)\?", str(messages[1]["content"]))
    if asked is None:
        return "ANSWER 0"
    terms = asked.group(1).split()
    results = [
        int(m["content"].removeprefix("Tool result: "))
        for m in messages
        if m["role"] == "user" and str(m["content"]).startswith("Tool result: ")
    ]
    k = len(results)
    if 2 * k + 1 >= len(terms):
        return f"ANSWER {results[-1] if results else terms[0]}"
    left = terms[0] if k == 0 else str(results[-1])
    return f"CALL calc({left} {terms[2 * k + 1]} {terms[2 * k + 2]})"


# -- the env -------------------------------------------------------------------------------------


class _ToolClient:
    """One HTTP session per env-host event loop for every env there (not one per env), closed
    when the last env using it closes."""

    session: ClientSession | None = None
    users = 0

    @classmethod
    def get(cls) -> ClientSession:
        if cls.session is None or cls.session.closed:
            cls.session = ClientSession(
                connector=TCPConnector(limit=256), timeout=ClientTimeout(total=30)
            )
        cls.users += 1
        return cls.session

    @classmethod
    async def release(cls) -> None:
        cls.users -= 1
        if cls.users <= 0 and cls.session is not None:
            session, cls.session = cls.session, None
            await session.close()


class CalculatorTaskEnv(asyncsample.AsyncEnv[str, str]):
    """The tool-use env: the observation is the conversation so far (JSON text); the action is
    the model's reply. The task comes from ``reset(options={"task": id})``, or from
    :meth:`set_task` (``SetTaskUpdate``), else is drawn from the env's generator; it is in the
    reset info (``episode_infos["task"]``)."""

    observation_space = gym.spaces.Text(MAX_CHARS, charset=string.printable)
    action_space = gym.spaces.Text(MAX_CHARS, min_length=0, charset=string.printable)

    def __init__(self, tool_url: str, max_turns: int = MAX_TURNS) -> None:
        self.tool_url = tool_url
        self.max_turns = max_turns
        self.task: int | None = None
        self.answer = 0
        self.turns = 0
        self.messages: list[dict[str, str]] = []
        self._session: ClientSession | None = None

    def set_task(self, task: int) -> None:
        """Every episode from now on asks task ``task`` (GRPO's groups: k envs, one task)."""
        self.task = int(task)

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        await super().reset(seed=seed)
        if options and "task" in options:
            task = int(options["task"])
        elif self.task is not None:
            task = self.task
        else:
            task = int(self.np_random.integers(10**6))
        expression, self.answer = question(task)
        self.turns = 0
        self.messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is {expression}?"},
        ]
        return json.dumps(self.messages), {"task": task}

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        reply = str(action)
        self.turns += 1
        self.messages.append({"role": "assistant", "content": reply})
        call = re.fullmatch(r"\s*CALL calc\((.*)\)\s*", reply)
        reward, terminated, tool_calls = 0.0, False, 0
        if call is not None:
            self.messages.append({"role": "user", "content": await self._calc(call.group(1))})
            tool_calls = 1
        elif reply.lstrip().startswith("ANSWER"):
            reward, terminated = verify(reply, self.answer), True
        else:
            self.messages.append({"role": "user", "content": "Reply CALL calc(...) or ANSWER n."})
        truncated = not terminated and self.turns >= self.max_turns
        info = {"tool_calls": tool_calls}
        return json.dumps(self.messages), reward, terminated, truncated, info

    async def _calc(self, expression: str) -> str:
        if self._session is None:
            self._session = _ToolClient.get()
        async with self._session.post(self.tool_url, json={"expression": expression}) as r:
            body = await r.json()
        return f"Tool result: {body['value']}" if r.status == 200 else f"Tool error: {body}"

    async def close(self) -> None:
        if self._session is not None:
            self._session = None
            await _ToolClient.release()


class ConversationAgent(ChatAgent):
    """ChatAgent for observations that are a conversation as JSON text."""

    def messages(self, observation: Any) -> list[dict[str, Any]]:
        return list(json.loads(str(observation)))


# -- the run -------------------------------------------------------------------------------------


def _calculator() -> LocalApp:
    return LocalApp(calculator_app())


@contextlib.contextmanager
def local_services(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """The calculator and (unless ``--base-url``) the chat server, each in a process of its own,
    as separate services run: their URLs."""
    with contextlib.ExitStack() as stack:
        tool = stack.enter_context(serve_in_process(_calculator))
        if args.base_url:
            yield f"{tool}/calc", args.base_url
            return
        model = functools.partial(
            ChatServer, scripted_model, model=args.model, latency=args.model_latency
        )
        yield f"{tool}/calc", stack.enter_context(serve_in_process(model))


async def run(args: argparse.Namespace, tool_url: str, chat_url: str) -> dict[str, Any]:
    workers = max(1, min(args.workers, args.envs))
    agent = ConversationAgent(chat_url, args.model, max_in_flight=args.max_in_flight)
    sampler = asyncsample.Sampler(
        functools.partial(CalculatorTaskEnv, tool_url),
        agent,
        backend="process",
        n_workers=workers,
        envs_per_worker=max(1, args.envs // workers),
        n_processes=args.hosts,
        max_episode_length=MAX_TURNS,
        seed=args.seed,
    )
    tasks: list[int] = []
    rewards: list[float] = []
    turns = tool_calls = 0
    async with agent, sampler:
        start = time.perf_counter()
        bar = tqdm(total=args.episodes, unit="episode", disable=args.quiet)
        async with contextlib.aclosing(sampler.stream(max(args.envs // 2, 1))) as stream:
            async for batch in stream:
                ends = np.cumsum(batch.lengths)
                tasks += batch.episode_infos["task"].tolist()
                rewards += np.add.reduceat(batch.rewards, ends - batch.lengths).tolist()
                turns += batch.n_transitions
                tool_calls += int(batch.env_infos["tool_calls"].sum())
                bar.update(min(len(batch.lengths), args.episodes - bar.n))
                if len(tasks) >= args.episodes:
                    break
        bar.close()
        seconds = time.perf_counter() - start
    summary = {
        "episodes": len(tasks),
        "turns": turns,
        "tool_calls": tool_calls,
        "seconds": seconds,
        "tool_calls_per_s": tool_calls / seconds,
        "turns_per_s": turns / seconds,
        "mean_reward": float(np.mean(rewards)) if rewards else 0.0,
        "tasks": tasks,
        "rewards": rewards,
    }
    print(
        f"{summary['episodes']:,} episodes, {turns:,} turns, {tool_calls:,} tool calls in "
        f"{seconds:.1f} s: {summary['tool_calls_per_s']:,.0f} tool calls/s, "
        f"{summary['turns_per_s']:,.0f} turns/s, mean reward {summary['mean_reward']:.3f}"
    )
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, default=1000, help="episodes in flight at once")
    parser.add_argument("--episodes", type=int, default=2000, help="episodes to collect")
    parser.add_argument("--workers", type=int, default=8, help="sampler workers")
    parser.add_argument("--hosts", type=int, default=2, help="env-host processes")
    parser.add_argument("--max-in-flight", type=int, default=256, help="chat requests at once")
    parser.add_argument("--model-latency", type=float, default=0.02, help="s per local reply")
    parser.add_argument("--base-url", default="", help="a served model instead (e.g. vLLM)")
    parser.add_argument("--model", default="local/scripted-calculator", help="the model name")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for name in ("envs", "episodes", "workers", "hosts", "max_in_flight"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    with local_services(args) as (tool_url, chat_url):
        summary = asyncio.run(run(args, tool_url, chat_url))
    if args.json is not None:
        args.json.write_text(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
