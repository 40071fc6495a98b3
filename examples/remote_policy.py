"""A policy that is a service, envs that call a tool service, and the asyncio backend between them.

One process tree, three parts:

* **The policy server** (a child process, started with ``spawn``): an aiohttp app whose
  ``POST /act`` takes a batch of observations and answers with actions sampled from a torch MLP
  (64x64, tanh). It micro-batches: requests that arrive within ``--batch-wait-ms`` of the first
  (or until ``--batch-rows`` rows are waiting) share one forward pass, so many small concurrent
  requests cost a few large passes. ``GET /stats`` counts requests, rows and passes.
* **The tool service** (an aiohttp app in the sampler's own event loop): ``GET /measure``
  sleeps a few milliseconds, as a remote tool or simulator would, then returns what the env
  needs: the distance from a position to a hidden target.
* **The sampler**: :class:`ToolEnv` is an :class:`asyncsample.AsyncEnv` whose every step awaits
  the tool service; :class:`RemotePolicyAgent` is an async agent whose ``get_actions`` awaits the
  policy server; ``Sampler(..., backend="asyncio")`` runs every env in the event loop, each on
  its own episode, while the agent is asked for the envs ready at that moment.

The env is a one-dimensional search: the agent moves left or right and sees its position and
the distance the tool reported; an episode ends at the target (reward 1) or after
``MAX_EPISODE_STEPS`` steps (:class:`asyncsample.AsyncTimeLimit`). The policy is untrained: the
example is about the plumbing, not the learning.

Run it (it needs torch and aiohttp: ``pip install '.[torch,examples]'``)::

    python examples/remote_policy.py --quick      # a few seconds
    python examples/remote_policy.py --workers 8 --envs 128 --iterations 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import multiprocessing as mp
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import aiohttp
import gymnasium as gym
import numpy as np
from aiohttp import web

from asyncsample import (
    AsyncEnv,
    AsyncRecordEpisodeStatistics,
    AsyncTimeLimit,
    EpisodeBatch,
    Sampler,
    StepType,
)

if TYPE_CHECKING:
    import torch

#: Cells of the line the env's agent walks on.
SIZE = 16
#: An episode that has not found the target by then is truncated.
MAX_EPISODE_STEPS = 40
OBS_DIM = 3
N_ACTIONS = 2
#: The tool's latency is drawn per call from this range (milliseconds), by the env's np_random.
TOOL_DELAY_MS = (2.0, 8.0)


# -- the policy server (child process) ------------------------------------------------------------


@dataclass(frozen=True)
class PolicyConfig:
    """What the policy server is started with."""

    seed: int = 0
    hidden: int = 64
    batch_rows: int = 1024
    batch_wait_ms: float = 2.0


def make_policy(config: PolicyConfig) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """A torch MLP that maps a batch of observations to sampled actions and their log-probs."""
    import torch

    torch.set_num_threads(1)  # one intra-op thread: the server shares the machine with the envs
    torch.manual_seed(config.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(OBS_DIM, config.hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(config.hidden, config.hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(config.hidden, N_ACTIONS),
    )
    generator = torch.Generator().manual_seed(config.seed)

    @torch.no_grad()
    def forward(observations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits: torch.Tensor = model(torch.as_tensor(observations, dtype=torch.float32))
        log_probs = torch.log_softmax(logits, dim=-1)
        actions = torch.multinomial(log_probs.exp(), 1, generator=generator)
        return actions[:, 0].numpy(), log_probs.gather(1, actions)[:, 0].numpy()

    return forward


class MicroBatcher:
    """Merges concurrent requests into one forward pass.

    The first request waiting starts a window of ``max_wait`` seconds; the pass runs when the
    window closes or as soon as ``max_rows`` rows are waiting, whichever comes first, and takes
    at most ``max_rows`` rows (one request is never split). The forward pass runs in the loop's
    thread: for a small MLP it takes well under a millisecond, less than a thread hop would.
    """

    def __init__(
        self,
        forward: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
        max_rows: int,
        max_wait: float,
    ) -> None:
        self.forward = forward
        self.max_rows = max_rows
        self.max_wait = max_wait
        self._waiting: deque[tuple[np.ndarray, asyncio.Future[tuple[np.ndarray, np.ndarray]]]]
        self._waiting = deque()
        self._rows = 0
        self._arrived = asyncio.Event()
        self._full = asyncio.Event()
        self.requests = 0
        self.rows = 0
        self.passes = 0
        self.largest_pass = 0

    async def submit(self, observations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Queue a request's observations; returns its actions and log-probs."""
        future: asyncio.Future[tuple[np.ndarray, np.ndarray]]
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((observations, future))
        self._rows += len(observations)
        self._arrived.set()
        if self._rows >= self.max_rows:
            self._full.set()
        return await future

    async def run(self) -> None:
        """Serve passes until cancelled."""
        while True:
            await self._arrived.wait()
            if self._rows < self.max_rows:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), self.max_wait)
            taken = [self._waiting.popleft()]
            rows = len(taken[0][0])
            while self._waiting and rows + len(self._waiting[0][0]) <= self.max_rows:
                taken.append(self._waiting.popleft())
                rows += len(taken[-1][0])
            self._rows -= rows
            if not self._waiting:
                self._arrived.clear()
            if self._rows < self.max_rows:
                self._full.clear()
            self._answer(taken, rows)

    def _answer(
        self,
        taken: list[tuple[np.ndarray, asyncio.Future[tuple[np.ndarray, np.ndarray]]]],
        rows: int,
    ) -> None:
        try:
            actions, log_probs = self.forward(np.concatenate([obs for obs, _ in taken]))
        except Exception as exc:  # every waiting request learns why
            for _, future in taken:
                if not future.done():
                    future.set_exception(exc)
            return
        self.requests += len(taken)
        self.rows += rows
        self.passes += 1
        self.largest_pass = max(self.largest_pass, rows)
        start = 0
        for obs, future in taken:
            end = start + len(obs)
            if not future.done():  # the client may have gone away
                future.set_result((actions[start:end], log_probs[start:end]))
            start = end

    def stats(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "rows": self.rows,
            "passes": self.passes,
            "largest_pass": self.largest_pass,
        }


