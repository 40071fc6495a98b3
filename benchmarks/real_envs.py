"""Real envs against the strongest peer: Atari and MuJoCo vs EnvPool, and how the cost grows.

``python -m benchmarks.real_envs`` runs three groups, each run in a fresh process:

``ideal``
    One env in a plain single-process ``env.step`` loop with the same wrappers every gymnasium
    contender uses (and EnvPool's own env with one env and one thread, for reference). The
    ideal of every contender is ``cores`` x the gymnasium rate.
``main``
    ``ALE/Pong-v5``, ``ALE/Breakout-v5`` (standard Atari preprocessing: the ALE env at
    ``frameskip=1`` under gymnasium's ``AtariPreprocessing`` with frame skip 4, 84x84 gray,
    noop 30, then ``FrameStackObservation(4)``), ``HalfCheetah-v5`` and ``Humanoid-v5``, each
    with a random agent and with a torch policy in the loop (Nature-CNN for Atari, MLP 64x64
    tanh Gaussian for MuJoCo; one torch thread per process). Contenders: EnvPool (sync, and
    async with ``batch_size < num_envs``), gymnasium ``SyncVectorEnv``/``AsyncVectorEnv``
    (shared memory), SB3 ``SubprocVecEnv`` and asyncsample (process backend) in each
    ``inference`` mode: ``per_worker``, ``batched`` and ``host`` (layouts: :class:`Settings`).
``sweep``
    CartPole-v1 and Pong-v5 with 8..512 envs: steps/s, main-process CPU share, the PSS of
    every process (and of the shared memory), event-loop lag (asyncsample) or the longest
    blocking call (peers), and the pool's start-up time; asyncsample ``per_worker`` and
    ``host``. Each run's timeout grows with its env count (512 Pong envs take minutes to
    start).
``footprint``
    The PSS one env adds to a process by itself, against which the pools' growth is set.

``--plan`` prints the runs and the estimated length; ``--envs``, ``--contenders``,
``--groups``, ``--sweep-envs`` and ``--sweep-n`` run a subset, e.g.
``--groups main --envs Pong-v5 --contenders asyncsample-host``.

Every run records ``os.getloadavg()``; contenders are interleaved within each repeat so a
busy spell of the (shared) machine hits all of them alike. Results go to
``benchmarks/results/real_envs/results.{json,md}`` and PNG charts beside them.

EnvPool and gymnasium do not run the same code: EnvPool's Atari and MuJoCo envs are its own C++
ports (with its own resize and frame stack); gymnasium's are ale-py and mujoco driven by Python
wrappers. EnvPool is configured to match (no fire reset, no sticky actions, noop 30, no episodic
life, no reward clipping); its single-env rate is measured too, so the difference in the envs'
own cost is visible next to the difference in the pools.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import psutil

from benchmarks._runner import REPO_ROOT, run_fresh
from benchmarks.contenders import RunSpec, TimedPhase
from benchmarks.fmt import f as _f
from benchmarks.fmt import k as _k
from benchmarks.fmt import mb as _mb
from benchmarks.fmt import pct as _pct
from benchmarks.fmt import table as _table
from benchmarks.fmt import x as _x

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


# --------------------------------------------------------------------------------------------
# Envs


@dataclass(frozen=True)
class EnvInfo:
    """How each library names and builds one benchmark env.

    Attributes:
        family: ``"atari"``, ``"mujoco"`` or ``"classic"``.
        gym_id: The gymnasium id (ale-py's for Atari).
        envpool_id: EnvPool's task id.
        frame_skip: Emulator frames per agent step (4 for Atari, else 1).
    """

    family: str
    gym_id: str
    envpool_id: str
    frame_skip: int = 1


ENVS: dict[str, EnvInfo] = {
    "Pong-v5": EnvInfo("atari", "ALE/Pong-v5", "Pong-v5", 4),
    "Breakout-v5": EnvInfo("atari", "ALE/Breakout-v5", "Breakout-v5", 4),
    "HalfCheetah-v5": EnvInfo("mujoco", "HalfCheetah-v5", "HalfCheetah-v5"),
    "Humanoid-v5": EnvInfo("mujoco", "Humanoid-v5", "Humanoid-v5"),
    "CartPole-v1": EnvInfo("classic", "CartPole-v1", "CartPole-v1"),
}
MAIN_ENVS = ["Pong-v5", "Breakout-v5", "HalfCheetah-v5", "Humanoid-v5"]
SWEEP_ENVS = ["CartPole-v1", "Pong-v5"]

#: EnvPool options that make its Atari env match gymnasium's AtariPreprocessing stack.
ENVPOOL_ATARI = {
    "use_fire_reset": False,
    "repeat_action_probability": 0.0,
    "noop_max": 30,
    "episodic_life": False,
    "reward_clip": False,
    "stack_num": 4,
    "frame_skip": 4,
    "img_height": 84,
    "img_width": 84,
    "gray_scale": True,
}


def make_env(name: str) -> gym.Env[Any, Any]:
    """Build one env the way gymnasium, SB3 and asyncsample users build it.

    Atari: ``gym.make(id, frameskip=1, repeat_action_probability=0)`` under
    ``AtariPreprocessing(noop_max=30, frame_skip=4, screen_size=84, grayscale_obs=True)`` and
    ``FrameStackObservation(4)``: observations ``(4, 84, 84)`` uint8, as EnvPool's.

    Args:
        name: A key of :data:`ENVS`.

    Returns:
        The env (module-level function: ``functools.partial(make_env, name)`` pickles).
    """
    info = ENVS[name]
    if info.family != "atari":
        return gym.make(info.gym_id)
    import ale_py
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    gym.register_envs(ale_py)
    env = gym.make(
        info.gym_id,
        frameskip=1,
        repeat_action_probability=0.0,
        full_action_space=False,
        max_num_frames_per_episode=108_000,
    )
    env = AtariPreprocessing(
        env,
        noop_max=30,
        frame_skip=4,
        screen_size=84,
        terminal_on_life_loss=False,
        grayscale_obs=True,
        scale_obs=False,
    )
    return FrameStackObservation(env, 4)


def env_factory(name: str) -> Callable[[], gym.Env[Any, Any]]:
    """A picklable zero-argument factory of :func:`make_env`."""
    return functools.partial(make_env, name)


# --------------------------------------------------------------------------------------------
# Policies (torch is imported lazily: env hosts never load it)


def _torch_one_thread() -> Any:
    import torch

    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    return torch


def make_policy(name: str, seed: int = 0) -> Any:
    """A :class:`~asyncsample.torch_agent.TorchAgent` for ``name``: Nature-CNN or MLP 64x64.

    Atari: the Nature-CNN (conv 32x8x8/4, 64x4x4/2, 64x3x3/1, dense 512) with a categorical
    head, uint8 frames scaled by 1/255 inside the module. MuJoCo and classic control: an MLP
    64x64 tanh with a state-independent log-std (Gaussian) or logits (Discrete). The same agent
    object drives every contender, so the policy's cost is the same for all.

    Args:
        name: A key of :data:`ENVS`.
        seed: Seed of the weights and of the sampling generator.

    Returns:
        The agent (``get_actions(obs) -> (actions, infos)``).
    """
    torch = _torch_one_thread()
    from torch import nn

    from asyncsample.torch_agent import TorchAgent

    torch.manual_seed(seed)
    env = make_env(name)
    try:
        obs_space, act_space = env.observation_space, env.action_space
    finally:
        env.close()
    module: nn.Module
    if ENVS[name].family == "atari":
        assert isinstance(act_space, gym.spaces.Discrete)

        class NatureCNN(nn.Module):
            def __init__(self, n_actions: int) -> None:
                super().__init__()
                self.net = nn.Sequential(
                    nn.Conv2d(4, 32, 8, stride=4),
                    nn.ReLU(),
                    nn.Conv2d(32, 64, 4, stride=2),
                    nn.ReLU(),
                    nn.Conv2d(64, 64, 3, stride=1),
                    nn.ReLU(),
                    nn.Flatten(),
                    nn.Linear(64 * 7 * 7, 512),
                    nn.ReLU(),
                    nn.Linear(512, n_actions),
                )

            def forward(self, x: Any) -> Any:
                return self.net(x.float() / 255.0)

        module = NatureCNN(int(act_space.n))
    else:
        obs_dim = int(np.prod(obs_space.shape or (1,)))
        discrete = isinstance(act_space, gym.spaces.Discrete)
        out = int(act_space.n) if discrete else int(np.prod(act_space.shape or (1,)))  # type: ignore[attr-defined]

        class MLP(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.net = nn.Sequential(
                    nn.Linear(obs_dim, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                    nn.Linear(64, out),
                )  # fmt: skip
                self.log_std = nn.Parameter(torch.zeros(out))

            def forward(self, x: Any) -> Any:
                return self.net(x.reshape(x.shape[0], -1))

        module = MLP()
    module.eval()
    return TorchAgent(module, act_space, seed=seed)


# --------------------------------------------------------------------------------------------
# One run


CONTENDER_LABELS: dict[str, str] = {
    "ideal": "plain env.step loop (1 process, gymnasium wrappers)",
    "ideal-parallel": "plain env.step loops side by side (one process per core)",
    "ideal-envpool": "EnvPool, 1 env, 1 thread",
    "envpool-sync": "EnvPool sync",
    "envpool-async": "EnvPool async",
    "sync": "gymnasium SyncVectorEnv",
    "async": "gymnasium AsyncVectorEnv (shm)",
    "sb3": "SB3 SubprocVecEnv",
    "asyncsample": "asyncsample per_worker",
    "asyncsample-batched": "asyncsample batched",
    "asyncsample-host": "asyncsample host",
}
PEERS = ["envpool-sync", "envpool-async", "sync", "async", "sb3"]
OURS = ["asyncsample", "asyncsample-batched", "asyncsample-host"]
#: ``Sampler(inference=...)`` of each asyncsample contender (all on the process backend).
INFERENCE = {"asyncsample": "per_worker", "asyncsample-batched": "batched",
             "asyncsample-host": "host"}  # fmt: skip


class Skip(Exception):
    """The run cannot happen here (missing library or feature)."""


@dataclass
class RealSpec:
    """One run.

    Attributes:
        contender: A key of :data:`CONTENDER_LABELS`.
        env: A key of :data:`ENVS`.
        n_envs: Env copies.
        policy: Drive the envs with the torch policy (else a seeded random agent).
        n_transitions: Timed agent steps (at least; real transitions, resets excluded).
        warmup: Untimed agent steps first.
        seed: Seed of envs and agent.
        n_workers: asyncsample workers.
        envs_per_worker: asyncsample envs per worker.
        n_processes: asyncsample env-host processes.
        cores: The CPU budget (EnvPool threads).
        batch_size: EnvPool async ``batch_size``.
        fragment_steps: asyncsample steps per env per ``obtain_fragments`` call.
        min_seconds: The timed phase lasts at least this long.
        memory: Read the PSS of every process at the end of the timed phase.
    """

    contender: str
    env: str
    n_envs: int
    policy: bool = False
    n_transitions: int = 2000
    warmup: int = 200
    seed: int = 0
    n_workers: int = 1
    envs_per_worker: int = 1
    n_processes: int = 2
    cores: int = 2
    batch_size: int = 0
    fragment_steps: int = 16
    min_seconds: float = 1.0
    memory: bool = True

    @property
    def layout(self) -> str:
        """``WxK/PN`` for asyncsample, ``bB`` for EnvPool async, else empty."""
        if self.contender in OURS:
            return f"{self.n_workers}x{self.envs_per_worker}/P{self.n_processes}"
        if self.contender == "envpool-async":
            return f"b{self.batch_size}"
        return ""

    @property
    def key(self) -> str:
        """Unique id of the config (repeats share it)."""
        agent = "policy" if self.policy else "random"
        return f"{self.contender}|{self.env}|{self.n_envs}|{agent}|{self.layout}"

    def timed(self) -> RunSpec:
        """The :class:`RunSpec` that :class:`TimedPhase` reads."""
        return RunSpec(
            contender=self.contender,
            env=self.env,
            env_id=ENVS[self.env].gym_id,
            n_envs=self.n_envs,
            n_transitions=self.n_transitions,
            warmup=self.warmup,
            seed=self.seed,
            cores=self.cores,
            instrument=False,
            min_seconds=self.min_seconds,
        )


def pss_tree(root: psutil.Process | None = None) -> dict[str, Any]:
    """PSS of ``root`` (default: this process) and of each descendant, in bytes.

    PSS splits shared pages among the processes that map them, so the sum is what the tree
    really costs (RSS double-counts the copy-on-write pages of forked children). ``*_shm_pss``
    is the part in ``/dev/shm`` mappings: multiprocessing's shared arenas, which hold
    asyncsample's step and chunk buffers (and AsyncVectorEnv's shared observations).
    """
    root = root or psutil.Process(os.getpid())
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        procs = [root]
    children: list[int] = []
    main = main_shm = children_shm = 0
    for proc in procs:
        try:
            pss = int(getattr(proc.memory_full_info(), "pss", 0))
            shm = sum(int(m.pss) for m in proc.memory_maps(grouped=True)
                      if m.path.startswith("/dev/shm/"))  # fmt: skip
        except (psutil.Error, OSError):
            continue
        if proc.pid == root.pid:
            main, main_shm = pss, shm
        else:
            children.append(pss)
            children_shm += shm
    return {
        "main_pss": main,
        "children_pss": sum(children),
        "n_children": len(children),
        "children_pss_max": max(children, default=0),
        "total_pss": main + sum(children),
        "main_shm_pss": main_shm,
        "children_shm_pss": children_shm,
        "shm_pss": main_shm + children_shm,
    }


class CpuSplit:
    """CPU seconds of this process and of its descendants over a phase (main-process share)."""

    def __init__(self) -> None:
        """Create the account; call :meth:`start` and :meth:`stop`."""
        self._me = psutil.Process(os.getpid())
        self._main0 = 0.0
        self._kids0: dict[int, float] = {}
        self._t0 = 0.0
        self.result: dict[str, float] = {}

    def _kids(self) -> dict[int, float]:
        out: dict[int, float] = {}
        with contextlib.suppress(psutil.Error):
            for proc in self._me.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    t = proc.cpu_times()
                    out[proc.pid] = t.user + t.system
        return out

    def _main(self) -> float:
        t = self._me.cpu_times()
        return float(t.user + t.system)

    def start(self) -> None:
        """Snapshot the counters."""
        self._main0, self._kids0, self._t0 = self._main(), self._kids(), time.perf_counter()

    def stop(self) -> None:
        """Snapshot again: cores used by the main process and by the children."""
        wall = time.perf_counter() - self._t0
        main = self._main() - self._main0
        kids = sum(c - self._kids0.get(pid, 0.0) for pid, c in self._kids().items())
        total = main + kids
        self.result = {
            "main_cores": main / wall,
            "children_cores": kids / wall,
            "main_share": main / total if total > 0 else float("nan"),
        }


class Blocking:
    """Durations of the calls that would block an event loop (the peers' step calls)."""

    def __init__(self) -> None:
        """Start empty."""
        self.durations: list[float] = []

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Time one call."""
        t = time.perf_counter()
        yield
        self.durations.append(time.perf_counter() - t)

    def summary(self) -> dict[str, Any] | None:
        """p50/p99/max in milliseconds."""
        if not self.durations:
            return None
        arr = np.asarray(self.durations) * 1e3
        return {
            "n": int(arr.size),
            "p50_ms": float(np.percentile(arr, 50)),
            "p99_ms": float(np.percentile(arr, 99)),
            "max_ms": float(arr.max()),
        }


@dataclass
class Measured:
    """What one run measured (before it is written as JSON)."""

    transitions: int
    seconds: float
    startup: float
    cpu: dict[str, float] | None
    split: dict[str, float]
    pss: dict[str, Any] | None
    lag: dict[str, Any] | None = None
    blocking: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    buffers: dict[str, Any] | None = None


class _Run:
    """Timing scaffold shared by the contenders: warm-up, timed phase, CPU split, PSS."""

    def __init__(self, spec: RealSpec) -> None:
        self.spec = spec
        self.split = CpuSplit()
        self.blocking = Blocking()
        self.startup = 0.0

    def measure(self, step: Callable[[], int], notes: list[str] | None = None) -> Measured:
        """Step untimed for the warm-up, then timed; ``step`` returns real transitions."""
        warm = 0
        while warm < self.spec.warmup:
            warm += step()
        done = 0
        self.blocking.durations.clear()
        with TimedPhase(self.spec.timed()) as phase:
            self.split.start()
            while phase.more(done):
                with self.blocking.call():
                    done += step()
            self.split.stop()
        return Measured(
            transitions=done,
            seconds=phase.seconds,
            startup=self.startup,
            cpu=phase.cpu.result,
            split=self.split.result,
            pss=pss_tree() if self.spec.memory else None,
            blocking=self.blocking.summary(),
            notes=notes or [],
        )


def _actor(spec: RealSpec, single: gym.Space[Any], rows: int) -> Callable[[Any], Any]:
    """``obs -> actions`` for ``rows`` envs: the torch policy, or seeded random actions."""
    if spec.policy:
        agent = make_policy(spec.env, spec.seed)
        return lambda obs: agent.get_actions(obs)[0]
    space = gym.vector.utils.batch_space(single, rows)
    space.seed(spec.seed)
    return lambda obs: space.sample()


def run_ideal(spec: RealSpec) -> Measured:
    """One env, plain ``env.step`` loop, pre-drawn random actions: the env's own cost."""
    run = _Run(spec)
    t0 = time.perf_counter()
    env = make_env(spec.env)
    try:
        env.reset(seed=spec.seed)
        run.startup = time.perf_counter() - t0
        env.action_space.seed(spec.seed)
        acts = [env.action_space.sample() for _ in range(256)]
        i = 0

        def step() -> int:
            nonlocal i
            i += 1
            _, _, term, trunc, _ = env.step(acts[i & 255])
            if term or trunc:
                env.reset()
            return 1

        return run.measure(step)
    finally:
        env.close()


def _parallel_loop(env_name: str, seed: int, warmup: int, seconds: float, start: Any,
                   out: Any) -> None:  # fmt: skip
    """One process of :func:`run_ideal_parallel`: warm up, wait for the others, step."""
    env = make_env(env_name)
    env.reset(seed=seed)
    env.action_space.seed(seed)
    acts = [env.action_space.sample() for _ in range(256)]
    for i in range(warmup):
        if any(env.step(acts[i & 255])[2:4]):
            env.reset()
    start.wait()
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        _, _, term, trunc, _ = env.step(acts[n & 255])
        n += 1
        if term or trunc:
            env.reset()
    out.put((n, time.perf_counter() - t0))
    env.close()


def run_ideal_parallel(spec: RealSpec) -> Measured:
    """``cores`` plain single-env loops at once, one process each: what the machine gives.

    The ideal of the targets is ``cores`` x one loop alone; on a VM whose cores are hyperthreads
    or shared with neighbours, loops running side by side are each slower than one alone. This
    measures what ``cores`` independent loops reach together, with no IPC and no coordination.
    """
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    seconds = max(spec.min_seconds, 3.0)
    t0 = time.perf_counter()
    procs = [
        ctx.Process(target=_parallel_loop,
                    args=(spec.env, spec.seed + k, spec.warmup, seconds, start, out))
        for k in range(spec.cores)
    ]  # fmt: skip
    for proc in procs:
        proc.start()
    try:
        time.sleep(1.0)  # let every process build its env and warm up before the start
        startup = time.perf_counter() - t0
        start.set()
        counts = [out.get(timeout=seconds + 120) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    window = max(sec for _, sec in counts)
    return Measured(
        transitions=sum(n for n, _ in counts),
        seconds=window,
        startup=startup,
        cpu=None,
        split={},
        pss=None,
        notes=[f"per process: {', '.join(f'{n / sec:.0f}' for n, sec in counts)} steps/s"],
    )


def _envpool_make(spec: RealSpec, n_envs: int, batch: int, threads: int) -> Any:
    try:
        import envpool
    except Exception as exc:
        raise Skip(f"envpool not importable ({type(exc).__name__}: {exc})") from exc
    info = ENVS[spec.env]
    extra = ENVPOOL_ATARI if info.family == "atari" else {}
    return envpool.make_gymnasium(
        info.envpool_id,
        num_envs=n_envs,
        batch_size=batch,
        num_threads=threads,
        seed=spec.seed,
        **extra,
    )


def run_envpool(spec: RealSpec) -> Measured:
    """EnvPool: sync (``batch_size == num_envs``), async (``send``/``recv``) or one env.

    EnvPool resets a finished env on its next step (the action is ignored, reward 0): that
    step is not a transition and is not counted.
    """
    run = _Run(spec)
    n = 1 if spec.contender == "ideal-envpool" else spec.n_envs
    threads = 1 if spec.contender == "ideal-envpool" else spec.cores
    asynchronous = spec.contender == "envpool-async"
    batch = spec.batch_size if asynchronous else n
    t0 = time.perf_counter()
    pool = _envpool_make(spec, n, batch, threads)
    try:
        resetting = np.zeros(n, dtype=bool)
        act = _actor(spec, pool.single_action_space if hasattr(pool, "single_action_space")
                     else pool.action_space, batch)  # fmt: skip
        if asynchronous:
            pool.async_reset()
            obs, _, _, _, info = pool.recv()
            run.startup = time.perf_counter() - t0
            ids = np.asarray(info["env_id"])

            def step() -> int:
                nonlocal obs, ids
                pool.send(act(obs), ids)
                obs, _, term, trunc, info = pool.recv()
                ids = np.asarray(info["env_id"])
                real = len(ids) - int(resetting[ids].sum())
                resetting[ids] = np.logical_or(term, trunc)
                return real

        else:
            obs, _ = pool.reset()
            run.startup = time.perf_counter() - t0

            def step() -> int:
                nonlocal obs, resetting
                obs, _, term, trunc, _ = pool.step(act(obs))
                real = n - int(resetting.sum())
                resetting = np.logical_or(term, trunc)
                return real

        return run.measure(step)
    finally:
        with contextlib.suppress(Exception):
            pool.close()


def run_gym_vector(spec: RealSpec) -> Measured:
    """gymnasium ``SyncVectorEnv`` or ``AsyncVectorEnv(shared_memory=True)``, same-step reset."""
    from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

    run = _Run(spec)
    fns = [env_factory(spec.env) for _ in range(spec.n_envs)]
    t0 = time.perf_counter()
    envs: Any = None
    try:
        if spec.contender == "sync":
            envs = SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
        else:
            envs = AsyncVectorEnv(fns, shared_memory=True, autoreset_mode=AutoresetMode.SAME_STEP)
        obs, _ = envs.reset(seed=spec.seed)
        run.startup = time.perf_counter() - t0
        return _measure_vector(run, envs.step, obs, envs.single_action_space)
    finally:
        if envs is not None:
            envs.close()


def _measure_vector(
    run: _Run, step_envs: Callable[[Any], Any], obs: Any, single: gym.Space[Any]
) -> Measured:
    """Time a vector env (gymnasium's or SB3's: ``step`` returns the observations first) driven
    by the run's actor from its latest observations."""
    spec = run.spec
    act = _actor(spec, single, spec.n_envs)

    def step() -> int:
        nonlocal obs
        obs, *_ = step_envs(act(obs))
        return spec.n_envs

    return run.measure(step)


def run_sb3(spec: RealSpec) -> Measured:
    """SB3 ``SubprocVecEnv`` (its default start method: forkserver where available)."""
    try:
        from stable_baselines3.common.vec_env import SubprocVecEnv
    except Exception as exc:
        raise Skip(f"stable-baselines3 not importable ({type(exc).__name__}: {exc})") from exc
    run = _Run(spec)
    t0 = time.perf_counter()
    venv: Any = None
    try:
        # The forkserver imports SB3 (and torch) once instead of in every child: the same
        # stepping, a start-up that fits a loaded machine; memory is then shared like this.
        import multiprocessing

        multiprocessing.set_forkserver_preload([SubprocVecEnv.__module__, __name__])
        venv = SubprocVecEnv([env_factory(spec.env) for _ in range(spec.n_envs)])
        venv.seed(spec.seed)
        obs = venv.reset()
        run.startup = time.perf_counter() - t0
        return _measure_vector(run, venv.step, obs, venv.action_space)
    finally:
        if venv is not None:
            venv.close()


def _batch_len(batch: Any) -> int:
    lengths = getattr(batch, "lengths", None)
    return int(np.sum(lengths)) if lengths is not None else len(batch.actions)


class OneTorchThread:
    """A torch agent that keeps to one torch thread in whatever process it is unpickled in.

    ``inference="host"`` cloudpickles the agent into every env host; torch there would start
    with one thread per core (2 hosts x 2 threads on 2 cores). Unpickling this wrapper sets one
    intra-op and one inter-op thread first, as :func:`make_policy` does in the main process.
    """

    def __init__(self, agent: Any) -> None:
        """Wrap ``agent`` (``get_actions``; ``seed`` and the param methods are passed on)."""
        self.agent = agent

    def __setstate__(self, state: dict[str, Any]) -> None:
        _torch_one_thread()
        self.__dict__.update(state)

    def get_actions(self, observations: Any) -> Any:
        """The wrapped agent's actions and infos."""
        return self.agent.get_actions(observations)

    def seed(self, seed: int | None = None) -> None:
        """Reseed the wrapped agent (the host seeds each worker's copy from the seed tree)."""
        self.agent.seed(seed)

    def get_param_values(self) -> Any:
        """The wrapped agent's parameters."""
        return self.agent.get_param_values()

    def set_param_values(self, params: Any) -> None:
        """Load parameters into the wrapped agent."""
        self.agent.set_param_values(params)


def _our_agent(spec: RealSpec) -> Any:
    """The agent of an asyncsample contender (``None``: a seeded RandomAgent per worker).

    Random agent: the built-in :class:`~asyncsample.RandomAgent` in every mode; per_worker and
    host take ``agent=None`` (one per worker, seeded from the seed tree; host mode pickles them
    into the hosts, so the random actions are drawn there), batched needs one shared agent: one
    ``RandomAgent(seed)`` called on all workers' stacked rows. Policy: the same torch agent in
    every mode, one torch thread in every process that runs it.
    """
    from asyncsample import RandomAgent

    if spec.policy:
        agent = make_policy(spec.env, spec.seed)
        return OneTorchThread(agent) if INFERENCE[spec.contender] == "host" else agent
    if INFERENCE[spec.contender] == "batched":
        env = make_env(spec.env)
        try:
            return RandomAgent(env.action_space, seed=spec.seed)
        finally:
            env.close()
    return None


def shared_buffer_bytes(spec: RealSpec) -> dict[str, Any]:
    """Bytes of shared memory asyncsample allocates for ``spec`` (RawArrays: zeroed, resident).

    Step buffers: one row per env (observation, final observation, action, reward, flags).
    ``inference="host"`` adds per worker chunk buffers of ``chunk_steps`` rows per env, where
    ``chunk_steps`` is ``chunk_capacity`` (64 steps, fewer when the buffers would pass 8 MB).
    """
    from asyncsample.backends._chunk import DEFAULT_CHUNK_STEPS, chunk_capacity
    from asyncsample.env_group import StepBuffers

    env = make_env(spec.env)
    try:
        obs_space, act_space = env.observation_space, env.action_space
    finally:
        env.close()
    one = StepBuffers.allocate(obs_space, act_space, 1)
    row = sum(
        int(np.asarray(a).nbytes)
        for part in (one.obs, one.final_obs, one.actions, one.rewards, one.terminated,
                     one.truncated)
        for a in (part.values() if isinstance(part, dict) else [part])
    )  # fmt: skip
    k = spec.envs_per_worker
    steps = 0
    if INFERENCE.get(spec.contender) == "host":
        steps = chunk_capacity(obs_space, act_space, k, DEFAULT_CHUNK_STEPS)
    obs = sum(int(np.asarray(a).nbytes)
              for a in (one.obs.values() if isinstance(one.obs, dict) else [one.obs]))  # fmt: skip
    return {
        "obs_bytes": obs,
        "row_bytes": row,
        "step_bytes": spec.n_envs * row,
        "chunk_steps": steps,
        "chunk_bytes": spec.n_workers * steps * k * row,
    }


async def _asyncsample_run(spec: RealSpec) -> Measured:
    from asyncsample import Sampler
    from benchmarks.contenders import LagProbe

    kwargs: dict[str, Any] = {
        "n_workers": spec.n_workers,
        "envs_per_worker": spec.envs_per_worker,
        "n_processes": spec.n_processes,
        "backend": "process",
        "seed": spec.seed,
        "inference": INFERENCE[spec.contender],
    }
    agent = _our_agent(spec)
    run = _Run(spec)
    probe = LagProbe()
    t0 = time.perf_counter()
    sampler = Sampler(env_factory(spec.env), agent, **kwargs)
    try:
        await sampler.__aenter__()
        run.startup = time.perf_counter() - t0
        chunk = spec.n_envs * spec.fragment_steps
        warm = 0
        while warm < spec.warmup:
            warm += _batch_len(await sampler.obtain_fragments(min(chunk, spec.warmup)))
        done = 0
        split = CpuSplit()
        probe.start()
        try:
            with TimedPhase(spec.timed()) as phase:
                split.start()
                while phase.more(done):
                    done += _batch_len(await sampler.obtain_fragments(chunk))
                split.stop()
        finally:
            await probe.stop()
        pss = pss_tree() if spec.memory else None
    finally:
        await sampler.aclose()
    return Measured(
        transitions=done,
        seconds=phase.seconds,
        startup=run.startup,
        cpu=phase.cpu.result,
        split=split.result,
        pss=pss,
        lag=probe.summary(),
        buffers=shared_buffer_bytes(spec),
    )


def run_asyncsample(spec: RealSpec) -> Measured:
    """asyncsample, process backend, on uvloop, in the spec's ``inference`` mode."""
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_asyncsample_run(spec))


RUNNERS: dict[str, Callable[[RealSpec], Measured]] = {
    "ideal": run_ideal,
    "ideal-parallel": run_ideal_parallel,
    "ideal-envpool": run_envpool,
    "envpool-sync": run_envpool,
    "envpool-async": run_envpool,
    "sync": run_gym_vector,
    "async": run_gym_vector,
    "sb3": run_sb3,
    "asyncsample": run_asyncsample,
    "asyncsample-batched": run_asyncsample,
    "asyncsample-host": run_asyncsample,
}


def run_in_this_process(spec: RealSpec) -> dict[str, Any]:
    """Run ``spec`` here and return its JSON-able outcome (``status`` ok/skipped/error)."""
    import traceback
    import warnings

    warnings.simplefilter("ignore")
    load = os.getloadavg()
    try:
        m = RUNNERS[spec.contender](spec)
    except Skip as exc:
        return {"status": "skipped", "note": str(exc), "loadavg": load}
    except BaseException as exc:
        return {
            "status": "error",
            "note": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=15),
            "loadavg": load,
        }
    out = asdict(m)
    out.update(
        status="ok",
        rate=m.transitions / m.seconds,
        frames_rate=m.transitions * ENVS[spec.env].frame_skip / m.seconds,
        loadavg=load,
        loadavg_end=os.getloadavg(),
    )
    return out


