"""Multi-agent sampling: 64 Pistonball envs against the machine's ceiling and the peers (issue 52).

The workload: PettingZoo's ``butterfly/pistonball_v6`` ``parallel_env()`` with its defaults (20
pistons, each an agent observing a (457, 120, 3) uint8 image and acting in Box(-1, 1, (1,));
125-step episodes), 64 envs, so 1,280 agent transitions (rows) per joint step of every env. Two
agents drive every cell alike: ``random`` (uniform actions: pre-drawn in the loops and PufferLib's
cells, the built-in ``RandomAgent`` in ours) and ``mlp`` (:class:`PistonMLP`, a small torch MLP
as a user writes it for such images: every 8th pixel, 2 hidden layers of 64, a tanh mean action,
one torch thread per process, no grad).

Cells, each in a fresh interpreter for ``--seconds`` after ``--warmup``; the repeats interleave
them (every cell once per repeat, in order) so that each ratio pairs runs made close together:

- ``ceiling``: the plain loop (``env.step({agent: action})`` on 32 envs one after the other, then
  the policy once on the 640 rows of its envs' observations) in as many processes as cores, side
  by side; the rate is the sum of the loops' own rates.
- ``plain``: one such loop alone (the env's own CPU per step).
- ``pufferlib-*``: PufferLib's emulation (``pufferlib.emulation.PettingZooPufferEnv``) and
  ``pufferlib.vector.make`` in each configuration of :data:`PUFFER_CONFIGS` (``Serial`` and
  ``Multiprocessing`` with 2 or 4 workers, a batch of all the envs or a part of them); the best
  by median is the peer of the target table.
- ``rllib``: RLlib's multi-agent env runner, where ``ray.rllib`` imports; else the reason.
- ``ours-host``, ``ours-per_worker``, ``ours-batched``: ``Sampler(pistonball_v6.parallel_env,
  n_workers=2, envs_per_worker=32, backend="process", seed=0)`` in that inference mode,
  consecutive ``obtain_fragments`` calls of ``--call-steps`` joint steps of every env (default
  :data:`CALL_STEPS`); ``--profile`` adds a run of the first one with its caller under cProfile.
- ``ours-stream``: the same sampler with the agent in the hosts, its batches taken from
  ``sampler.stream(call, fragments=True)``, as an async trainer consumes them: sampling runs
  ahead while a batch is taken (PufferLib's multiprocessing configurations with a batch of part
  of the envs overlap the same way).

Rates count agent transitions (rows; PufferLib's rows of a reset are not transitions and are not
counted) and env steps. CPU per agent transition: the caller's and its workers' (env hosts,
PufferLib's workers, the ceiling's loops), from :class:`~benchmarks.contenders.CpuAccount` and
the loops' own clocks; ``others``: what other processes used meanwhile. Run it as ``python -m
benchmarks.multiagent``; writes ``benchmarks/results/multiagent/`` (``results.json`` with the
command, commit, machine and date, and ``results.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import write_own_results

__all__ = ["CELLS", "PUFFER_CONFIGS", "PistonMLP", "main", "make_env", "run_cell"]

ENV_NAME = "pistonball_v6"
#: Envs in every cell, and the processes the ceiling and our sampler spread them over.
N_ENVS, PROCESSES = 64, 2
#: Joint steps of every env per ``obtain_fragments`` call (its quota counts rows: 2 x 1,280;
#: each row carries its 164 KB observation, so a call's batch holds about 0.4 GB of them).
CALL_STEPS = 2
#: PufferLib's configurations tried: name -> (backend, workers, batch as a share of the envs).
PUFFER_CONFIGS: dict[str, tuple[str, int, float]] = {
    "serial": ("Serial", 1, 1.0),
    "mp2-full": ("Multiprocessing", 2, 1.0),
    "mp2-half": ("Multiprocessing", 2, 0.5),
    "mp4-half": ("Multiprocessing", 4, 0.5),
    "mp4-quarter": ("Multiprocessing", 4, 0.25),
}
INFERENCE = ("host", "per_worker", "batched")
CELLS = (
    "ceiling",
    "plain",
    *(f"pufferlib-{name}" for name in PUFFER_CONFIGS),
    "rllib",
    *(f"ours-{mode}" for mode in INFERENCE),
    "ours-stream",
)
DEFAULT_CELLS = CELLS
POLICIES = ("random", "mlp")
AGENTS = {"random": "uniform actions", "mlp": "PistonMLP, the same torch MLP in every cell"}
RESULTS = Path(__file__).resolve().parent / "results" / "multiagent"
#: The issue's goal for ours / ceiling.
GOAL = 0.9
#: Cores other processes may take during a run before it counts as disturbed.
DISTURBED = 0.25
#: Why RLlib's cell cannot run in this project's environment: ``pip install
#: "ray[rllib]==2.60.0" --dry-run`` with torch, numpy and gymnasium pinned to the installed
#: versions (2026-11-30).
RLLIB_PIP = (
    'pip install "ray[rllib]==2.60.0" --dry-run -c <torch==2.13.0+cpu numpy==2.4.6 '
    'gymnasium==1.4.0>: "ERROR: Cannot install ray[rllib]==2.60.0 because these package '
    "versions have conflicting dependencies. The conflict is caused by: ray[rllib] 2.60.0 "
    'depends on gymnasium==1.2.2; extra == "rllib"; The user requested (constraint) '
    'gymnasium==1.4.0" (unpinned, pip would downgrade gymnasium 1.4.0 to 1.2.2 and add pandas, '
    "pyarrow, pydantic, scipy, tensorboardX, ormsgpack)"
)


def make_env(**kwargs: Any) -> Any:
    """One Pistonball ``ParallelEnv`` with its defaults (``pistonball_v6.parallel_env()``)."""
    from pettingzoo.butterfly import pistonball_v6

    return pistonball_v6.parallel_env(**kwargs)


def _env_fn() -> Callable[..., Any]:
    """PettingZoo's own factory (importable wherever PettingZoo is: what env hosts unpickle)."""
    from pettingzoo.butterfly import pistonball_v6

    return pistonball_v6.parallel_env  # type: ignore[no-any-return]