def create_policy_app(config: PolicyConfig) -> web.Application:
    """The policy server's aiohttp app (its batcher runs for the app's lifetime)."""
    batcher = MicroBatcher(make_policy(config), config.batch_rows, config.batch_wait_ms / 1e3)

    async def act(request: web.Request) -> web.Response:
        body = await request.json()
        observations = np.asarray(body["obs"], dtype=np.float32).reshape(-1, OBS_DIM)
        actions, log_probs = await batcher.submit(observations)
        return web.json_response({"actions": actions.tolist(), "logp": log_probs.tolist()})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(batcher.stats())

    async def run_batcher(app: web.Application) -> Any:
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app = web.Application()
    app.router.add_post("/act", act)
    app.router.add_get("/stats", stats)
    app.cleanup_ctx.append(run_batcher)
    return app


def serve_policy(conn: Connection, config: PolicyConfig) -> None:
    """The child process: serve on a free port, report it on ``conn``, stop when told.

    The parent's "stop", or the pipe closing because the parent is gone, ends the server.
    """
    asyncio.run(_serve_policy(conn, config))


async def _serve_policy(conn: Connection, config: PolicyConfig) -> None:
    runner = web.AppRunner(create_policy_app(config))
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        conn.send(("ready", runner.addresses[0][1]))
        with contextlib.suppress(EOFError):
            await asyncio.to_thread(conn.recv)  # blocks until "stop" or the parent's exit
    finally:
        await runner.cleanup()


class PolicyServer:
    """Starts the policy server in a child process and stops it on exit (``async with``)."""

    def __init__(self, config: PolicyConfig, start_timeout: float = 60.0) -> None:
        self.config = config
        self.start_timeout = start_timeout
        self.url = ""
        self.exitcode: int | None = None
        self._process: Any = None
        self._conn: Connection | None = None

    async def __aenter__(self) -> PolicyServer:
        context = mp.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=serve_policy, args=(child_conn, self.config), name="policy-server", daemon=True
        )
        self._process.start()
        child_conn.close()
        try:
            if not await asyncio.to_thread(self._conn.poll, self.start_timeout):
                raise RuntimeError(f"the policy server did not start in {self.start_timeout} s")
            try:
                _, port = self._conn.recv()
            except EOFError:
                raise RuntimeError("the policy server exited before it was ready") from None
        except BaseException:
            await self._stop()
            raise
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stop()

    async def _stop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send("stop")
            self._conn.close()
            self._conn = None
        if self._process is not None:
            await asyncio.to_thread(self._process.join, 10.0)
            if self._process.is_alive():
                self._process.terminate()
                await asyncio.to_thread(self._process.join, 5.0)
            self.exitcode = self._process.exitcode
            self._process = None