def run_one(spec: RealSpec, timeout: float, workdir: Path) -> dict[str, Any]:
    """Run ``spec`` in a fresh ``python -m benchmarks.real_envs --run-one`` process.

    See :func:`benchmarks._runner.run_fresh` (``status`` ``"timeout"`` when it was killed).
    """
    outcome = run_fresh(("-m", "benchmarks.real_envs", "--run-one"), asdict(spec), timeout, workdir)
    outcome.setdefault("loadavg", os.getloadavg())
    return outcome


# --------------------------------------------------------------------------------------------
# Footprint: what one env costs in memory by itself


def env_footprint(name: str, k: int = 32, steps: int = 100) -> dict[str, Any]:
    """Bytes of PSS one more env adds to a process: the env's own footprint.

    Measured as the pool's growth is (PSS, one process, after warm-up): one env is built and
    stepped ``steps`` times first, so the imports, the first env's one-off costs and the
    stepping code paths (OpenCV buffers, ...) are in the base; then ``k`` more envs are built,
    reset and stepped ``steps`` times each, as the envs of a pool are.
    """
    import gc

    me = psutil.Process(os.getpid())

    def warm(env: gym.Env[Any, Any], seed: int) -> None:
        env.reset(seed=seed)
        env.action_space.seed(seed)
        for _ in range(steps):
            _, _, term, trunc, _ = env.step(env.action_space.sample())
            if term or trunc:
                env.reset()

    first = make_env(name)
    warm(first, 0)
    gc.collect()
    before = int(me.memory_full_info().pss)
    envs = [make_env(name) for _ in range(k)]
    for i, env in enumerate(envs):
        warm(env, i + 1)
    gc.collect()
    after = int(me.memory_full_info().pss)
    for env in [first, *envs]:
        env.close()
    return {"env": name, "k": k, "steps": steps, "bytes_per_env": (after - before) / k,
            "base_pss": before}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Plan