class PistonMLP:
    """The user's policy: a torch MLP on every 8th pixel of each agent's image.

    ``get_actions(observations)`` (asyncsample's Agent protocol; ``compute_actions`` is the same)
    takes one policy's stacked observations, ``(rows, 457, 120, 3)`` uint8, and returns
    ``(actions, {})`` with actions ``(rows, 1)`` float32 in [-1, 1]: the tanh of the network's
    output (its mean action). The weights come from ``seed``, so every copy is the same network.
    """

    STRIDE = 8

    def __init__(self, obs_shape: tuple[int, ...] = (457, 120, 3), seed: int = 0) -> None:
        import torch
        from torch import nn

        torch.set_num_threads(1)
        torch.manual_seed(seed)
        h, w, c = obs_shape
        n_in = len(range(0, h, self.STRIDE)) * len(range(0, w, self.STRIDE)) * c
        self.net = nn.Sequential(
            nn.Linear(n_in, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
        )
        self.net.eval()

    def act(self, observations: np.ndarray) -> np.ndarray:
        """One action per row of ``observations``."""
        import torch

        if torch.get_num_threads() != 1:  # a copy unpickled in another process
            torch.set_num_threads(1)
        small = np.ascontiguousarray(observations[:, :: self.STRIDE, :: self.STRIDE])
        with torch.no_grad():
            x = torch.from_numpy(small).reshape(len(small), -1).float().div_(255.0)
            return torch.tanh(self.net(x)).numpy()  # type: ignore[no-any-return]

    def get_actions(self, observations: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        """asyncsample's Agent protocol: the actions and no agent infos."""
        return self.act(observations), {}

    compute_actions = get_actions


def _usage() -> np.ndarray:
    """This process's minor page faults (each first touch of a fresh page: a newly allocated
    copy of a 164 KB observation faults about 41 times), user and system CPU seconds so far."""
    import resource

    use = resource.getrusage(resource.RUSAGE_SELF)
    return np.array([use.ru_minflt, use.ru_utime, use.ru_stime])


def _usage_per_row(usage: np.ndarray, rows: int) -> dict[str, float]:
    """The caller's page faults and its user and system CPU microseconds per row."""
    faults, user, system = usage / max(rows, 1)
    return {"main_faults": faults, "main_user_us": 1e6 * user, "main_sys_us": 1e6 * system}


# --------------------------------------------------------------------------------------------
# The plain loop, alone (plain) and one per core side by side (ceiling)


def _loop(
    n_envs: int,
    seed: int,
    policy: str,
    warmup: float,
    seconds: float,
    start: Any = None,
    account: Any = None,
) -> dict[str, Any]:
    """``n_envs`` envs stepped one after the other with ``env.step({agent: action})``; with
    ``policy="mlp"`` the policy acts once per round on every agent's last observation (written
    into one preallocated buffer as the steps return them). Rounds run for ``warmup`` seconds
    (at least one), then wait on ``start`` and run for ``seconds``; returns the timed rounds'
    rows, env steps, wall and CPU seconds (and starts and stops ``account`` around them)."""
    envs = [make_env() for _ in range(n_envs)]
    try:
        agents = list(envs[0].possible_agents)
        slot = {agent: i for i, agent in enumerate(agents)}
        n_agents = len(agents)
        space = envs[0].observation_space(agents[0])
        first = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
        mlp = PistonMLP(space.shape, seed=0) if policy == "mlp" else None
        buf = np.zeros((n_envs * n_agents, *space.shape), dtype=space.dtype)
        if mlp is not None:
            for e, obs in enumerate(first):
                for agent, ob in obs.items():
                    buf[e * n_agents + slot[agent]] = ob
        rng = np.random.default_rng(seed)
        drawn = rng.uniform(-1, 1, (256, n_envs * n_agents, 1)).astype(np.float32)
        turn = 0

        def one_round() -> tuple[int, int]:
            nonlocal turn
            actions = mlp.act(buf) if mlp is not None else drawn[turn & 255]
            turn += 1
            rows = 0
            for e, env in enumerate(envs):
                base = e * n_agents
                act = {agent: actions[base + slot[agent]] for agent in env.agents}
                obs = env.step(act)[0]
                rows += len(act)
                if not env.agents:
                    obs = env.reset()[0]
                if mlp is not None:
                    for agent, ob in obs.items():
                        buf[base + slot[agent]] = ob
            return rows, n_envs

        t0 = time.perf_counter()
        one_round()
        while time.perf_counter() - t0 < warmup:
            one_round()
        if start is not None:
            start.wait()
        rows = steps = 0
        if account is not None:
            account.start()
        cpu0, t0 = time.process_time(), time.perf_counter()
        while True:
            r, s = one_round()
            rows, steps = rows + r, steps + s
            wall = time.perf_counter() - t0
            if wall >= seconds:
                break
        if account is not None:
            account.stop()
        return {"rows": rows, "env_steps": steps, "wall": wall, "cpu": time.process_time() - cpu0}
    finally:
        for env in envs:
            env.close()


def _plain(policy: str, warmup: float, seconds: float, n_envs: int) -> dict[str, Any]:
    from benchmarks.runs import CpuAccount

    account = CpuAccount()
    loop = _loop(n_envs // PROCESSES, 0, policy, warmup, seconds, account=account)
    return {
        "others_cores": (account.result or {}).get("foreign_cores"),
        "rows_per_s": loop["rows"] / loop["wall"],
        "env_steps_per_s": loop["env_steps"] / loop["wall"],
        "workers_cpu_us": 1e6 * loop["cpu"] / loop["rows"],
        "layout": f"one plain loop of {n_envs // PROCESSES} envs",
    }


def _ceiling_child(
    policy: str, index: int, n_envs: int, warmup: float, seconds: float, start: Any, out: Any,
    finish: Any,
) -> None:  # fmt: skip
    try:
        out.put((index, _loop(n_envs, 1000 * index, policy, warmup, seconds, start), None))
        finish.wait(120)  # alive until the parent's window ends: its CPU is counted there
    except BaseException as exc:  # the parent reports it; a loop never dies silently
        start.abort()
        out.put((index, None, f"{type(exc).__name__}: {exc}"))


def _ceiling(policy: str, warmup: float, seconds: float, n_envs: int) -> dict[str, Any]:
    """:data:`PROCESSES` plain loops of ``n_envs / PROCESSES`` envs side by side, one process
    each (forked from this fresh interpreter), started together on a barrier."""
    from benchmarks.runs import CpuAccount

    ctx = multiprocessing.get_context("fork")
    start, out, finish = ctx.Barrier(PROCESSES + 1), ctx.Queue(), ctx.Event()
    per = n_envs // PROCESSES
    procs = [
        ctx.Process(
            target=_ceiling_child,
            args=(policy, i, per, warmup, seconds, start, out, finish),
            daemon=True,
        )
        for i in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    try:
        start.wait()
        account = CpuAccount()
        account.start()
        loops = [out.get(timeout=seconds + 600) for _ in procs]
        account.stop()
        errors = [err for _, _, err in loops if err]
        if errors:
            raise RuntimeError(f"a ceiling loop failed: {errors[0]}")
        runs = [loop for _, loop, _ in loops]
        rows = sum(r["rows"] for r in runs)
        return {
            "rows_per_s": sum(r["rows"] / r["wall"] for r in runs),
            "env_steps_per_s": sum(r["env_steps"] / r["wall"] for r in runs),
            "workers_cpu_us": 1e6 * sum(r["cpu"] for r in runs) / rows,
            "others_cores": (account.result or {}).get("foreign_cores"),
            "layout": f"{PROCESSES} plain loops of {per} envs, one process each",
        }
    finally:
        finish.set()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


# --------------------------------------------------------------------------------------------
# PufferLib


class _Skip(Exception):
    """The cell cannot run here; its message says why."""


def _puffer_env(buf: Any = None, seed: int = 0) -> Any:
    """PufferLib's emulation of one Pistonball env (its workers pass their buffers and seeds)."""
    import pufferlib.emulation

    return pufferlib.emulation.PettingZooPufferEnv(env_creator=make_env, buf=buf, seed=seed)


def _pufferlib(config: str, policy: str, warmup: float, seconds: float, n_envs: int) -> dict:
    """``pufferlib.vector.make`` in ``config``, stepped with ``recv()`` then ``send(actions)``
    (the loop of PufferLib's own trainer); counts the rows of envs that stepped (a row of an
    env PufferLib reset on that send is not a transition)."""
    from benchmarks.runs import CpuAccount

    try:
        import pufferlib
        import pufferlib.vector
    except Exception as exc:
        raise _Skip(
            f"pufferlib not importable ({type(exc).__name__}: {exc}); pip install --no-deps "
            "pufferlib-core (its wheel pulls another torch)"
        ) from exc
    backend, workers, share = PUFFER_CONFIGS[config]
    batch = max(1, int(n_envs * share))
    kwargs: dict[str, Any] = {}
    if backend == "Multiprocessing":
        kwargs = {"num_workers": workers, "batch_size": batch, "overwork": workers > 2}
    venv = pufferlib.vector.make(
        _puffer_env,
        backend=getattr(pufferlib.vector, backend),
        num_envs=n_envs,
        seed=0,
        **kwargs,
    )
    try:
        agents = venv.driver_env.num_agents
        rows_per_batch = venv.num_envs  # agents in one recv
        mlp = PistonMLP(venv.single_observation_space.shape) if policy == "mlp" else None
        drawn = np.random.default_rng(0).uniform(-1, 1, (256, rows_per_batch, 1))
        drawn = drawn.astype(np.float32)
        done = np.ones(n_envs, dtype=bool)  # every env's first recv is its reset
        venv.async_reset(0)
        turn = 0

        def step() -> tuple[int, int]:
            nonlocal turn
            obs, _, terms, truncs, _, _, ids, mask = venv.recv()
            env_ids = ids.reshape(-1, agents)[:, 0] // agents
            stepped = ~done[env_ids]
            live = mask.reshape(-1, agents)
            t = terms.reshape(-1, agents) | ~live
            u = truncs.reshape(-1, agents) | ~live
            done[env_ids] = t.all(axis=1) | u.all(axis=1)  # PettingZooPufferEnv.done
            actions = mlp.act(obs) if mlp is not None else drawn[turn & 255]
            turn += 1
            venv.send(actions)
            return int(live[stepped].sum()), int(stepped.sum())

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < warmup or turn < 2:
            step()
        account = CpuAccount()
        account.start()
        usage = _usage()
        rows = steps = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            r, s = step()
            rows, steps = rows + r, steps + s
        wall = time.perf_counter() - t0
        usage = _usage() - usage
        account.stop()
        cpu = account.result or {}
        shape = (
            f"Serial, {n_envs} envs in the caller"
            if backend == "Serial"
            else f"Multiprocessing, {workers} workers x {n_envs // workers} envs, batch_size="
            f"{batch} ({rows_per_batch} rows a recv)"
        )
        return {
            "rows_per_s": rows / wall,
            "env_steps_per_s": steps / wall,
            "main_cpu_us": 1e6 * cpu.get("main_cores", 0.0) * wall / max(rows, 1),
            **_usage_per_row(usage, rows),
            "workers_cpu_us": 1e6 * cpu.get("host_cores", 0.0) * wall / max(rows, 1),
            "others_cores": cpu.get("foreign_cores"),
            "layout": f"pufferlib {getattr(pufferlib, '__version__', '?')} {shape}",
        }
    finally:
        venv.close()


# --------------------------------------------------------------------------------------------
# RLlib


def _rllib(policy: str, warmup: float, seconds: float, n_envs: int) -> dict[str, Any]:
    try:
        import ray.rllib  # noqa: F401
    except Exception as exc:
        raise _Skip(
            f"ray.rllib not importable ({type(exc).__name__}: {exc}); not installable here: "
            f"{RLLIB_PIP}"
        ) from exc
    raise _Skip(
        "ray.rllib imports, but this study has no RLlib cell yet: it could not be written and "
        "tested where RLlib installs beside torch 2.13, numpy 2.4 and gymnasium 1.4"
    )


# --------------------------------------------------------------------------------------------
# Ours


async def _ours(
    inference: str,
    policy: str,
    warmup: float,
    seconds: float,
    n_envs: int,
    top: int = 0,
    call_steps: int = CALL_STEPS,
    stream: bool = False,
) -> dict[str, Any]:
    """Our sampler in ``inference`` mode; with ``top``, the caller under ``cProfile`` (CPU
    time) over the window, its ``top`` functions by own time in the row's ``profile``;
    ``stream``: the batches of ``sampler.stream(call, fragments=True)`` (sampling runs ahead
    while the trainer takes a batch, as an async trainer consumes it) instead of consecutive
    ``obtain_fragments`` calls."""
    import cProfile

    from asyncsample import Sampler
    from benchmarks.runs import CpuAccount

    if inference == "batched" and policy == "random":
        raise _Skip(
            "inference='batched' merges the workers' calls of one shared agent; the built-in "
            "random agent is one per worker"
        )
    env_fn = _env_fn()
    probe = env_fn()
    n_agents = len(probe.possible_agents)
    shape = probe.observation_space(probe.possible_agents[0]).shape
    probe.close()
    agent = {"default": PistonMLP(shape)} if policy == "mlp" else None
    per = n_envs // PROCESSES
    call = call_steps * n_envs * n_agents
    sampler = Sampler(
        env_fn,
        n_workers=PROCESSES,
        envs_per_worker=per,
        backend="process",
        inference=inference,
        agent=agent,
        seed=0,
    )
    async with sampler:
        batches = sampler.stream(call, fragments=True) if stream else None
        if batches is not None:
            nxt = batches.__anext__
        else:

            async def nxt() -> Any:
                return await sampler.obtain_fragments(call)

        t0 = time.perf_counter()
        await nxt()
        while time.perf_counter() - t0 < warmup:
            await nxt()
        profiler = cProfile.Profile(time.process_time) if top else None
        account = CpuAccount()  # this process tree (the caller, its hosts) and the others
        account.start()
        usage = _usage()
        if profiler is not None:
            profiler.enable()
        rows = steps = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            batch = await nxt()
            rows, steps = rows + batch.n_transitions, steps + batch.n_env_steps
        wall = time.perf_counter() - t0
        if profiler is not None:
            profiler.disable()
        if batches is not None:
            await batches.aclose()
        usage = _usage() - usage
        account.stop()
    cpu = account.result or {}
    out: dict[str, Any] = {}
    if profiler is not None:
        from benchmarks.seam import profile_rows

        out["profile"] = [
            {**r, "us_per_row": r["us_per_step"] * steps / max(rows, 1)}
            for r in profile_rows(profiler, top, steps)
        ]
    return {
        **out,
        "rows_per_s": rows / wall,
        "env_steps_per_s": steps / wall,
        "main_cpu_us": 1e6 * cpu.get("main_cores", 0.0) * wall / max(rows, 1),
        **_usage_per_row(usage, rows),
        "workers_cpu_us": 1e6 * cpu.get("host_cores", 0.0) * wall / max(rows, 1),
        "others_cores": cpu.get("foreign_cores"),
        "layout": f"{PROCESSES}x{per} process, inference={inference!r}, "
        + ("stream(fragments=True) of batches of " if stream else "calls of ")
        + f"{call:,} rows ({call_steps} steps of every env)",
        "inference": sampler.inference.describe(),
    }


def run_cell(
    name: str,
    policy: str,
    warmup: float,
    seconds: float,
    n_envs: int,
    top: int = 0,
    call_steps: int = CALL_STEPS,
) -> dict[str, Any]:
    """One cell's numbers, in this interpreter: a dict with ``rows_per_s``, or ``skipped`` (why
    the cell cannot run here); ``top``: profile an ``ours-*`` cell's caller (see :func:`_ours`).
    """
    try:
        if name == "ceiling":
            return _ceiling(policy, warmup, seconds, n_envs)
        if name == "plain":
            return _plain(policy, warmup, seconds, n_envs)
        if name.startswith("pufferlib-"):
            return _pufferlib(name.removeprefix("pufferlib-"), policy, warmup, seconds, n_envs)
        if name == "rllib":
            return _rllib(policy, warmup, seconds, n_envs)
        if name == "ours-stream":  # the agent in the hosts, batches of a stream
            return asyncio.run(
                _ours("host", policy, warmup, seconds, n_envs, top, call_steps, stream=True)
            )
        if name.startswith("ours-"):
            mode = name.removeprefix("ours-")
            return asyncio.run(_ours(mode, policy, warmup, seconds, n_envs, top, call_steps))
    except _Skip as why:
        return {"skipped": str(why)}
    raise ValueError(f"unknown cell {name!r}")


# --------------------------------------------------------------------------------------------
# The report


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _caller(runs: list[dict[str, Any]]) -> str:
    """The caller's CPU per row, with its system part in parentheses where measured."""
    cpu, system = _median(runs, "main_cpu_us"), _median(runs, "main_sys_us")
    return _num(cpu) + (f" ({system:,.0f})" if cpu is not None and system is not None else "")


def _measured(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if r.get("rows_per_s") is not None]


def _best(runs: dict[str, list[dict[str, Any]]], prefix: str) -> str | None:
    """The cell of ``prefix`` with the highest median rate, or None."""
    rates = {
        name: _median(_measured(cell), "rows_per_s")
        for name, cell in runs.items()
        if name.startswith(prefix) and _measured(cell)
    }
    return max(rates, key=lambda n: rates[n] or 0.0) if rates else None


def _disturbed(*rows: dict[str, Any]) -> bool:
    return any((r.get("others_cores") or 0.0) > DISTURBED for r in rows)


def _targets(runs: dict[str, list[dict[str, Any]]], policy: str) -> list[str]:
    ours, puffer = _best(runs, "ours-"), _best(runs, "pufferlib-")
    if ours is None:
        why = next((r.get("skipped") or r.get("error") for c, rs in runs.items()
                    if c.startswith("ours-") for r in rs), "not run")  # fmt: skip
        return [f"| ours / ceiling | - | - | >= {GOAL} | not measured: {why} |"]
    lines = []
    rate = _median(_measured(runs[ours]), "rows_per_s") or 0.0
    if runs.get("ceiling") and _measured(runs["ceiling"]):
        pairs = [
            (o["rows_per_s"] / c["rows_per_s"], _disturbed(o, c))
            for o, c in zip(runs[ours], runs["ceiling"])
            if o.get("rows_per_s") and c.get("rows_per_s")
        ]
        quiet = [r for r, bad in pairs if not bad] or [r for r, _ in pairs]
        value = statistics.median(quiet)
        shown = " ".join(f"{r:.2f}{' !' if bad else ''}" for r, bad in pairs)
        lines.append(
            f"| {ours} / ceiling | {value:.2f} | {shown} | >= {GOAL} | "
            f"{'yes' if value >= GOAL else 'no'} |"
        )
    if puffer is not None:
        peer = _median(_measured(runs[puffer]), "rows_per_s") or 0.0
        lines.append(
            f"| {ours} / best PufferLib ({puffer}) | {rate / peer:.2f} | - | > 1 | "
            f"{'yes' if rate > peer else 'no'} |"
        )
    rllib = runs.get("rllib", [])
    if rllib and _measured(rllib):
        peer = _median(_measured(rllib), "rows_per_s") or 0.0
        lines.append(
            f"| {ours} / RLlib | {rate / peer:.2f} | - | > 1 | {'yes' if rate > peer else 'no'} |"
        )
    elif rllib:
        lines.append("| ours / RLlib | - | - | > 1 | not measured: RLlib skipped (above) |")
    return lines


def _markdown(
    results: dict[str, dict[str, list[dict[str, Any]]]],
    meta: dict[str, Any],
    profiles: dict[str, dict[str, Any]] | None = None,
) -> str:
    lines = [
        "# Multi-agent: 64 Pistonball envs (`python -m benchmarks.multiagent`)",
        "",
        f"PettingZoo `butterfly/pistonball_v6` `parallel_env()` with its defaults (20 pistons, "
        f"each a (457, 120, 3) uint8 image and a Box(-1, 1, (1,)) action), {meta['n_envs']} envs: "
        f"{meta['n_envs'] * 20:,} agent transitions (rows) per joint step of every env. "
        "`ceiling`: the plain loop (`env.step({agent: action})` over its envs, then the policy "
        f"once on all its rows) in {PROCESSES} processes side by side; `plain`: one such loop; "
        "`pufferlib-*`: `PettingZooPufferEnv` in `pufferlib.vector.make` (each configuration "
        "tried); `rllib`: RLlib's multi-agent env runner; `ours-*`: `Sampler(pistonball_v6."
        f"parallel_env, n_workers={PROCESSES}, envs_per_worker={meta['n_envs'] // PROCESSES}, "
        "backend='process')` in that inference mode, consecutive `obtain_fragments` calls of "
        f"{meta['call_steps']} steps of every env. Each cell in a fresh interpreter, "
        f"{meta['warmup']:g} s of warm-up, then a {meta['seconds']:g} s window; "
        f"{meta['repeats']} interleaved repeats, medians. Commit `{meta['commit']}`, "
        f"{meta['cores']} cores, load average {meta['load'][0]:.1f}-{meta['load'][1]:.1f} "
        "during the run.",
        "",
        "CPU per agent transition: the caller's (`-` where the cell has none apart from its "
        "workers; in parentheses its part in the kernel) and its workers' (the ceiling's and "
        "plain's loops, PufferLib's worker processes, our env hosts); the caller's minor page "
        "faults per row (first touches of fresh pages: a newly allocated copy of a 164 KB "
        "observation makes about 41); `others`: the cores other processes used meanwhile (a "
        f"disturbed run when above {DISTURBED}). PufferLib's caller and workers busy-wait on "
        "shared flags between steps: their CPU per row counts those waits.",
    ]
    for policy, runs in results.items():
        ceiling = _median(_measured(runs.get("ceiling", [])), "rows_per_s")
        best = {_best(runs, "pufferlib-"), _best(runs, "ours-")}
        lines += [
            "",
            f"## {policy} agent ({AGENTS[policy]})",
            "",
            "| cell | layout | agent steps/s | env steps/s | of the ceiling | caller CPU "
            "us/row (system) | caller page faults/row | workers CPU us/row | others (cores) |",
            "|---|---|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for name, cell in runs.items():
            done = _measured(cell)
            if not done:
                why = next((r.get("skipped") or r.get("error") for r in cell), "")
                kind = "skipped" if any("skipped" in r for r in cell) else "error"
                lines.append(f"| {name} | {kind}: {why} | - | - | - | - | - | - | - |")
                continue
            rate = _median(done, "rows_per_s") or 0.0
            share = f"{rate / ceiling:.2f}" if ceiling else "-"
            mark = " (best)" if name in best else ""
            lines.append(
                f"| {name}{mark} | {done[0]['layout']} | {rate:,.0f} | "
                f"{_num(_median(done, 'env_steps_per_s'))} | {share} | "
                f"{_caller(done)} | {_num(_median(done, 'main_faults'))} | "
                f"{_num(_median(done, 'workers_cpu_us'))}"
                f" | {_num(_median(done, 'others_cores'), 2)} |"
            )
        lines += [
            "",
            f"### Targets (issue 52), {policy} agent",
            "",
            "Ours: its best cell by median. Per repeat, `!`: a pair where other processes took "
            f"more than {DISTURBED} cores during either run; the value is the median of the "
            "other pairs (of all when every pair was disturbed).",
            "",
            "| target | value | per repeat | goal | met |",
            "|---|--:|---|--:|---|",
            *_targets(runs, policy),
        ]
    for policy, prof in (profiles or {}).items():
        lines += ["", f"## Profile of the caller ({prof['cell']}, {policy} agent, by own time)", ""]
        if not prof.get("profile"):
            lines.append(f"not measured: {prof.get('skipped') or prof.get('error')}")
            continue
        lines += [
            f"`cProfile` (CPU time as its timer) over the window of a separate run "
            f"({prof['rows_per_s']:,.0f} agent steps/s under the profiler; caller "
            f"{prof['main_cpu_us']:,.1f} us of CPU per row).",
            "",
            "| function | calls | own s | cumulative s | own us per row |",
            "|---|--:|--:|--:|--:|",
        ]
        for r in prof["profile"]:
            lines.append(
                f"| `{r['function']}` | {r['ncalls']:,} | {r['tottime_s']:.3f} | "
                f"{r['cumtime_s']:.3f} | {_num(r['us_per_row'], 2)} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.multiagent", description=__doc__)
    parser.add_argument("--cells", nargs="+", choices=CELLS, default=list(DEFAULT_CELLS))
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=float, help="seconds before each window (5)")
    parser.add_argument("--seconds", type=float, help="each cell's window (15)")
    parser.add_argument("--envs", type=int, default=N_ENVS, help=f"envs in all ({N_ENVS})")
    parser.add_argument(
        "--call-steps",
        type=int,
        default=CALL_STEPS,
        help=f"joint steps of every env per obtain_fragments call of ours ({CALL_STEPS})",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the repeats, one more run of the first ours cell per agent with its caller "
        "under cProfile: where the caller's CPU per row goes",
    )
    parser.add_argument("--top", type=int, default=20, help="functions kept from the profile")
    parser.add_argument("--quick", action="store_true", help="short windows, one repeat")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if args.quick else 5.0)
    args.seconds = args.seconds if args.seconds is not None else (1.0 if args.quick else 15.0)
    if args.quick:
        args.repeats = 1
    if args.envs % (4 * PROCESSES):
        parser.error(f"--envs must be a multiple of {4 * PROCESSES}")
    if args.cell:  # a cell in this fresh interpreter: its numbers as JSON on stdout
        top = args.top if args.profile else 0
        row = run_cell(
            args.cell, args.policies[0], args.warmup, args.seconds, args.envs, top, args.call_steps
        )
        print(json.dumps(row))
        return 0
    results: dict[str, dict[str, list[dict[str, Any]]]] = {p: {} for p in args.policies}
    load = [os.getloadavg()[0]]
    root = Path(__file__).resolve().parent.parent
    for _ in range(args.repeats):
        for policy in args.policies:
            for name in args.cells:
                row = _fresh(root, name, policy, args)
                row["load"] = os.getloadavg()[0]
                load.append(row["load"])
                results[policy].setdefault(name, []).append(row)
                shown = (
                    f"{row['rows_per_s']:,.0f} agent steps/s" if "rows_per_s" in row
                    else f"{'skipped' if 'skipped' in row else 'error'}: "
                    f"{row.get('skipped') or row.get('error')}"
                )  # fmt: skip
                print(f"multiagent: {policy} {name} {shown}", file=sys.stderr, flush=True)
    profiles: dict[str, dict[str, Any]] = {}
    ours = [name for name in args.cells if name.startswith("ours-")]
    if args.profile and ours:
        for policy in args.policies:
            row = _fresh(root, ours[0], policy, args, profile=True)
            profiles[policy] = {"cell": ours[0], **row}
            print(f"multiagent: {policy} {ours[0]} profiled", file=sys.stderr, flush=True)
    from benchmarks.report import _commit

    meta = {
        "env": f"pettingzoo.butterfly.{ENV_NAME}.parallel_env()",
        "n_envs": args.envs,
        "call_steps": args.call_steps,
        "warmup": args.warmup,
        "seconds": args.seconds,
        "repeats": args.repeats,
        "commit": _commit(),
        "cores": os.cpu_count(),
        "load": [min(load), max(load)],
    }
    result = {
        "study": "multiagent", **meta, "rllib_pip": RLLIB_PIP, "runs": results,
        "profiles": profiles,
    }  # fmt: skip
    write_own_results(args.out, result, _markdown(results, meta, profiles))
    return 0


def _fresh(
    root: Path, name: str, policy: str, args: argparse.Namespace, profile: bool = False
) -> dict[str, Any]:
    """One cell in a fresh interpreter: its JSON row (with the interpreter's whole run in
    ``cell_seconds``), or ``{"error": ...}`` with the last line of its stderr."""
    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.multiagent", "--cell", name, "--policies", policy,
             "--warmup", str(args.warmup), "--seconds", str(args.seconds),
             "--envs", str(args.envs), "--top", str(args.top),
             "--call-steps", str(args.call_steps),
             *(["--profile"] if profile else [])],
            capture_output=True, text=True, check=False, timeout=900, cwd=root,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 900 s"}
    if done.returncode != 0 or not done.stdout.strip():
        tail = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return {"error": tail[-1] if tail else f"exit status {done.returncode}"}
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    row["cell_seconds"] = time.perf_counter() - t0
    return row


if __name__ == "__main__":
    raise SystemExit(main())