class RemotePolicyAgent:
    """An async agent whose policy lives behind ``POST {url}/act``.

    Args:
        session: the client session to post with (owned by the caller).
        url: the policy server's base URL.
    """

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url

    async def get_actions(self, observations: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        """Post the observations, await the server's actions; their log-probs are agent infos."""
        body = {"obs": np.asarray(observations, dtype=np.float32).tolist()}
        async with self.session.post(f"{self.url}/act", json=body) as response:
            response.raise_for_status()
            answer = await response.json()
        actions = np.asarray(answer["actions"], dtype=np.int64)
        return actions, {"logp": np.asarray(answer["logp"], dtype=np.float32)}

    def reset(self, do_resets: np.ndarray | None = None) -> None:
        """The policy keeps no per-episode state: nothing to reset."""


# -- the tool service (in the sampler's loop) and the env that calls it ---------------------------


class ToolService:
    """``GET /measure?pos=&target=&delay_ms=`` waits ``delay_ms``, then returns the distance."""

    def __init__(self) -> None:
        self.url = ""
        self.calls = 0
        self._runner: web.AppRunner | None = None

    async def measure(self, request: web.Request) -> web.Response:
        query = request.query
        await asyncio.sleep(float(query["delay_ms"]) / 1e3)
        self.calls += 1
        return web.json_response({"distance": abs(int(query["pos"]) - int(query["target"]))})

    async def __aenter__(self) -> ToolService:
        app = web.Application()
        app.router.add_get("/measure", self.measure)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class ToolEnv(AsyncEnv[np.ndarray, np.int64]):
    """Find a hidden target on a line of ``SIZE`` cells, asking a tool for the distance each step.

    Observation ``[position, distance, 1 if the last move got closer]`` scaled to [-1, 1] (the
    distance is what the tool answered). Actions: 0 left, 1 right. Reward 1 on reaching the
    target (which terminates the episode), -0.01 per other step. The start, the target and each
    call's latency come from the env's ``np_random``, so a fixed seed gives the same episodes
    for the same actions, whatever the timing.

    Args:
        session: the client session to call the tool with (shared by all envs; owned by the
            caller).
        tool_url: the tool service's base URL.
    """

    def __init__(self, session: aiohttp.ClientSession, tool_url: str) -> None:
        self.session = session
        self.tool_url = tool_url
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (OBS_DIM,), np.float32)
        self.action_space = gym.spaces.Discrete(N_ACTIONS)
        self.position = 0
        self.target = 0
        self.distance = 0

    async def _measure(self) -> int:
        delay_ms = self.np_random.uniform(*TOOL_DELAY_MS)
        params = {
            "pos": str(self.position),
            "target": str(self.target),
            "delay_ms": f"{delay_ms:.3f}",
        }
        async with self.session.get(f"{self.tool_url}/measure", params=params) as response:
            response.raise_for_status()
            return int((await response.json())["distance"])

    def _obs(self, closer: bool) -> np.ndarray:
        scale = (SIZE - 1) / 2
        return np.array(
            [self.position / scale - 1.0, self.distance / scale - 1.0, float(closer)],
            dtype=np.float32,
        )

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        await super().reset(seed=seed)
        self.position, self.target = (int(x) for x in self.np_random.choice(SIZE, 2, False))
        self.distance = await self._measure()
        return self._obs(False), {}

    async def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.position = min(max(self.position + (1 if int(action) == 1 else -1), 0), SIZE - 1)
        before, self.distance = self.distance, await self._measure()
        found = self.distance == 0
        return self._obs(self.distance < before), 1.0 if found else -0.01, found, False, {}


def make_env(
    session: aiohttp.ClientSession, tool_url: str
) -> AsyncRecordEpisodeStatistics[np.ndarray, np.int64]:
    """The sampler's env factory (bound to the session and URL with ``functools.partial``):
    the env under a time limit, with its episodes' return, length and seconds in the info of
    their last step (``batch.episode_infos["episode"]``)."""
    return AsyncRecordEpisodeStatistics(
        AsyncTimeLimit(ToolEnv(session, tool_url), MAX_EPISODE_STEPS)
    )