@dataclass
class Settings:
    """What the full run does.

    Attributes:
        groups: ``ideal``, ``main``, ``sweep`` (any subset).
        envs: Envs of the main comparison.
        contenders: Contenders of the main comparison (the ideal always runs).
        repeats: Repeats of every ideal and main config (interleaved).
        sweep_repeats: Repeats of every sweep config.
        cores: CPU budget.
        n_envs_atari: Envs of the main comparison on Atari.
        n_envs_mujoco: Envs of the main comparison on MuJoCo.
        sweep_envs: Envs of the sweep.
        sweep_n: Env counts of the sweep.
        sweep_process_cap: Largest env count for one-process-per-env peers in the sweep.
        layouts: Per asyncsample contender and env family (``atari``, ``mujoco``, ``classic``),
            the worker counts of the main comparison (``n_envs / workers`` envs per worker, two
            env-host processes); a family left out does not run that contender.
        sweep_peers: The peers of the sweep.
        sweep_layouts: Per asyncsample contender, the worker counts of the sweep.
        transitions: Timed agent steps per env (main comparison and sweep).
        min_seconds: Minimum length of a timed phase.
        timeout: Seconds before a run is killed, plus :data:`STARTUP_S` per env (x3).
        quick: Smoke-test sizes.
        fragment_steps: asyncsample steps per env per ``obtain_fragments`` call in the main
            comparison (``0``: up to 32, so that a run makes at least 4 calls). A PPO-style
            trainer's rollout length (128 for Atari in CleanRL and the SB3 zoo) is the call
            size a user pays the call boundary at.
    """

    groups: list[str] = field(default_factory=lambda: ["ideal", "main", "sweep", "footprint"])
    envs: list[str] = field(default_factory=lambda: list(MAIN_ENVS))
    contenders: list[str] = field(default_factory=lambda: [*PEERS, *OURS])
    repeats: int = 2
    sweep_repeats: int = 1
    cores: int = 2
    n_envs_atari: int = 8
    n_envs_mujoco: int = 32
    sweep_envs: list[str] = field(default_factory=lambda: list(SWEEP_ENVS))
    sweep_n: list[int] = field(default_factory=lambda: [8, 32, 128, 512])
    sweep_process_cap: dict[str, int] = field(
        default_factory=lambda: {"CartPole-v1": 128, "Pong-v5": 64}
    )
    layouts: dict[str, dict[str, list[int]]] = field(
        default_factory=lambda: {
            "asyncsample": {"atari": [2, 4], "mujoco": [2, 4], "classic": [2]},
            "asyncsample-batched": {"atari": [2], "mujoco": [4], "classic": [2]},
            "asyncsample-host": {"atari": [2], "mujoco": [2, 4], "classic": [2]},
        }
    )
    sweep_peers: list[str] = field(default_factory=lambda: ["envpool-sync", "sync", "async"])
    sweep_layouts: dict[str, list[int]] = field(
        default_factory=lambda: {"asyncsample": [2, 8], "asyncsample-host": [2]}
    )
    transitions: dict[str, int] = field(
        default_factory=lambda: {
            "Pong-v5": 2000,
            "Breakout-v5": 2000,
            "HalfCheetah-v5": 6000,
            "Humanoid-v5": 3000,
            "CartPole-v1": 40_000,
        }
    )
    min_seconds: float = 1.5
    timeout: float = 240.0
    quick: bool = False
    fragment_steps: int = 0

    @classmethod
    def quick_settings(cls) -> Settings:
        """Seconds-long runs of a few configs: the smoke test."""
        return cls(
            groups=["ideal", "main", "sweep", "footprint"],
            envs=["Pong-v5", "HalfCheetah-v5"],
            contenders=["envpool-async", "sync", *OURS],
            repeats=1,
            sweep_repeats=1,
            n_envs_atari=4,
            n_envs_mujoco=4,
            sweep_envs=["CartPole-v1"],
            sweep_n=[4, 8],
            layouts={c: {"atari": [2], "mujoco": [2], "classic": [2]} for c in OURS},
            sweep_layouts={"asyncsample": [2], "asyncsample-host": [2]},
            transitions=dict.fromkeys(ENVS, 200),
            min_seconds=0.0,
            timeout=120.0,
            quick=True,
        )


