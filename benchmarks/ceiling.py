"""The machine's ceiling: independent loops side by side, one per core, nothing between them.

The best a user gets on ``cores`` cores without any sampler library is ``cores`` processes that
each run their own loop: for a random agent, a plain single-env ``env.step`` loop per process;
for a policy workload, ``SyncVectorEnv(n_envs / cores)`` plus the policy per process (a policy's
cost is per call, so each loop keeps its share of the envs in one batch). Every study runs this
as the ``ceiling`` contender in the same run as the others, so each ratio can be read against
what the machine allows, not only against the peers.

The loops warm up, wait on one barrier, then each runs for at least its share of the
transitions and at least ``min_seconds``; the rate is the sum of the loops' own rates (each
loop's transitions over its own timed seconds), so a loop that finishes first does not wait
for the other.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import gymnasium as gym

from benchmarks.runs import RunResult, RunSpec, TimedPhase

__all__ = ["ceiling"]

#: Seeds of the loops are ``spec.seed + SEED_STRIDE * index``: no two loops share a stream.
SEED_STRIDE = 1000


def _random_loop(
    spec: RunSpec, seed: int, warmup: int, target: int, start: Any
) -> tuple[int, float]:
    """One env in a plain ``env.step`` loop with pre-drawn actions; returns (steps, seconds)."""
    env = gym.make(spec.env_id)
    try:
        env.reset(seed=seed)
        env.action_space.seed(seed)
        acts = [env.action_space.sample() for _ in range(1024)]
        step = 0

        def loop(n: int) -> None:
            nonlocal step
            for _ in range(n):
                _, _, term, trunc, _ = env.step(acts[step & 1023])
                step += 1
                if term or trunc:
                    env.reset()

        loop(warmup)
        start.wait()
        done = 0
        t0 = time.perf_counter()
        while done < target or time.perf_counter() - t0 < spec.min_seconds:
            n = min(256, target - done) if done < target else 16  # renders: ~70 ms a step
            loop(n)
            done += n
        return done, time.perf_counter() - t0
    finally:
        env.close()


def _policy_loop(
    spec: RunSpec, n_envs: int, seed: int, warmup: int, target: int, start: Any
) -> tuple[int, float]:
    """``SyncVectorEnv(n_envs)`` driven by the policy's MLP; returns (transitions, seconds)."""
    from gymnasium.vector import AutoresetMode

    from benchmarks.policies import make_policy

    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.make(spec.env_id)] * n_envs, autoreset_mode=AutoresetMode.SAME_STEP
    )
    try:
        policy = make_policy(spec.policy, spec.env_id, seed=seed)  # one torch thread
        obs, _ = envs.reset(seed=seed)
        warm = 0
        while warm < warmup:
            obs = envs.step(policy.act(obs))[0]
            warm += n_envs
        start.wait()
        done = 0
        t0 = time.perf_counter()
        while done < target or time.perf_counter() - t0 < spec.min_seconds:
            obs = envs.step(policy.act(obs))[0]
            done += n_envs
        return done, time.perf_counter() - t0
    finally:
        envs.close()


def _child(spec: RunSpec, index: int, parts: int, start: Any, out: Any, finish: Any) -> None:
    """A loop process: runs its loop, puts ``(index, transitions, seconds, error)`` on ``out``."""
    try:
        seed = spec.seed + SEED_STRIDE * index
        warmup = max(1, spec.warmup // parts)
        target = max(1, spec.n_transitions // parts)
        if spec.policy:
            n_envs = max(1, spec.n_envs // parts)
            done, seconds = _policy_loop(spec, n_envs, seed, warmup, target, start)
        else:
            done, seconds = _random_loop(spec, seed, warmup, target, start)
        out.put((index, done, seconds, None))
        finish.wait(60)  # alive until the parent's timed phase ends: its CPU is counted
    except BaseException as exc:  # the parent reports it; a child never dies silently
        start.abort()
        out.put((index, 0, 0.0, f"{type(exc).__name__}: {exc}"))


def ceiling(spec: RunSpec) -> RunResult:
    """``spec.cores`` independent loops side by side in as many processes (see the module doc).

    Args:
        spec: The run: a random agent gives one env per loop; ``spec.policy`` gives
            ``SyncVectorEnv(spec.n_envs / spec.cores)`` plus the policy per loop.

    Returns:
        The summed rate as a :class:`~benchmarks.contenders.RunResult` (``transitions`` over
        the ``seconds`` that make their ratio the sum of the loops' rates).
    """
    parts = max(1, spec.cores)
    ctx = multiprocessing.get_context("fork")  # a fresh run process: nothing to inherit
    start = ctx.Barrier(parts + 1)
    out = ctx.Queue()
    finish = ctx.Event()
    procs = [
        ctx.Process(target=_child, args=(spec, i, parts, start, out, finish), daemon=True)
        for i in range(parts)
    ]
    for proc in procs:
        proc.start()
    try:
        start.wait()
        with TimedPhase(spec) as phase:
            loops = [out.get() for _ in procs]
        finish.set()
        errors = [err for *_, err in loops if err]
        if errors:
            raise RuntimeError(f"a ceiling loop failed: {errors[0]}")
        transitions = sum(done for _, done, _, _ in loops)
        rate = sum(done / seconds for _, done, seconds, _ in loops if seconds > 0)
        shape = f"SyncVectorEnv({max(1, spec.n_envs // parts)}) + policy"
        note = f"{parts} loops of {shape if spec.policy else 'one env'}, one process each"
        result = phase.result(transitions, notes=[note])
        result.seconds = transitions / rate if rate > 0 else phase.seconds
        return result
    except threading.BrokenBarrierError as exc:
        loops = [out.get(timeout=5) for _ in procs]
        errors = [err for *_, err in loops if err]
        raise RuntimeError(f"a ceiling loop failed: {errors[0] if errors else exc}") from exc
    finally:
        finish.set()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
