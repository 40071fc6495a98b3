"""The ``async_envs`` cells outside one event loop, and the dispatch of a cell to its runner.

``gym-async`` (gymnasium's ``AsyncVectorEnv``, lockstep), the ``ceiling`` (``plain-asyncio`` in
a process per core, one timed window) and ``torchrl-asyncio`` (TorchRL's ``AsyncEnvPool``,
where it builds); :func:`run_cell` runs any contender, :func:`outcome_of` reports how it ended
and :func:`run_file` is the fresh cell process's entry point.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import json
import multiprocessing
import time
import traceback
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from benchmarks.async_envs_cells import (
    CONTENDERS,
    SEED_STRIDE,
    CellResult,
    CellSpec,
    Refused,
    Unavailable,
    _call_budget_ok,
    _loop_factory,
    children_cpu,
    run_ours,
    run_tasks,
    tree_rss,
)
from benchmarks.latency_envs import _LatencyCore, make_env

__all__ = ["outcome_of", "run_cell", "run_ceiling", "run_file", "run_gym_async", "run_torchrl"]


def run_gym_async(spec: CellSpec) -> CellResult:
    """gymnasium ``AsyncVectorEnv`` of the blocking env: lockstep, one process per env.

    No event loop (a blocking vector env): no lag. A call of N episodes is ``episode_length``
    lockstep steps.
    """
    result = CellResult()
    if spec.n_envs < spec.n_episodes:
        result.notes.append(
            f"{spec.n_envs} envs, not {spec.n_episodes}: a process per env; the ratio is "
            f"against the ideal of {spec.n_episodes} episodes"
        )
    result.rss_before = tree_rss()
    t0 = time.perf_counter()
    env_fn = functools.partial(make_env, True, **spec.env_kwargs())
    venv = gym.vector.AsyncVectorEnv(
        [env_fn] * spec.n_envs,
        shared_memory=True,
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    try:
        venv.reset(seed=spec.seed)
        result.start_s = time.perf_counter() - t0
        rng = np.random.default_rng(spec.seed)

        def step() -> None:
            venv.step(rng.integers(0, 2, size=spec.n_envs))

        end = time.perf_counter() + spec.warmup_s
        while time.perf_counter() < end:
            step()
        result.rss_open = tree_rss()
        iters = 0
        c0, h0, t0 = time.process_time(), children_cpu(), time.perf_counter()
        while time.perf_counter() - t0 < spec.seconds:
            step()
            iters += 1
        result.cpu_s = time.process_time() - c0
        result.host_cpu_s = children_cpu() - h0
        result.seconds = time.perf_counter() - t0
        result.steps = iters * spec.n_envs
        if _call_budget_ok(spec, result):
            for _ in range(spec.calls):
                t0 = time.perf_counter()
                for _ in range(spec.episode_length):
                    step()
                result.calls.append(time.perf_counter() - t0)
                result.call_steps.append(spec.episode_length * spec.n_envs)
    finally:
        venv.close()
    return result


def _ceiling_child(spec: CellSpec, index: int, share: int, start: Any, out: Any) -> None:
    """One loop of the ceiling: ``share`` plain asyncio tasks, timed in the shared window."""
    try:
        sub = dataclasses.replace(
            spec, contender="plain-asyncio", n_episodes=share, calls=0,
            seed=spec.seed + SEED_STRIDE * index,
        )  # fmt: skip
        with asyncio.Runner(loop_factory=_loop_factory(spec.loop)) as runner:
            result = runner.run(run_tasks(sub, start))
        out.put((index, dataclasses.asdict(result), None))
    except BaseException as exc:  # the parent reports it; a loop never dies silently
        with contextlib.suppress(Exception):
            start.abort()
        out.put((index, None, f"{type(exc).__name__}: {exc}"))


def run_ceiling(spec: CellSpec) -> CellResult:
    """The machine's ceiling for async envs: ``plain-asyncio`` in ``cores`` processes side by
    side (``N / cores`` episodes each), one timed window for all (a barrier), steps summed.

    The caller only waits (its CPU is not counted): the loops' CPU is the hosts' CPU; the loop
    lag is the worst loop's p50 and p99; the memory is the loops' growth over N.
    """
    parts = min(spec.n_cores, spec.n_episodes)
    shares = [spec.n_episodes // parts + (i < spec.n_episodes % parts) for i in range(parts)]
    ctx = multiprocessing.get_context("fork")  # a fresh cell process: nothing to inherit
    start, out = ctx.Barrier(parts), ctx.Queue()
    procs = [
        ctx.Process(target=_ceiling_child, args=(spec, i, n, start, out), daemon=True)
        for i, n in enumerate(shares)
    ]
    for proc in procs:
        proc.start()
    try:
        wait = 120.0 + spec.warmup_s + 2 * spec.seconds
        loops = [out.get(timeout=wait) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    errors = [err for _, _, err in loops if err]
    if errors:
        raise RuntimeError(f"a ceiling loop failed: {errors[0]}")
    parts_ = [CellResult(**fields) for _, fields, _ in sorted(loops, key=lambda x: x[0])]
    result = CellResult(idle_lag=parts_[0].idle_lag)
    result.steps = sum(r.steps for r in parts_)
    rate = sum(r.steps / r.seconds for r in parts_ if r.seconds > 0)
    result.seconds = result.steps / rate if rate > 0 else max(r.seconds for r in parts_)
    result.host_cpu_s = sum(
        max(0.0, r.cpu_s - (r.idle_lag.get("probe_cpu_share") or 0.0) * r.seconds) for r in parts_
    )
    result.idle_lag = {}  # the caller runs no probe: nothing to subtract from its (zero) CPU
    result.rss_before = sum(r.rss_before for r in parts_)
    result.rss_open = sum(r.rss_open for r in parts_)
    result.start_s = max(r.start_s for r in parts_)
    lags = [r.lag for r in parts_ if r.lag.get("n")]
    if lags:
        result.lag = {
            "n": sum(lag["n"] for lag in lags),
            **{k: max(lag[k] for lag in lags) for k in ("p50_ms", "p99_ms", "max_ms")},
        }
    result.notes.append(
        f"{parts} processes of plain asyncio tasks ({'/'.join(map(str, shares))} episodes), "
        "one timed window, steps summed; lag: the worst loop's"
    )
    return result


def _torchrl_env(kwargs: dict[str, Any]) -> Any:
    """The blocking latency env as a TorchRL ``GymWrapper`` (integer actions)."""
    from torchrl.envs import GymWrapper

    return GymWrapper(make_env(True, **kwargs), categorical_action_encoding=True)


def run_torchrl(spec: CellSpec, backend: str = "asyncio") -> CellResult:
    """TorchRL's ``AsyncEnvPool(backend=backend)`` of the blocking latency env, where it exists.

    TorchRL 0.14.1 (the ``bench`` extra's) declares ``backend="asyncio"`` but raises
    ``NotImplementedError`` for it: the cell then records the peer as unavailable. Where it
    builds, the pool is driven as its docs show an asynchronous pool: every env sent a step,
    then each ``async_step_and_maybe_reset_recv(min_get=1)`` returns the envs that are done and
    sends them their next random action. The pool's API blocks: no event loop, no lag, no call
    durations. (The tests drive the same code with ``backend="threading"``.)
    """
    try:
        import torch
        import torchrl
        from torchrl.envs import AsyncEnvPool
    except Exception as exc:
        raise Unavailable(f"torchrl not importable ({type(exc).__name__}: {exc})") from exc
    result = CellResult(rss_before=tree_rss())
    t0 = time.perf_counter()
    maker = functools.partial(_torchrl_env, spec.env_kwargs())
    try:
        pool = AsyncEnvPool([maker] * spec.n_envs, backend=backend)
    except NotImplementedError as exc:
        raise Unavailable(
            f"torchrl {torchrl.__version__}: AsyncEnvPool(backend={backend!r}) raises "
            f"NotImplementedError{(': ' + str(exc)) if str(exc) else ''}"
        ) from exc
    try:
        gen = torch.Generator().manual_seed(spec.seed)
        roots = pool.reset()
        roots["action"] = torch.randint(0, 2, (spec.n_envs,), generator=gen)
        pool.async_step_and_maybe_reset_send(roots)
        result.start_s = time.perf_counter() - t0

        def pump(seconds: float) -> None:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                _, nxt = pool.async_step_and_maybe_reset_recv(min_get=1)
                nxt["action"] = torch.randint(0, 2, (nxt.batch_size[0],), generator=gen)
                index = [int(i) for i in nxt["env_index"]]
                pool.async_step_and_maybe_reset_send(nxt, env_index=index)

        pump(spec.warmup_s)
        result.rss_open = tree_rss()
        s0, c0, h0, t0 = (
            _LatencyCore.count(),
            time.process_time(),
            children_cpu(),
            time.perf_counter(),
        )
        pump(spec.seconds)
        result.steps = _LatencyCore.count() - s0
        result.cpu_s, result.seconds = time.process_time() - c0, time.perf_counter() - t0
        result.host_cpu_s = max(0.0, children_cpu() - h0)
        pool.async_step_and_maybe_reset_recv(min_get=spec.n_envs)  # every step in flight ends
        result.notes.append(f"AsyncEnvPool(backend={backend!r}), torchrl {torchrl.__version__}")
    finally:
        pool.close()
    return result


def run_cell(spec: CellSpec) -> dict[str, Any]:
    """Run one cell in this process; return its numbers (see :meth:`CellResult.finish`)."""
    if spec.contender == "gym-async":
        return run_gym_async(spec).finish(spec)
    if spec.contender == "ceiling":
        return run_ceiling(spec).finish(spec)
    if spec.contender == "torchrl-asyncio":
        return run_torchrl(spec).finish(spec)
    if spec.contender.startswith("pool-") or spec.contender == "plain-asyncio":
        coro: Callable[[CellSpec], Awaitable[CellResult]] = run_tasks
    elif spec.contender.startswith("ours-"):
        coro = run_ours
    else:
        raise ValueError(f"unknown contender {spec.contender!r}; expected one of {CONTENDERS}")
    with asyncio.Runner(loop_factory=_loop_factory(spec.loop)) as runner:
        return runner.run(coro(spec)).finish(spec)  # type: ignore[arg-type]


def outcome_of(spec: CellSpec) -> dict[str, Any]:
    """``{"status": "ok", ...numbers}`` of a run, or ``{"status": "refused"|"unavailable"|
    "error", "note": ...}``."""
    try:
        return {"status": "ok", **run_cell(spec)}
    except Refused as exc:
        return {"status": "refused", "note": f"refused: {exc}"}
    except Unavailable as exc:
        return {"status": "unavailable", "note": f"not available: {exc}"}
    except Exception as exc:  # report every failure instead of dying silently
        return {
            "status": "error",
            "note": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=20),
        }


def run_file(spec_path: str, out_path: str) -> int:
    """The child's entry point: run the :class:`CellSpec` in ``spec_path``, write the outcome."""
    warnings.simplefilter("ignore")
    spec = CellSpec(**json.loads(Path(spec_path).read_text()))
    if spec.gc_threshold:
        gc.set_threshold(*spec.gc_threshold)
    Path(out_path).write_text(json.dumps(outcome_of(spec)))
    return 0