def summarise(batch: EpisodeBatch, seconds: float) -> dict[str, Any]:
    """One call's figures: counts, how episodes ended, mean return and duration, speed."""
    ends = batch.step_types[batch.lengths.cumsum() - 1]
    stats = batch.episode_infos["episode"]
    # An episode cut by the sampler's episode_timeout never reached the wrapper's last step.
    recorded = batch.episode_infos.get("_episode", np.ones(batch.n_episodes, bool))
    deadline = batch.episode_infos.get("deadline", np.zeros(batch.n_episodes, bool))
    return {
        "steps": batch.n_transitions,
        "episodes": batch.n_episodes,
        "found": int(np.sum(ends == StepType.TERMINAL)),
        "deadline": int(np.sum(deadline)),
        "mean_return": float(batch.returns.mean()),
        "mean_episode_seconds": float(stats["t"][recorded].mean()) if recorded.any() else None,
        "steps_per_second": batch.n_transitions / seconds,
    }


# -- the run --------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the servers and the sampler, sample, shut everything down; returns the figures."""
    config = PolicyConfig(seed=args.seed, batch_wait_ms=args.batch_wait_ms)
    figures: dict[str, Any] = {"iterations": []}
    connector = aiohttp.TCPConnector(limit=0)  # as many connections as there are envs in flight
    async with (
        PolicyServer(config) as policy,
        ToolService() as tool,
        aiohttp.ClientSession(connector=connector) as session,
    ):
        sampler = Sampler(
            functools.partial(make_env, session, tool.url),
            RemotePolicyAgent(session, policy.url),
            backend="asyncio",
            n_workers=args.workers,
            envs_per_worker=args.envs,
            seed=args.seed,
            episode_timeout=args.episode_timeout,
        )
        async with sampler:
            for i in range(args.iterations):
                t0 = time.perf_counter()
                batch = await sampler.obtain_samples(args.steps)
                row = summarise(batch, time.perf_counter() - t0)
                figures["iterations"].append(row)
                duration = row["mean_episode_seconds"]
                print(
                    f"iteration {i + 1}: {row['steps']} steps, {row['episodes']} episodes "
                    f"({row['found']} found the target, {row['deadline']} cut at the deadline), "
                    f"mean return {row['mean_return']:.3f}, mean episode "
                    f"{'-' if duration is None else f'{duration:.2f} s'}, "
                    f"{row['steps_per_second']:.0f} steps/s",
                    flush=True,
                )
        async with session.get(f"{policy.url}/stats") as response:
            figures["policy"] = await response.json()
        figures["tool_calls"] = tool.calls
    figures["policy_exitcode"] = policy.exitcode
    figures["config"] = asdict(config)
    return figures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--quick", action="store_true", help="a run of a few seconds (4 x 16 envs, 2 x 1,000 steps)"
    )
    parser.add_argument("--workers", type=int, default=4, help="worker coroutines")
    parser.add_argument("--envs", type=int, default=64, help="envs per worker")
    parser.add_argument("--iterations", type=int, default=5, help="obtain_samples calls")
    parser.add_argument("--steps", type=int, default=20_000, help="env steps per call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--episode-timeout",
        type=float,
        default=10.0,
        help="seconds after which a running episode is cut as truncated",
    )
    parser.add_argument(
        "--batch-wait-ms", type=float, default=2.0, help="the policy server's batching window"
    )
    if parser.parse_args(argv).quick:  # smaller defaults; options given explicitly still win
        parser.set_defaults(workers=4, envs=16, iterations=2, steps=1_000)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    figures = asyncio.run(run(args))
    policy = figures["policy"]
    per_pass = policy["rows"] / max(policy["passes"], 1)
    per_request = policy["rows"] / max(policy["requests"], 1)
    print(
        f"policy server: {policy['requests']} requests of {per_request:.1f} rows on average, "
        f"{policy['passes']} forward passes of {per_pass:.1f} rows on average "
        f"(largest {policy['largest_pass']})"
    )
    print(f"tool service: {figures['tool_calls']} calls")
    print(f"policy server exited with code {figures['policy_exitcode']}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0 if figures["policy_exitcode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