def _n_main(s: Settings, env: str) -> int:
    return s.n_envs_atari if ENVS[env].family == "atari" else s.n_envs_mujoco


def _ours(contender: str, env: str, n: int, w: int, policy: bool, s: Settings) -> RealSpec:
    w = max(1, min(w, n))
    total = s.transitions[env]
    frag = s.fragment_steps or max(1, min(32, total // (4 * n)))
    return RealSpec(contender, env, n, policy, total, max(n, total // 10), n_workers=w,
                    envs_per_worker=n // w, n_processes=2, cores=s.cores, fragment_steps=frag,
                    min_seconds=s.min_seconds)  # fmt: skip


def _peer(contender: str, env: str, n: int, policy: bool, s: Settings) -> RealSpec:
    total = s.transitions[env]
    return RealSpec(contender, env, n, policy, total, max(n, total // 10), cores=s.cores,
                    batch_size=max(1, n // 2), min_seconds=s.min_seconds)  # fmt: skip


def plan(s: Settings) -> dict[str, list[RealSpec]]:
    """The runs of each group, in run order (one repeat)."""
    out: dict[str, list[RealSpec]] = {g: [] for g in s.groups}
    if "ideal" in out:
        envs = list(dict.fromkeys([*s.envs, *(s.sweep_envs if "sweep" in out else [])]))
        for env in envs:
            total = s.transitions[env]
            for c in ("ideal", "ideal-parallel", "ideal-envpool"):
                out["ideal"].append(RealSpec(c, env, 1, False, total // 2, total // 20,
                                             cores=s.cores, min_seconds=s.min_seconds))  # fmt: skip
    if "main" in out:
        for env in s.envs:
            n = _n_main(s, env)
            for policy in (False, True):
                for c in s.contenders:
                    if c in OURS:
                        for w in s.layouts.get(c, {}).get(ENVS[env].family, []):
                            out["main"].append(_ours(c, env, n, w, policy, s))
                    else:
                        out["main"].append(_peer(c, env, n, policy, s))
    if "sweep" in out:
        for env in s.sweep_envs:
            for n in s.sweep_n:
                for c in s.sweep_peers:
                    if c == "async" and n > s.sweep_process_cap.get(env, 128):
                        continue
                    spec = _peer(c, env, n, False, s)
                    spec.n_transitions = max(spec.n_transitions, 3 * n)
                    out["sweep"].append(spec)
                for c, workers in s.sweep_layouts.items():
                    for w in workers:
                        spec = _ours(c, env, n, w, False, s)
                        spec.n_transitions = max(spec.n_transitions, 3 * n)
                        spec.fragment_steps = max(1, min(32, spec.n_transitions // (4 * n)))
                        out["sweep"].append(spec)
    return out


#: Seconds one env takes to build and reset on a quiet core (Pong: ~0.3 s: ALE start-up and
#: up to 30 no-op steps), for the run timeouts and the plan's estimate.
STARTUP_S = {"atari": 0.3, "mujoco": 0.05, "classic": 0.002}


def run_timeout(spec: RealSpec, s: Settings) -> float:
    """``s.timeout`` plus three times the envs' start-up in one process (512 Pong: +461 s)."""
    return s.timeout + 3 * spec.n_envs * STARTUP_S[ENVS[spec.env].family]


def _previous_walls(path: Path) -> dict[str, list[float]]:
    """Wall seconds of each config's runs (ok or not) in an earlier ``results.json``."""
    try:
        runs = json.loads(path.read_text())["runs"]
    except (OSError, ValueError, KeyError):
        return {}
    walls: dict[str, list[float]] = {}
    for r in runs:
        if r.get("wall") and r.get("status") == "ok":
            walls.setdefault(r["key"], []).append(float(r["wall"]))
    return walls


#: Quiet-machine wall / the recorded run's wall. The runs in ``benchmarks/results/real_envs.json``
#: are from a quiet machine (2026-11-23: the full run took 27 min where 26 were estimated from
#: an earlier, loaded run scaled by 0.35), so they are used as they are.
QUIET = 1.0


def estimate_seconds(spec: RealSpec, walls: dict[str, list[float]], scale: float = 1.0) -> float:
    """The wall time of one run: ``scale`` x the same config's median wall in ``walls``.

    Else the nearest config that ran (asyncsample in another inference mode or layout with the
    same env, env count and agent), else a model: 5 s of
    interpreter and imports (+5 s with a torch policy), the envs' start-up (:data:`STARTUP_S`,
    over two processes for asyncsample) and 10 s of stepping.
    """
    if walls.get(spec.key):
        return scale * statistics.median(walls[spec.key])
    agent = "policy" if spec.policy else "random"
    near = [
        f"asyncsample|{spec.env}|{spec.n_envs}|{agent}|{spec.layout}",
        *(k for k in walls if k.startswith("asyncsample|") and k.split("|")[1:4]
          == [spec.env, str(spec.n_envs), agent] and spec.contender in OURS),
    ]  # fmt: skip
    for key in near:
        if walls.get(key):
            return scale * statistics.median(walls[key])
    start = spec.n_envs * STARTUP_S[ENVS[spec.env].family]
    start /= 2 if spec.contender in OURS else 1
    return 5.0 + (5.0 if spec.policy else 0.0) + start + 10.0


def estimate_plan(
    s: Settings, walls: dict[str, list[float]], scale: float = 1.0
) -> dict[str, float]:
    """Estimated seconds of each group of the plan (repeats included) and of the footprints."""
    out: dict[str, float] = {}
    for g, specs in plan(s).items():
        reps = s.sweep_repeats if g == "sweep" else s.repeats
        out[g] = reps * sum(estimate_seconds(spec, walls, scale) for spec in specs)
    if "footprint" in s.groups:
        envs = dict.fromkeys([*s.envs, *s.sweep_envs])
        out["footprint"] = sum(6.0 + 17 * STARTUP_S[ENVS[e].family] for e in envs)
    return out


def print_plan(s: Settings, verbose: bool = False) -> float:
    """Print the plan's estimated length (and with ``verbose`` every run); its seconds."""
    latest = RESULTS_DIR / "real_envs" / "results.json"
    walls = _previous_walls(latest if latest.exists() else RESULTS_DIR / "real_envs.json")
    est = estimate_plan(s, walls, QUIET)
    if verbose:
        for g, specs in plan(s).items():
            for spec in specs:
                print(f"{g:6} {spec.key:55} ~{estimate_seconds(spec, walls, QUIET):5.0f} s "
                      f"(timeout {run_timeout(spec, s):.0f} s)")  # fmt: skip
    total = sum(est.values())
    _progress(
        f"plan: {sum(len(v) for v in plan(s).values())} configs, {s.repeats} repeats "
        f"(sweep {s.sweep_repeats}); estimated {total / 60:.0f} min on a quiet machine ("
        + ", ".join(f"{g} {v / 60:.1f}" for g, v in est.items())
        + ")"
    )
    return total


def _progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def execute(s: Settings, workdir: Path, log: Path | None = None) -> dict[str, Any]:
    """Run the plan: every group's runs, repeats interleaved; footprints once."""
    groups = plan(s)
    records: list[dict[str, Any]] = []
    footprints: list[dict[str, Any]] = []
    if "footprint" in s.groups:
        for env in dict.fromkeys([*s.envs, *s.sweep_envs]):
            try:
                footprints.append(_footprint_in_child(env, s.timeout))
            except Exception as exc:
                footprints.append({"env": env, "error": f"{type(exc).__name__}: {exc}"})
    seen: set[tuple[str, str]] = set()
    runs: list[tuple[str, RealSpec]] = []
    for g, specs in groups.items():
        for spec in specs:
            if (g, spec.key) not in seen:
                seen.add((g, spec.key))
                runs.append((g, spec))
    n_rep = max(s.repeats, s.sweep_repeats)
    total = sum(s.sweep_repeats if g == "sweep" else s.repeats for g, _ in runs)
    i = 0
    for repeat in range(n_rep):
        for g, spec in runs:
            if repeat >= (s.sweep_repeats if g == "sweep" else s.repeats):
                continue
            i += 1
            _progress(f"{i}/{total} r{repeat} {g} {spec.key}")
            outcome = run_one(spec, run_timeout(spec, s), workdir)
            rec = {"group": g, "key": spec.key, "repeat": repeat, "spec": asdict(spec),
                   "layout": spec.layout, **outcome}  # fmt: skip
            records.append(rec)
            if rec.get("status") != "ok":
                _progress(f"  -> {rec.get('status')}: {rec.get('note')}")
            if log is not None:
                with log.open("a") as fh:
                    fh.write(json.dumps(rec) + "\n")
    return {"records": records, "footprints": footprints}


def _footprint_in_child(env: str, timeout: float) -> dict[str, Any]:
    code = (
        "import json, warnings; warnings.simplefilter('ignore');"
        "from benchmarks.real_envs import env_footprint;"
        f"print(json.dumps(env_footprint({env!r})))"
    )
    envvars = dict(os.environ)
    envvars["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), envvars.get("PYTHONPATH", "")) if p
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=envvars, capture_output=True,
        timeout=timeout, check=True, text=True,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# --------------------------------------------------------------------------------------------
# Aggregation


def aggregate(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per config key: median rate over repeats, and the first ok run's instruments."""
    out: dict[str, dict[str, Any]] = {}
    for rec in records:
        spec = rec["spec"]
        agg = out.setdefault(
            rec["key"],
            {
                "contender": spec["contender"],
                "label": CONTENDER_LABELS[spec["contender"]],
                "env": spec["env"],
                "n_envs": spec["n_envs"],
                "policy": spec["policy"],
                "layout": rec["layout"],
                "n_workers": spec["n_workers"],
                "fragment_steps": spec.get("fragment_steps", 0),
                "rates": [],
                "startups": [],
                "groups": [],
                "per_core": [],
                "loadavg": [],
                "notes": [],
                "errors": [],
            },
        )
        agg["loadavg"].append(rec.get("loadavg"))
        if rec["group"] not in agg["groups"]:
            agg["groups"].append(rec["group"])
        if rec.get("status") == "ok":
            agg["rates"].append(rec["rate"])
            agg["startups"].append(rec["startup"])
            own = (rec.get("cpu") or {}).get("own_cores")
            if own:
                agg["per_core"].append(rec["rate"] / own)
                agg.setdefault("own", []).append(own)
            for k in ("pss", "lag", "blocking", "split", "cpu", "buffers"):
                if agg.get(k) is None and rec.get(k):
                    agg[k] = rec[k]
        elif rec.get("status") == "skipped":
            if rec["note"] not in agg["notes"]:
                agg["notes"].append(rec["note"])
        else:
            agg["errors"].append(rec.get("note"))
    for key, agg in out.items():
        rates = agg["rates"]
        fs = ENVS[agg["env"]].frame_skip
        agg["median"] = statistics.median(rates) if rates else None
        agg["frames_median"] = agg["median"] * fs if agg["median"] else None
        agg["startup"] = statistics.median(agg["startups"]) if agg["startups"] else None
        agg["per_core_median"] = statistics.median(agg["per_core"]) if agg["per_core"] else None
        agg["status"] = "ok" if rates else ("error" if agg["errors"] else "skipped")
        agg["key"] = key
    return out


def _med(summary: dict[str, dict[str, Any]], key: str) -> float | None:
    agg = summary.get(key)
    return agg["median"] if agg else None


def best_of(
    summary: dict[str, dict[str, Any]],
    contender: str,
    env: str,
    n: int,
    policy: bool,
    group: str | None = "main",
) -> dict[str, Any] | None:
    """The fastest config of ``contender`` on ``env`` with ``n`` envs (any layout).

    Only configs of ``group`` (default: the main comparison, whose configs all ran the same
    number of interleaved repeats) compete; ``None`` takes any.
    """
    cands = [
        a
        for a in summary.values()
        if a["contender"] == contender and a["env"] == env and a["n_envs"] == n
        and a["policy"] == policy and a["median"]
        and (group is None or group in a.get("groups", [group]))
    ]  # fmt: skip
    return max(cands, key=lambda a: a["median"]) if cands else None


def best_ours(
    summary: dict[str, dict[str, Any]], env: str, n: int, policy: bool
) -> dict[str, Any] | None:
    """The fastest asyncsample config (any inference mode, any layout) of the main comparison."""
    cands = [b for c in OURS if (b := best_of(summary, c, env, n, policy))]
    return max(cands, key=lambda a: a["median"]) if cands else None


def _cpu_us(summary: dict[str, dict[str, Any]], key: str) -> float | None:
    pc = (summary.get(key) or {}).get("per_core_median")
    return 1e6 / pc if pc else None


def memory_slope(
    summary: dict[str, dict[str, Any]], env: str, contender: str
) -> dict[str, Any] | None:
    """PSS per added env of ``contender`` over the sweep (fewest to most envs), split up.

    ``bytes_per_env`` is the whole process tree's growth. For asyncsample it is split into:
    ``hosts_per_env`` (the env hosts without shared memory: the envs themselves, to compare
    with their footprint), ``shm_per_env`` (PSS of the shared buffers; ``step_alloc_per_env``
    and ``chunk_alloc_per_env`` are what asyncsample allocates for them) and ``main_per_env``
    (the main process without shared memory: mostly the data of one call,
    ``call_data_per_env``, estimated as envs x (2 x fragment steps + 2) observations: the
    recorder rows and the batch's observations, fragment steps each, the batch's last
    observations and the episode pieces' copies of them, one each).
    """
    pts = sorted(
        (a for a in summary.values()
         if a["contender"] == contender and a["env"] == env and not a["policy"]
         and a.get("pss") and a["n_workers"] in (0, 1, 2)),
        key=lambda a: a["n_envs"],
    )  # fmt: skip
    if len(pts) < 2:
        return None
    a0, a1 = pts[0], pts[-1]
    dn = a1["n_envs"] - a0["n_envs"]
    p0, p1 = a0["pss"], a1["pss"]

    def per_env(f: Callable[[dict[str, Any]], float]) -> float:
        return (f(p1) - f(p0)) / dn

    out: dict[str, Any] = {
        "env": env,
        "contender": contender,
        "from_n": a0["n_envs"],
        "to_n": a1["n_envs"],
        "bytes_per_env": per_env(lambda p: p["total_pss"]),
    }
    if "shm_pss" in p0 and "shm_pss" in p1:
        out["shm_per_env"] = per_env(lambda p: p["shm_pss"])
        out["main_per_env"] = per_env(lambda p: p["main_pss"] - p["main_shm_pss"])
        out["hosts_per_env"] = per_env(lambda p: p["children_pss"] - p["children_shm_pss"])
    b0, b1 = a0.get("buffers"), a1.get("buffers")
    if b0 and b1:
        out["step_alloc_per_env"] = (b1["step_bytes"] - b0["step_bytes"]) / dn
        out["chunk_alloc_per_env"] = (b1["chunk_bytes"] - b0["chunk_bytes"]) / dn
        out["chunk_steps"] = [b0["chunk_steps"], b1["chunk_steps"]]
        if "obs_bytes" in b0:
            calls = [a["n_envs"] * (2 * a["fragment_steps"] + 2) * b["obs_bytes"]
                     for a, b in ((a0, b0), (a1, b1))]  # fmt: skip
            out["call_data_per_env"] = (calls[1] - calls[0]) / dn
    return out


def derive(summary: dict[str, dict[str, Any]], s: Settings) -> dict[str, Any]:
    """Ideals, ratios and the issue's targets."""
    ideal: dict[str, Any] = {}
    for env in ENVS:
        g = _med(summary, f"ideal|{env}|1|random|")
        e = _med(summary, f"ideal-envpool|{env}|1|random|")
        if g or e:
            ideal[env] = {
                "parallel_rate": _med(summary, f"ideal-parallel|{env}|1|random|"),
                "single_rate": g,
                "step_us": 1e6 / g if g else None,
                "ideal_rate": g * s.cores if g else None,
                "envpool_single_rate": e,
                "envpool_step_us": 1e6 / e if e else None,
                # CPU time per step (wall time / cores the run got): the env's own cost even
                # when other jobs took part of the core during the ideal run.
                "cpu_us": _cpu_us(summary, f"ideal|{env}|1|random|"),
                "envpool_cpu_us": _cpu_us(summary, f"ideal-envpool|{env}|1|random|"),
            }

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    def rate(c: str, env: str, n: int, policy: bool) -> float | None:
        b = (
            best_ours(summary, env, n, policy)
            if c == "ours"
            else best_of(summary, c, env, n, policy)
        )
        return b["median"] if b else None

    def which(env: str, n: int, policy: bool) -> str:
        b = best_ours(summary, env, n, policy)
        return f" (best asyncsample: {_row_label(b)})" if b else ""

    na, nm = s.n_envs_atari, s.n_envs_mujoco
    ours_pong = rate("ours", "Pong-v5", na, False)
    targets: list[dict[str, Any]] = [
        {
            "what": f"Pong-v5 random, {na} envs: % of the {s.cores}-core ideal"
            + which("Pong-v5", na, False),
            "target": 0.90,
            "value": ratio(ours_pong, ideal.get("Pong-v5", {}).get("ideal_rate")),
        },
        {
            "what": f"Pong-v5 random, {na} envs: x EnvPool async",
            "target": 0.80,
            "value": ratio(ours_pong, rate("envpool-async", "Pong-v5", na, False)),
        },
        {
            "what": f"HalfCheetah-v5 MLP policy, {nm} envs: x EnvPool sync"
            + which("HalfCheetah-v5", nm, True),
            "target": 1.0,
            "value": ratio(
                rate("ours", "HalfCheetah-v5", nm, True),
                rate("envpool-sync", "HalfCheetah-v5", nm, True),
            ),
        },
    ]
    memory = [
        m
        for env in s.sweep_envs
        for c in ("asyncsample", "asyncsample-host", "async", "sync", "envpool-sync")
        if (m := memory_slope(summary, env, c)) is not None
    ]
    for t in targets:
        t["met"] = None if t["value"] is None else t["value"] >= t["target"]

    # The same ratios per CPU-second the contender's processes got: on a shared machine a
    # contender with more runnable processes gets a larger share of the CPUs (the scheduler is
    # fair per thread), so steps/s alone mixes efficiency with scheduling share.
    def per_core(c: str, env: str, n: int, pol: bool) -> float | None:
        b = best_ours(summary, env, n, pol) if c == "ours" else best_of(summary, c, env, n, pol)
        return b.get("per_core_median") if b else None

    ide_pc = (summary.get("ideal|Pong-v5|1|random|") or {}).get("per_core_median")
    per_cpu = [
        {
            "what": f"Pong-v5 random, {na} envs: steps per CPU-second / the ideal's",
            "value": ratio(per_core("ours", "Pong-v5", na, False), ide_pc),
        },
        {
            "what": f"Pong-v5 random, {na} envs: steps per CPU-second / EnvPool async's",
            "value": ratio(
                per_core("ours", "Pong-v5", na, False),
                per_core("envpool-async", "Pong-v5", na, False),
            ),
        },
        {
            "what": f"HalfCheetah-v5 MLP policy, {nm} envs: steps per CPU-second / EnvPool sync's",
            "value": ratio(
                per_core("ours", "HalfCheetah-v5", nm, True),
                per_core("envpool-sync", "HalfCheetah-v5", nm, True),
            ),
        },
    ]
    pong_side = ideal.get("Pong-v5", {}).get("parallel_rate")
    hc_ideal = ideal.get("HalfCheetah-v5", {}).get("ideal_rate")
    per_cpu += [
        {
            "prefix": "",
            "what": f"Pong-v5 random, {na} envs: x 2 plain loops side by side (this VM's ceiling)",
            "value": ratio(ours_pong, pong_side),
        },
        {
            "prefix": "",
            "what": "HalfCheetah-v5: gymnasium's 2-core ideal (no policy, no overhead) / EnvPool "
            f"sync with the MLP policy, {nm} envs (at or below 1: even a perfect pool of "
            "gymnasium's env would not beat EnvPool's C++ port with the policy)",
            "value": ratio(hc_ideal, rate("envpool-sync", "HalfCheetah-v5", nm, True)),
        },
    ]
    return {"ideal": ideal, "targets": targets, "per_cpu": per_cpu, "memory_slope": memory}


# --------------------------------------------------------------------------------------------
# Report


ENV_NOTES = """\
How the envs differ between the libraries (the same task, not the same code):

- Atari: gymnasium/SB3/asyncsample run ale-py's `ALE/*-v5` at `frameskip=1` under
  `AtariPreprocessing(noop_max=30, frame_skip=4, screen_size=84, grayscale_obs=True)` and
  `FrameStackObservation(4)` (Python wrappers, OpenCV resize, max-pool of the last two frames).
  EnvPool runs its own C++ ALE loop with the same settings in C++ (`stack_num=4`, `frame_skip=4`,
  `noop_max=30`, area resize, gray); it is set to match gymnasium's defaults: no fire reset (its
  default is on), no sticky actions, no episodic life, no reward clipping. Both end an episode at
  108k frames. EnvPool's single-env rate is therefore a *different env's* rate: the ideal below is
  always 2 x the gymnasium-wrapper rate, the same number for every contender.
- MuJoCo: gymnasium's `HalfCheetah-v5`/`Humanoid-v5` call the `mujoco` Python bindings per step;
  EnvPool has its own C++ port of the v5 tasks (same XML, same reward terms).
- Autoreset: EnvPool resets a finished env on its *next* step (that step is not counted here); the
  gymnasium vector envs run in same-step mode, SB3 resets in the same step, asyncsample's workers
  reset inside the env host. Every rate counts real transitions only.
- Agent: "random" is a seeded uniform action per env per step (asyncsample: its built-in
  RandomAgent, one per worker in `per_worker` and `host` mode, where the hosts draw the actions;
  one shared by all workers in `batched` mode). "policy" is a torch `TorchAgent` (Nature-CNN for
  Atari, MLP 64x64 tanh Gaussian for MuJoCo) on one torch thread in every process that runs it,
  called once per vector step on the stacked observations (EnvPool async: once per `recv` batch;
  asyncsample `per_worker`: once per worker step, `n_workers` calls per round; `batched`: the
  workers' concurrent calls merged into one; `host`: a copy in each of the 2 env hosts, once per
  worker step there, no round trip per step).
- asyncsample layouts are `WxK/P2`: W workers of K envs each over 2 env-host processes.
"""


def _calls_note(results: dict[str, Any]) -> str:
    """How large asyncsample's sampling calls were in the main comparison."""
    frags = sorted(
        {r["spec"]["fragment_steps"] for r in results["runs"]
         if r.get("group") == "main" and r["spec"]["contender"] in OURS}
    )  # fmt: skip
    size = ", ".join(str(f) for f in frags) or "-"
    return (
        f"- asyncsample's main-comparison runs call `obtain_fragments` for {size} steps per env "
        "(`--fragment-steps`); every call ends at a barrier where the workers wait for each "
        "other, so longer calls (a PPO rollout of 128 steps, say) idle the hosts less. The "
        "peers step without calls."
    )


def _cell(agg: dict[str, Any] | None) -> str:
    if not agg:
        return "-"
    if agg["status"] != "ok":
        return str(agg["status"])
    rates = agg["rates"]
    span = f" [{_k(min(rates))}-{_k(max(rates))}]" if len(rates) > 1 else ""
    return f"{_k(agg['median'])}{span}"


def _row_label(agg: dict[str, Any]) -> str:
    return f"{agg['label']} {agg['layout']}".strip()


def _loads(results: dict[str, Any]) -> tuple[float, float, float]:
    ones = [r["loadavg"][0] for r in results["runs"] if r.get("loadavg")]
    return (min(ones), statistics.median(ones), max(ones)) if ones else (0.0, 0.0, 0.0)


def _foreign(results: dict[str, Any]) -> float | None:
    f = [r["cpu"]["foreign_cores"] for r in results["runs"] if r.get("cpu")]
    return statistics.median(f) if f else None


#: Cores other processes may take during the timed phases (median) for a run to count as quiet.
QUIET_FOREIGN = 0.1


def _load_paragraph(results: dict[str, Any], lo: float, med: float, hi: float) -> str:
    """What the machine's load was, and what that means for reading the numbers."""
    m = results["machine"]
    foreign = _foreign(results)
    where = (
        f"1-minute load average {lo:.1f} to {hi:.1f} (median {med:.1f}) on "
        f"{m['cpu_affinity']} cores during the runs; other processes took a median "
        f"{_f(foreign)} cores during the timed phases"
    )
    if foreign is not None and foreign < QUIET_FOREIGN:
        return (
            f"**Load.** Nothing else ran: {where}. The load average counts the contenders' own "
            "processes (AsyncVectorEnv and SB3 start one per env). Runs still vary by about "
            "10-20% between repeats on this VM, so the ranges are given. Every run's "
            "`os.getloadavg()` is in `results.json`."
        )
    return (
        f"**Load.** The machine was shared with other jobs: {where}. Absolute rates are "
        "therefore low and noisy; compare contenders *within* this run (they were interleaved "
        "within each repeat, so a busy spell hit all alike). Every run's `os.getloadavg()` is "
        "in `results.json`."
    )


def write_markdown(path: Path, results: dict[str, Any]) -> None:
    """Render ``results.md``: machine, env notes, targets, main tables, sweep, guidance."""
    m, s, summary, d = (results["machine"], results["settings"], results["summary"],
                        results["derived"])  # fmt: skip
    lo, med, hi = _loads(results)
    lines = [
        "# Real envs: Atari and MuJoCo against EnvPool, and how the cost grows",
        "",
        f"{m['date']} · {m['cpu_affinity']} cores ({m['cpu_model']}) · "
        f"{m['memory_gib']} GiB · Python {m['python']} · run took {m.get('minutes', 0):.0f} min"
        f" · `python -m benchmarks.real_envs`",
        "",
        _load_paragraph(results, lo, med, hi),
        "",
        f"Median [min-max] of {s['repeats']} runs (sweep: {s['sweep_repeats']}), each in a fresh"
        " process, warm-up excluded (a config that is both in the main comparison and in the "
        "sweep pools the runs of both). Rates are **agent steps/s**; Atari frames/s = 4 x that. "
        "*Steps per CPU-s* divides by the cores the contender's processes got, which makes "
        "contenders comparable when the machine is shared: the scheduler shares the CPUs per "
        "runnable thread, so a contender with more processes takes more of a busy machine.",
        "",
        ENV_NOTES,
        _calls_note(results),
        "",
        "## Targets",
        "",
    ]
    rows = []
    for t in d["targets"]:
        met = {True: "met", False: "**not met**", None: "not measured"}[t["met"]]
        rows.append([t["what"], _f(t["target"]), _f(t["value"]), met])
    for fp in results.get("footprints", []):
        for slope in d["memory_slope"]:
            if slope["env"] != fp.get("env") or slope["contender"] not in OURS:
                continue
            if "bytes_per_env" not in fp:
                continue
            ok = slope["bytes_per_env"] <= fp["bytes_per_env"]
            rows.append(
                [
                    f"{fp['env']}: {CONTENDER_LABELS[slope['contender']]} PSS per added env "
                    f"({slope['from_n']}->{slope['to_n']} envs) <= the env's own footprint (MB)",
                    f"{fp['bytes_per_env'] / 2**20:.3f}",
                    f"{slope['bytes_per_env'] / 2**20:.3f}",
                    "met" if ok else "**not met**",
                ]
            )
            if "hosts_per_env" in slope:
                hosts = slope["hosts_per_env"]
                rows.append(
                    [
                        "(same, env hosts only, shared memory excluded: the envs' own growth)",
                        f"{fp['bytes_per_env'] / 2**20:.3f}",
                        f"{hosts / 2**20:.3f}",
                        "for reference",
                    ]
                )
    for x in d.get("per_cpu", []):
        prefix = x.get("prefix", "(same, per CPU used) ")
        rows.append([f"{prefix}{x['what']}", "-", _f(x["value"]), "for reference"])
    lines += _table(["target", "goal", "value", ""], rows)
    got = (summary.get("ideal|Pong-v5|1|random|") or {}).get("own")
    if got and statistics.median(got) < 0.9:
        lines += [
            f"**Read the wall-clock targets with care.** The single-env ideal run of Pong-v5 got "
            f"only {statistics.median(got):.2f} of a core (the other jobs took the rest), so "
            "the wall-clock ideal is deflated and a '% of ideal' above 100% is possible. The "
            "per-CPU rows compare steps per CPU-second instead, which the load distorts far "
            "less: they are the more trustworthy figures from this machine.",
            "",
        ]
    lines += ["## Single-env step cost (the ideal)", ""]
    rows = []
    for env, i in d["ideal"].items():
        par = i.get("parallel_rate")
        side = f" ({par / i['ideal_rate']:.0%})" if par and i["ideal_rate"] else ""
        rows.append([env, _f(i["step_us"], "{:.0f}"), _f(i.get("cpu_us"), "{:.0f}"),
                     _k(i["single_rate"]), _k(i["ideal_rate"]),
                     _k(par) + side,
                     _f(i["envpool_step_us"], "{:.0f}"), _f(i.get("envpool_cpu_us"), "{:.0f}"),
                     _k(i["envpool_single_rate"])])  # fmt: skip
    lines += _table(["env", "gymnasium wrappers: us/step (wall)", "CPU us/step", "steps/s",
                     "ideal (2 x steps/s)", "2 loops side by side: steps/s (% of ideal)",
                     "EnvPool 1 env 1 thread: us/step (wall)",
                     "CPU us/step", "steps/s"], rows)  # fmt: skip
    lines += [
        "Wall-clock us/step is what the ideal uses (as the targets define it); CPU us/step "
        "divides by the cores the run actually got, i.e. the env's own cost without the other "
        "jobs' share. Where the two differ a lot, the ideal run itself was slowed by the load. "
        "'2 loops side by side' runs the same loop in two processes at once, with nothing "
        "between them: what this VM's two cores give together, the ceiling of any pool here.",
        "",
    ]
    main = [
        a
        for a in summary.values()
        if a["contender"] not in ("ideal", "ideal-parallel", "ideal-envpool")
        and any(r["key"] == a["key"] and r["group"] == "main" for r in results["runs"])
    ]
    for env in s["envs"]:
        aggs = [a for a in main if a["env"] == env]
        if not aggs:
            continue
        n = aggs[0]["n_envs"]
        ide = d["ideal"].get(env, {}).get("ideal_rate")
        fs = ENVS[env].frame_skip
        ep: dict[bool, Any] = {
            False: best_of(summary, "envpool-async", env, n, False),
            True: best_of(summary, "envpool-sync", env, n, True),
        }
        lines += [f"## {env}, {n} envs", ""]
        rows = []
        labels = list(dict.fromkeys(_row_label(a) for a in aggs))
        for label in labels:
            r = next((a for a in aggs if _row_label(a) == label and not a["policy"]), None)
            p = next((a for a in aggs if _row_label(a) == label and a["policy"]), None)
            ref = r or p
            assert ref is not None
            if all(a is None or a["status"] == "skipped" for a in (r, p)):
                continue
            row = [label, _cell(r)]
            if fs > 1:
                row.append(_k(r["frames_median"]) if r else "-")
            row += [
                _pct(r["median"] / ide if r and r["median"] and ide else None),
                _x(r["median"] / ep[False]["median"] if r and r["median"] and ep[False]
                   else None),
                _cell(p),
                _pct(p["median"] / ide if p and p["median"] and ide else None),
                _x(p["median"] / ep[True]["median"] if p and p["median"] and ep[True]
                   else None),
                _f(statistics.median(r["own"]) if r and r.get("own") else None),
                _k(r.get("per_core_median") if r else None),
                _f((r or {}).get("split", {}).get("main_cores") if r else None),
                _mb(((r or {}).get("pss") or {}).get("total_pss") if r else None),
                _f(ref.get("startup"), "{:.1f}"),
            ]  # fmt: skip
            rows.append(row)
        head = ["contender", "random: steps/s"]
        if fs > 1:
            head.append("frames/s")
        head += ["% ideal", "x EnvPool async", "policy: steps/s", "% ideal", "x EnvPool sync",
                 "cores used (random)", "steps per CPU-s (random)", "main-process cores (random)",
                 "PSS MB (random)", "start-up s"]  # fmt: skip
        lines += _table(head, rows)
        notes = sorted({n for a in aggs for n in a["notes"] + [e for e in a["errors"] if e]})
        lines += [f"- {n}" for n in notes] + ([""] if notes else [])
    sweep = [
        a
        for a in summary.values()
        if any(r["key"] == a["key"] and r["group"] == "sweep" for r in results["runs"])
    ]
    if sweep:
        lines += [
            "## How the cost grows (random agent)",
            "",
            "![scaling](real_envs_scaling.png)",
            "",
            "Main cores: CPU of the process that drives the pool (EnvPool's C++ threads live in "
            "it; for SyncVectorEnv it is all the work). PSS: the whole process tree, summed at the "
            "end "
            "of the timed phase. Stall p99: asyncsample's event-loop lag (a 1 ms sleeper's "
            "lateness); for the peers, the p99 duration of one blocking `step` call, which is what"
            " an event loop calling them directly would stall. "
            f"One-process-per-env peers are capped ({s['sweep_process_cap']}) to keep the "
            "shared machine's memory and start-up time in bounds.",
            "",
        ]
        for env in s["sweep_envs"]:
            rows = []
            for a in sorted(
                (a for a in sweep if a["env"] == env),
                key=lambda a: (a["n_envs"], a["contender"], a["layout"]),
            ):
                stall = a.get("lag") or a.get("blocking") or {}
                rows.append([str(a["n_envs"]), _row_label(a), _cell(a),
                             _f((a.get("split") or {}).get("main_cores")),
                             _pct((a.get("split") or {}).get("main_share")),
                             _mb((a.get("pss") or {}).get("total_pss")),
                             _mb((a.get("pss") or {}).get("main_pss")),
                             str((a.get("pss") or {}).get("n_children", "-")),
                             _f(stall.get("p99_ms"), "{:.1f}"),
                             _f(a.get("startup"), "{:.1f}")])  # fmt: skip
            lines += [f"### {env}", ""]
            failed = [
                f"- {a['n_envs']} envs, {_row_label(a)}: " + "; ".join(map(str, a["errors"]))
                for a in sweep
                if a["env"] == env and a["status"] == "error"
            ]
            lines += [*failed, ""] if failed else []
            lines += _table(["envs", "contender", "steps/s", "main cores", "main share of CPU",
                             "PSS total MB", "PSS main MB", "children", "stall p99 ms",
                             "start-up s"], rows)  # fmt: skip
        rows = []
        fps = {f.get("env"): f for f in results.get("footprints", [])}

        def mb3(v: float | None) -> str:
            return "-" if v is None else f"{v / 2**20:.3f}"

        for x in d["memory_slope"]:
            fp = fps.get(x["env"], {}).get("bytes_per_env")
            rows.append([x["env"], CONTENDER_LABELS[x["contender"]],
                         f"{x['from_n']}->{x['to_n']}", mb3(x["bytes_per_env"]),
                         mb3(x.get("hosts_per_env")), mb3(x.get("shm_per_env")),
                         mb3(x.get("step_alloc_per_env")), mb3(x.get("chunk_alloc_per_env")),
                         mb3(x.get("main_per_env")), mb3(x.get("call_data_per_env")),
                         mb3(fp)])  # fmt: skip
        lines += [
            "### Memory per added env",
            "",
            "PSS growth per added env between the fewest and the most envs of the sweep (one "
            "run each), in MB. asyncsample's growth is split: *env hosts* (their PSS without "
            "shared memory: the envs themselves, to set against the env's own footprint, "
            "measured the same way: PSS of one process holding 32 envs stepped 100 times "
            "after a warmed-up first env), *shared memory* (PSS of the `/dev/shm` arenas, "
            "counted in whichever process touched the pages; what asyncsample allocates for "
            "them: step buffers, one row of observation + final observation + action + "
            'reward + flags per env, and with `inference="host"` chunk buffers, that many '
            "rows per step of a chunk, 64 steps or as many as fit 8 MB per worker), and the "
            "*main process* without shared memory (mostly the data of one call, a sampler's "
            "data, not the pool's: *the call's data* estimates it as envs x (2 x fragment steps"
            " + 2) observations: recorder rows and the batch's observations, the batch's last "
            "observations and the episode pieces' copies of them; the sweep's largest runs use "
            "1 fragment step, so 4 observations per env).",
            "",
        ]
        lines += _table(["env", "contender", "envs", "PSS per added env", "env hosts",
                         "shared memory", "allocated: step buffers", "allocated: chunk buffers",
                         "main process", "the call's data (est.)", "the env's own footprint"],
                        rows)  # fmt: skip
    lines += ["## Which to pick", "", *guidance(results), ""]
    path.write_text("\n".join(lines))


def guidance(results: dict[str, Any]) -> list[str]:
    """README sentences: which contender for which situation, from this run's numbers."""
    summary, s = results["summary"], results["settings"]
    na, nm = s["n_envs_atari"], s["n_envs_mujoco"]

    def r(c: str, env: str, n: int, pol: bool) -> float | None:
        b = best_ours(summary, env, n, pol) if c == "ours" else best_of(summary, c, env, n, pol)
        return b["median"] if b else None

    def vs(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a and b else "n/a"

    pong_ep = r("envpool-async", "Pong-v5", na, False)
    pong_us = r("ours", "Pong-v5", na, False)
    hc_ep = r("envpool-sync", "HalfCheetah-v5", nm, True)
    hc_us = r("ours", "HalfCheetah-v5", nm, True)
    hc_sync = r("sync", "HalfCheetah-v5", nm, True)
    slopes = {(x["env"], x["contender"]): x for x in results["derived"]["memory_slope"]}
    fps = {f.get("env"): f.get("bytes_per_env") for f in results.get("footprints", [])}
    mem = ""
    for env in s["sweep_envs"]:
        ours, theirs = slopes.get((env, "asyncsample")), slopes.get((env, "async"))
        if ours and theirs:
            mem = (
                f" (here {ours['bytes_per_env'] / 2**20:.2f} MB of PSS per added {env} env, "
                f"against {theirs['bytes_per_env'] / 2**20:.1f} MB for AsyncVectorEnv; the env "
                f"itself: {(fps.get(env) or 0) / 2**20:.2f} MB)"
            )
    out = [
        "- **EnvPool** when the env is one of its C++ ports (Atari, MuJoCo, classic control, "
        "VizDoom, ...) and throughput is the goal: it has no per-step process round trip and no "
        f"Python in the env loop. Here asyncsample reached {vs(pong_us, pong_ep)} of EnvPool "
        f"async on Pong (random agent, {na} envs) and {vs(hc_us, hc_ep)} of EnvPool sync on "
        f"HalfCheetah with the MLP ({nm} envs). EnvPool cannot run a Python env, a custom "
        "wrapper stack in Python, or an env that must live on another machine.",
        "- **gymnasium SyncVectorEnv** when the env steps in microseconds (CartPole-class) and one "
        "core is enough: no processes, no copies, the least memory. It blocks the caller for the "
        "whole step of all envs, so it does not belong inside an event loop that serves "
        "anything else. On HalfCheetah with the policy asyncsample was "
        f"{vs(hc_us, hc_sync)} of it.",
        "- **asyncsample** when the envs are Python envs that cost more than the round trip "
        "(tens of microseconds and up: ALE with Python wrappers, MuJoCo through the bindings, "
        "simulators, games), when the trainer is an asyncio program that must stay responsive "
        "(the event loop keeps running while envs step), when step times vary (workers do not "
        "wait for each other), and when the pool must grow to hundreds of envs without a process "
        f"each{mem}.",
        *modes_guidance(results),
        "- **Not asyncsample** for an env EnvPool already ships, when raw steps/s is all that "
        "matters; or for envs cheaper than a process round trip with few envs per worker (use "
        "SyncVectorEnv, or asyncsample's local backend).",
        "- **AsyncVectorEnv / SB3 SubprocVecEnv** pay one process per env and one round trip per "
        "env step: fine for a few slow envs, the most memory and start-up time as envs grow.",
    ]
    return out


def modes_guidance(results: dict[str, Any]) -> list[str]:
    """Which ``inference`` mode won where, from this run's main comparison (one line per case)."""
    summary, s = results["summary"], results["settings"]
    cases = []
    for env in s["envs"]:
        n = s["n_envs_atari"] if ENVS[env].family == "atari" else s["n_envs_mujoco"]
        for pol in (False, True):
            best = {c: b for c in OURS if (b := best_of(summary, c, env, n, pol))}
            if len(best) < 2:
                continue
            ranked = sorted(best.values(), key=lambda a: -a["median"])
            base = best.get("asyncsample")
            rel = ", ".join(
                f"{INFERENCE[a['contender']]} {a['layout']} {_k(a['median'])}"
                + (f" ({a['median'] / base['median']:.2f}x per_worker)"
                   if base and a is not base else "")
                for a in ranked
            )  # fmt: skip
            cases.append(f"{env} {'policy' if pol else 'random'}: {rel}")
    if not cases:
        return []
    return [
        "- **Which `inference` mode** (best layout of each, steps/s, fastest first): "
        + "; ".join(cases)
        + ". `per_worker` runs the agent in the main process once per worker step; `batched` "
        "merges the workers' concurrent calls into one (fewer policy calls, same round trips); "
        "`host` runs a copy of the agent in every env host and steps chunks of up to 64 steps "
        "with no per-step round trip (the main process only copies the chunks; with a policy "
        "each host pays its own forward passes on its own core share).",
    ]


def write_plots(out: Path, results: dict[str, Any]) -> list[Path]:
    """``real_envs_scaling.png`` (the sweep) and ``real_envs_main.png`` (% of the ideal)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, s, d = results["summary"], results["settings"], results["derived"]
    paths: list[Path] = []
    sweep_keys = {r["key"] for r in results["runs"] if r["group"] == "sweep"}
    sweep = [a for a in summary.values() if a["key"] in sweep_keys and a["median"]]
    if sweep:
        metrics: list[tuple[str, Callable[[dict[str, Any]], float | None]]] = [
            ("steps/s", lambda a: a["median"]),
            ("main-process cores", lambda a: (a.get("split") or {}).get("main_cores")),
            ("PSS, all processes (MB)",
             lambda a: (a.get("pss") or {}).get("total_pss", 0) / 2**20 or None),
            ("stall p99 (ms): loop lag / step call",
             lambda a: (a.get("lag") or a.get("blocking") or {}).get("p99_ms")),
            ("start-up (s)", lambda a: a.get("startup")),
        ]  # fmt: skip
        envs = s["sweep_envs"]
        fig, axes = plt.subplots(len(metrics), len(envs), figsize=(5.5 * len(envs), 14),
                                 squeeze=False)  # fmt: skip
        for j, env in enumerate(envs):
            series: dict[str, list[dict[str, Any]]] = {}
            for a in sweep:
                if a["env"] == env:
                    label = (
                        f"{a['label']}, {a['n_workers']} workers over 2 processes"
                        if a["contender"] in OURS
                        else _row_label(a)
                    )
                    series.setdefault(label, []).append(a)
            for i, (name, fn) in enumerate(metrics):
                ax = axes[i][j]
                for label, pts in sorted(series.items()):
                    pts.sort(key=lambda a: a["n_envs"])
                    xs = [a["n_envs"] for a in pts if fn(a) is not None]
                    ys = [fn(a) for a in pts if fn(a) is not None]
                    ax.plot(xs, ys, marker="o", label=label)
                ax.set_xscale("log", base=2)
                if i in (0, 2, 3, 4):
                    ax.set_yscale("log")
                ax.set_title(f"{env}: {name}", fontsize=9)
                ax.grid(True, alpha=0.3)
                if i == len(metrics) - 1:
                    ax.set_xlabel("envs")
            axes[0][j].legend(fontsize=7)
        fig.suptitle(f"How the cost grows ({s['cores']} cores, load avg "
                     f"{_loads(results)[1]:.0f})", fontsize=11)  # fmt: skip
        fig.tight_layout()
        p = out / "real_envs_scaling.png"
        fig.savefig(p, dpi=90)
        plt.close(fig)
        paths.append(p)
    main_keys = {r["key"] for r in results["runs"] if r["group"] == "main"}
    main = [a for a in summary.values() if a["key"] in main_keys and a["median"]]
    if main:
        envs = [e for e in s["envs"] if any(a["env"] == e for a in main)]
        fig, axes = plt.subplots(1, len(envs), figsize=(4.5 * len(envs), 4.5), squeeze=False)
        for j, env in enumerate(envs):
            ax = axes[0][j]
            ide = d["ideal"].get(env, {}).get("ideal_rate") or 1.0
            labels = sorted({_row_label(a) for a in main if a["env"] == env})
            pos = np.arange(len(labels))
            for k, pol in enumerate((False, True)):
                ys = []
                for label in labels:
                    a = next((a for a in main if a["env"] == env and _row_label(a) == label
                              and a["policy"] == pol), None)  # fmt: skip
                    ys.append(100 * a["median"] / ide if a else 0.0)
                ax.bar(pos + (k - 0.5) * 0.4, ys, 0.4, label="policy" if pol else "random")
            ax.axhline(100, color="k", lw=0.8, ls="--")
            ax.set_xticks(pos, labels, rotation=60, ha="right", fontsize=7)
            ax.set_title(f"{env}: % of the {s['cores']}-core ideal", fontsize=9)
            ax.legend(fontsize=7)
        fig.tight_layout()
        p = out / "real_envs_main.png"
        fig.savefig(p, dpi=90)
        plt.close(fig)
        paths.append(p)
    return paths


def write_all(out: Path, results: dict[str, Any]) -> None:
    """Write ``results.md`` and the PNG charts from ``results`` (charts only with matplotlib)."""
    from benchmarks.report import draw_charts

    write_markdown(out / "results.md", results)
    draw_charts(write_plots, out, results)


# --------------------------------------------------------------------------------------------
# Entry point


def _from_log(out: Path) -> dict[str, Any]:
    """Results of the default settings from the runs in ``out/runs.jsonl``; writes JSON."""
    from benchmarks.report import machine_info

    records = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    s = Settings()
    done = {r["repeat"] for r in records if r["group"] == "main"}
    s.repeats = max(1, len(done))
    footprints: list[dict[str, Any]] = []
    for env in dict.fromkeys([*s.envs, *s.sweep_envs]):
        try:
            footprints.append(_footprint_in_child(env, s.timeout))
        except Exception as exc:
            footprints.append({"env": env, "error": f"{type(exc).__name__}: {exc}"})
    loads = [r["loadavg"] for r in records if r.get("loadavg")]
    machine = machine_info() | {
        "loadavg_start": loads[0] if loads else None,
        "loadavg_end": loads[-1] if loads else None,
        "minutes": sum(r.get("wall", 0.0) for r in records) / 60,
        "note": "rebuilt from runs.jsonl (the run was stopped before it wrote its JSON)",
    }
    summary = aggregate(records)
    results = {
        "machine": machine,
        "settings": asdict(s),
        "runs": records,
        "footprints": footprints,
        "summary": summary,
        "derived": derive(summary, s),
    }
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return results


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.real_envs [--quick] [--groups ...] [--out DIR]``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.real_envs", description=__doc__)
    p.add_argument("--run-one", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="seconds-long smoke test")
    p.add_argument("--groups", nargs="+", choices=["ideal", "main", "sweep", "footprint"])
    p.add_argument("--envs", nargs="+", choices=MAIN_ENVS)
    p.add_argument("--contenders", nargs="+", choices=[*PEERS, *OURS])
    p.add_argument("--repeats", type=int)
    p.add_argument("--sweep-envs", nargs="+", choices=SWEEP_ENVS)
    p.add_argument("--sweep-n", nargs="+", type=int)
    p.add_argument(
        "--fragment-steps",
        type=int,
        help="asyncsample steps per env per call in the main comparison (default: up to 32)",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the runs and the estimated length, run nothing",
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "real_envs")
    p.add_argument(
        "--render",
        action="store_true",
        help="only recompute the summary of OUT/results.json from its runs and re-render",
    )
    p.add_argument(
        "--from-log",
        action="store_true",
        help="with --render: rebuild OUT/results.json from the runs logged so far in "
        "OUT/results.jsonl (an interrupted run; footprints are measured again)",
    )
    args = p.parse_args(argv)
    if args.run_one:
        spec = RealSpec(**json.loads(Path(args.run_one[0]).read_text()))
        Path(args.run_one[1]).write_text(json.dumps(run_in_this_process(spec)))
        return 0
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.render and args.from_log:
        write_all(out, _from_log(out))
        return 0
    if args.render:
        # Summary and derived figures are recomputed from the runs with this code.
        results = json.loads((out / "results.json").read_text())
        results["summary"] = aggregate(results["runs"])
        results["derived"] = derive(results["summary"], Settings(**results["settings"]))
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        write_all(out, results)
        return 0
    s = Settings.quick_settings() if args.quick else Settings()
    for name in ("groups", "envs", "contenders", "repeats", "sweep_envs", "sweep_n",
                 "fragment_steps"):  # fmt: skip
        if getattr(args, name) is not None:
            setattr(s, name, getattr(args, name))
    if args.contenders is not None:  # the sweep too runs only the contenders named
        s.sweep_layouts = {c: w for c, w in s.sweep_layouts.items() if c in args.contenders}
        s.sweep_peers = [c for c in s.sweep_peers if c in args.contenders]
    print_plan(s, verbose=args.plan)
    if args.plan:
        return 0
    from benchmarks.report import machine_info

    machine = machine_info() | {"loadavg_start": os.getloadavg()}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="real-envs-") as tmp:
        ran = execute(s, Path(tmp), log=out / "runs.jsonl" if not s.quick else None)
    machine["loadavg_end"] = os.getloadavg()
    machine["minutes"] = (time.perf_counter() - t0) / 60
    summary = aggregate(ran["records"])
    results = {
        "machine": machine,
        "settings": asdict(s),
        "runs": ran["records"],
        "footprints": ran["footprints"],
        "summary": summary,
        "derived": derive(summary, s),
    }
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    write_all(out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
