"""Plan, run and aggregate the benchmark suite.

A *config* is one contender on one env with one layout; the suite runs every config
``repeats`` times, each run in a fresh process (``benchmarks._runner``), interleaving the
configs inside each repeat so that a slow spell of the machine hits every contender alike.
The first repeat is instrumented (memory of every process; event-loop lag for asyncsample);
its probes cost CPU, so it counts towards the rates only for a config run once
(:func:`aggregate`).

Groups:
    ``ideal``: one env in a plain ``env.step`` loop; the ideal is ``cores`` x its rate.
    ``main``: every contender with ``n_envs`` (8) env copies on every env; asyncsample in
        each of ``layouts`` (2x4, 4x2, 8x1 over 2 processes).
    ``big``: CartPole-v1 with ``big_n_envs`` (64) envs: asyncsample vs the gymnasium peers.
    ``scaling``: CartPole-v1 throughput against the number of envs.
    ``overhead``: NoOp-v0 with one env, and with 8 envs in one worker: the round trip.
    ``policy`` (not run by default; ``--groups policy``): the same torch MLP drives every
        contender (SyncVectorEnv, AsyncVectorEnv, SB3 SubprocVecEnv, asyncsample in each
        ``inference`` mode and layout) on ``policy_envs`` with ``policy_n_envs`` envs.
    ``vector``: ``asyncsample.VectorEnv`` against gymnasium's vector envs.
    ``host``: ``inference="host"`` with a random agent in every layout.
    ``real``: the Atari games and MuJoCo (``real_envs``) against EnvPool (sync and async) and
        the gymnasium peers, with a random agent and with a torch policy (Nature-CNN for
        Atari, the MLP for MuJoCo), asyncsample in each inference mode.
    ``sweep``: CartPole-v1 and Pong-v5 with 8 to 512 envs: steps/s, memory (PSS) and the
        length of a run (start-up included) as the envs grow.
    ``ray``: ``backend="ray"`` against ``backend="process"`` in the same layout.
    ``stragglers``: ``fraction_samples`` below 1 against the fixed per-worker split, one worker
        10x slower than the others.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import statistics
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._runner import run_fresh
from benchmarks.contenders import CONTENDERS
from benchmarks.envs import full_id
from benchmarks.runs import RunSpec

ALL_ENVS = ["CartPole-v1", "FixedCost-v0", "HeavyTail-v0", "Image-v0", "NoOp-v0"]
#: The real envs (``real`` and ``sweep`` groups): Atari under the standard preprocessing
#: (:func:`benchmarks.envs.make_atari`) and MuJoCo, each with its policy in the loop.
REAL_ENVS = {"Pong-v5": "cnn", "Breakout-v5": "cnn", "HalfCheetah-v5": "mlp", "Humanoid-v5": "mlp"}
#: Raw-pixel envs of the ``real`` group (issue 35, :data:`benchmarks.envs.RAW_PIXELS`), run
#: with the random agent only, by family.
RAW_ENVS = {
    "PongRaw-v5": "atari",
    "HalfCheetahPixels84-v5": "mujoco",
    "HalfCheetahPixels256-v5": "mujoco",
}
#: Env copies of the ``real`` group: 8 for Atari and pixels, 32 for MuJoCo.
REAL_N_ENVS = {
    "Pong-v5": 8,
    "Breakout-v5": 8,
    "HalfCheetah-v5": 32,
    "Humanoid-v5": 32,
    **dict.fromkeys(RAW_ENVS, 8),
}
#: Every env a study may run (``--envs``).
KNOWN_ENVS = [*ALL_ENVS, "NoiseImage-v0", *REAL_ENVS, *RAW_ENVS]
PEERS = ["sync", "async", "sb3", "tianshou-subproc", "tianshou-shmem", "envpool", "envpool-async"]
OURS = ["asyncsample", "asyncsample-local", "asyncsample-vector", "asyncsample-ray"]
#: TorchRL's collectors (the policy workload only; :mod:`benchmarks.torchrl_peers`).
TORCHRL = ["torchrl-collector", "torchrl-multisync", "torchrl-multiasync", "torchrl-asyncbatched"]
#: The machine's ceiling (:mod:`benchmarks.ceiling`): a contender of every group but ``ideal``.
CEILING = "ceiling"
#: Contenders of the ``vector`` group only: our face forced onto hosts, PufferLib's
#: multiprocessing vectorization and TorchRL's AsyncEnvPool (:mod:`benchmarks.vector_peers`).
VECTOR_ONLY = ["asyncsample-vector-hosts", "pufferlib", "pufferlib-1w", "torchrl-pool"]
ALL_CONTENDERS = [CEILING, *PEERS, *OURS, *TORCHRL, *VECTOR_ONLY]
GROUPS = ["ideal", "main", "big", "scaling", "overhead"]
#: Groups that run only when named (``--groups policy``) or by their study.
EXTRA_GROUPS = ["policy", "vector", "host", "real", "sweep", "ray", "stragglers"]
POLICY_ENVS = ["CartPole-v1", "HalfCheetah-v5"]
#: Contenders driven like a gymnasium vector env (one policy call per vector step), and the rest
#: of the policy workload's peers.
POLICY_PEERS = ["sync", "async", "sb3", "asyncsample-vector", CEILING, *TORCHRL]

#: Contender -> module that must be importable for it to run.
REQUIRES = {
    "sb3": "stable_baselines3",
    "tianshou-subproc": "tianshou",
    "tianshou-shmem": "tianshou",
    "envpool": "envpool",
    "envpool-async": "envpool",
    "asyncsample": "asyncsample",
    "asyncsample-ray": "ray",
    "asyncsample-local": "asyncsample",
    "asyncsample-vector": "asyncsample",
    "asyncsample-vector-hosts": "asyncsample",
    **dict.fromkeys(TORCHRL, "torchrl"),
    "pufferlib": "pufferlib.vector",
    "pufferlib-1w": "pufferlib.vector",
    "torchrl-pool": "torchrl",
}
#: Peers that import torch (slow to start); ``--quick`` skips them unless named.
TORCH_PEERS = {"sb3", "tianshou-subproc", "tianshou-shmem", *TORCHRL, "torchrl-pool"}


@dataclass
class Settings:
    """Everything that decides what the suite runs.

    Attributes:
        envs: Env names to run.
        contenders: Contender keys to run (``ideal`` always runs for the ratios).
        groups: Groups to run (see the module docstring).
        repeats: Runs per config.
        cores: The CPU budget every contender gets.
        n_envs: Env copies in the main comparison.
        n_processes: asyncsample env-host processes.
        layouts: asyncsample (workers, envs per worker) layouts for ``n_envs``.
        big_n_envs: Env copies of the ``big`` group.
        big_layouts: asyncsample layouts for ``big_n_envs``.
        scaling: Env counts of the scaling series.
        scaling_workers: asyncsample workers in the scaling series (capped by the env count).
        local_workers: Workers of the asyncsample local backend.
        transitions: Timed transitions per run, per env.
        ideal_factor: The ideal loop times ``ideal_factor`` x the env's transitions.
        min_seconds: A timed phase goes on past its transitions until it lasted this long.
        warmup_fraction: Untimed warm-up, as a fraction of the timed transitions.
        fragment_steps: asyncsample steps per env per ``obtain_fragments`` call.
        timeout: Seconds before a run is killed.
        retry_disturbed: Re-run a run up to this many times when others (other processes, the
            hypervisor's steal) took more than ``max_foreign`` cores during its timed phase
            (the least disturbed is kept).
        max_foreign: Cores others may take before a run counts as disturbed.
        quick: Tiny smoke-test settings.
        explicit: The contenders were named on the command line.
        policy_envs: Envs of the policy workload.
        policy_n_envs: Env counts of the policy workload.
        policy_layouts: asyncsample layouts of the policy workload, by env count.
        policy_inference: asyncsample inference modes of the policy workload.
        policy_transitions: Timed transitions of a policy run, per env.
        vector_envs: Envs of the ``vector`` group (``VectorEnv`` against gymnasium's).
        vector_big_envs: Those of ``vector_envs`` the ``vector`` group also runs with
            ``big_n_envs`` envs (where a cross-process round costs more than the envs).
        host_envs: Envs of the ``host`` group (``inference="host"``, random agent).
        host_layouts: asyncsample layouts of the ``host`` group (every one a user may pick).
        host_fragment_steps: Steps per env per call in the ``host`` group.
        once: Contenders run in the first repeat only (slow to start, far from the others).
        real_envs: Envs of the ``real`` group.
        real_n_envs: Env copies of the ``real`` group, by env.
        real_layouts: asyncsample worker counts of the ``real`` group (``n / workers`` envs
            each, ``n_processes`` hosts), by inference mode and env family (atari, mujoco;
            ``pixels``, where given, for the rendered MuJoCo envs instead of ``mujoco``).
        real_fragment_steps: Steps per env per call in the ``real`` group (CleanRL's PPO
            rollout: 128).
        raw_fragment_steps: Steps per env per call of the raw-pixel envs named here, instead
            of ``real_fragment_steps`` (a software render costs ~75 ms of CPU: calls of 128
            steps of 8 envs would make each run minutes long).
        sweep_envs: Envs of the ``sweep`` group.
        sweep_n: Env counts of the ``sweep`` group.
        sweep_process_cap: Largest env count of AsyncVectorEnv (one process per env) per env.
        sweep_layouts: asyncsample worker counts of the ``sweep`` group, by inference mode.
        ray_envs: Envs of the ``ray`` group.
        ray_layouts: asyncsample layouts (workers, envs per worker) of the ``ray`` group.
        ray_fragment_steps: Steps per env per call in the ``ray`` group.
        straggler_layout: (workers, envs per worker) of the ``stragglers`` group.
        straggler_fractions: ``fraction_samples`` values of the ``stragglers`` group.
        straggler_calls: The calls of the ``stragglers`` group (``samples``, ``fragments``).
        straggler_cost: Step cost (seconds) of the slow worker's envs (the others': 200 us).
        straggler_episode_length: Steps per episode in the ``stragglers`` group.
        straggler_steps: Steps per env per call in the ``stragglers`` group.
    """

    envs: list[str] = field(default_factory=lambda: list(ALL_ENVS))
    contenders: list[str] = field(default_factory=lambda: list(ALL_CONTENDERS))
    groups: list[str] = field(default_factory=lambda: list(GROUPS))
    repeats: int = 3
    cores: int = 2
    n_envs: int = 8
    n_processes: int = 2
    layouts: list[tuple[int, int]] = field(default_factory=lambda: [(2, 4), (4, 2), (8, 1)])
    big_n_envs: int = 64
    big_layouts: list[tuple[int, int]] = field(default_factory=lambda: [(2, 32), (4, 16), (8, 8)])
    scaling: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    scaling_workers: int = 4
    local_workers: int = 2
    transitions: dict[str, int] = field(
        default_factory=lambda: {
            "CartPole-v1": 10_000,
            "FixedCost-v0": 6_000,
            "HeavyTail-v0": 6_000,
            "Image-v0": 10_000,
            "NoOp-v0": 10_000,
            "NoiseImage-v0": 10_000,
            "Pong-v5": 2_000,
            "Breakout-v5": 2_000,
            "HalfCheetah-v5": 6_000,
            "Humanoid-v5": 3_000,
            "PongRaw-v5": 4_000,
            "HalfCheetahPixels84-v5": 200,  # software rendering: ~75 ms of CPU a step
            "HalfCheetahPixels256-v5": 200,
        }
    )
    ideal_factor: float = 1.0
    min_seconds: float = 1.0
    warmup_fraction: float = 0.1
    fragment_steps: int = 128
    timeout: float = 300.0
    retry_disturbed: int = 0
    max_foreign: float = 0.25
    quick: bool = False
    explicit: bool = False
    policy_envs: list[str] = field(default_factory=lambda: list(POLICY_ENVS))
    policy_n_envs: list[int] = field(default_factory=lambda: [8, 32])
    policy_layouts: dict[int, list[tuple[int, int]]] = field(
        default_factory=lambda: {8: [(2, 4), (8, 1)], 32: [(2, 16), (4, 8), (8, 4)]}
    )
    policy_inference: list[str] = field(
        default_factory=lambda: ["auto", "per_worker", "batched", "host"]
    )
    policy_transitions: dict[str, int] = field(
        default_factory=lambda: {
            "CartPole-v1": 10_000,
            "HalfCheetah-v5": 5_000,
            "Humanoid-v5": 3_000,
            "Pong-v5": 2_000,
            "Breakout-v5": 2_000,
        }
    )
    vector_envs: list[str] = field(
        default_factory=lambda: ["CartPole-v1", "FixedCost-v0", "Image-v0"]
    )
    vector_big_envs: list[str] = field(default_factory=lambda: ["CartPole-v1"])
    host_envs: list[str] = field(
        default_factory=lambda: ["FixedCost-v0", "HeavyTail-v0", "CartPole-v1"]
    )
    host_layouts: list[tuple[int, int]] = field(default_factory=lambda: [(2, 4), (4, 2), (8, 1)])
    host_fragment_steps: int = 256
    once: list[str] = field(default_factory=list)
    real_envs: list[str] = field(default_factory=lambda: ["Pong-v5", "HalfCheetah-v5"])
    real_n_envs: dict[str, int] = field(default_factory=lambda: dict(REAL_N_ENVS))
    real_layouts: dict[str, dict[str, list[int]]] = field(
        default_factory=lambda: {
            "per_worker": {"atari": [2, 4], "mujoco": [2, 4], "pixels": [2]},
            "batched": {"atari": [2], "mujoco": [4], "pixels": [4]},
            "host": {"atari": [2, 4, 8], "mujoco": [2, 4], "pixels": [2]},
        }
    )
    real_fragment_steps: int = 128
    raw_fragment_steps: dict[str, int] = field(
        default_factory=lambda: {"HalfCheetahPixels84-v5": 6, "HalfCheetahPixels256-v5": 6}
    )
    sweep_envs: list[str] = field(default_factory=lambda: ["CartPole-v1", "Pong-v5"])
    sweep_n: list[int] = field(default_factory=lambda: [8, 32, 128, 512])
    sweep_process_cap: dict[str, int] = field(
        default_factory=lambda: {"CartPole-v1": 128, "Pong-v5": 64}
    )
    sweep_layouts: dict[str, list[int]] = field(
        default_factory=lambda: {"per_worker": [2, 8], "host": [2]}
    )
    ray_envs: list[str] = field(
        default_factory=lambda: ["CartPole-v1", "Image-v0", "NoiseImage-v0"]
    )
    ray_layouts: list[tuple[int, int]] = field(default_factory=lambda: [(4, 8), (4, 32)])
    ray_fragment_steps: int = 16
    straggler_layout: tuple[int, int] = (4, 4)
    straggler_fractions: list[float] = field(default_factory=lambda: [1.0, 0.5, 0.25])
    straggler_calls: list[str] = field(default_factory=lambda: ["samples", "fragments"])
    straggler_cost: float = 2e-3
    straggler_episode_length: int = 10
    straggler_steps: int = 250

    @classmethod
    def quick_settings(cls, **overrides: Any) -> Settings:
        """Tiny settings: one repeat of everything in seconds (a smoke test)."""
        base = cls(
            repeats=1,
            layouts=[(2, 4)],
            big_n_envs=16,
            big_layouts=[(2, 8)],
            scaling=[2, 16],
            transitions=dict.fromkeys(ALL_ENVS, 1_000),
            min_seconds=0.0,
            fragment_steps=16,
            timeout=60.0,
            quick=True,
            policy_n_envs=[8],
            policy_layouts={8: [(2, 4)]},
            policy_inference=["per_worker", "batched", "host"],
            host_layouts=[(2, 4)],
            host_fragment_steps=16,
            policy_transitions={"CartPole-v1": 1_000, "HalfCheetah-v5": 500, "Pong-v5": 100},
            real_envs=["HalfCheetah-v5"],
            real_n_envs={"Pong-v5": 4, "HalfCheetah-v5": 4, "PongRaw-v5": 4,
                         "HalfCheetahPixels84-v5": 2, "HalfCheetahPixels256-v5": 2},
            real_layouts={"per_worker": {"mujoco": [2]}, "host": {"atari": [2], "mujoco": [2]}},
            real_fragment_steps=16,
            sweep_envs=["CartPole-v1"],
            sweep_n=[4, 16],
            sweep_layouts={"per_worker": [2]},
            ray_envs=["CartPole-v1"],
            ray_layouts=[(2, 2)],
            straggler_fractions=[1.0, 0.5],
            straggler_calls=["fragments"],
            straggler_steps=25,
        )  # fmt: skip
        base.transitions |= {
            "Pong-v5": 100,
            "HalfCheetah-v5": 500,
            "PongRaw-v5": 200,
            "HalfCheetahPixels84-v5": 20,
            "HalfCheetahPixels256-v5": 20,
        }
        for key, value in overrides.items():
            setattr(base, key, value)
        return base

    def n_transitions(self, env: str, n_envs: int, policy: str = "", steps: int = 0) -> int:
        """Timed transitions of a run: the env's budget, and at least 4 asyncsample calls
        (of ``steps`` per env, default the env's ``raw_fragment_steps`` or ``fragment_steps``)."""
        budget = (self.policy_transitions if policy else self.transitions).get(env, 10_000)
        steps = steps or self.raw_fragment_steps.get(env, 0) or self.fragment_steps
        return max(budget, 4 * n_envs * steps)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able settings."""
        return asdict(self)


@dataclass(frozen=True)
class Config:
    """One contender on one env with one layout (asyncsample) or env count (peers)."""

    contender: str
    env: str
    n_envs: int
    n_workers: int = 0
    envs_per_worker: int = 0
    n_processes: int = 0
    policy: str = ""  # "" random actions; "mlp": the policy workload
    inference: str = ""  # asyncsample's inference mode ("": the sampler's default, "auto")
    steps: int = 0  # steps per env per call, when not the settings' fragment_steps
    fraction: float = 0.0  # stragglers: fraction_samples (0: not a straggler run)
    call: str = ""  # stragglers: "samples" or "fragments" ("": obtain_fragments)

    @property
    def key(self) -> str:
        """Unique id of the config."""
        key = f"{self.contender}|{self.env}|{self.n_envs}|{self.layout}"
        if self.policy or self.inference:
            key = f"{key}|{self.policy}|{self.inference}"
        if self.fraction:
            key = f"{key}|f{self.fraction:g}|{self.call}"
        return f"{key}|s{self.steps}" if self.steps else key

    @property
    def layout(self) -> str:
        """``WxK/PN`` for asyncsample (``WxK`` for local), empty for peers."""
        if self.contender in ("asyncsample", "asyncsample-ray"):
            return f"{self.n_workers}x{self.envs_per_worker}/P{self.n_processes}"
        if self.contender == "asyncsample-local":
            return f"{self.n_workers}x{self.envs_per_worker}"
        return ""

    @property
    def label(self) -> str:
        """Human-readable name."""
        name = CONTENDERS[self.contender][1]
        if self.inference:
            name = f"{name} {self.inference}"
        if self.fraction:
            name = f"{name} obtain_{self.call} fraction_samples={self.fraction:g}"
        return f"{name} {self.layout}" if self.layout else name


def _ours(contender: str, env: str, n: int, w: int, p: int, **kw: Any) -> Config:
    w = max(1, min(w, n))
    procs = p if contender in ("asyncsample", "asyncsample-ray") else 0
    return Config(contender, env, n, w, n // w, procs, **kw)


def family(env: str) -> str:
    """``atari``, ``mujoco`` or ``""`` (the synthetic envs and classic control)."""
    if env in RAW_ENVS:
        return RAW_ENVS[env]
    if REAL_ENVS.get(env) == "cnn":
        return "atari"
    return "mujoco" if env in REAL_ENVS else ""


def plan(settings: Settings) -> dict[str, list[Config]]:
    """The configs of each group (a config may appear in several groups).

    Args:
        settings: What to run.

    Returns:
        Group name -> configs, in run order.
    """
    s = settings
    chosen = [c for c in ALL_CONTENDERS if c in s.contenders]
    groups: dict[str, list[Config]] = {g: [] for g in s.groups}

    def add_for(group: str, env: str, n: int, layouts: Iterable[tuple[int, int]]) -> None:
        for c in chosen:
            if c == "asyncsample":
                for w, k in layouts:
                    if w * k == n:
                        groups[group].append(_ours(c, env, n, w, s.n_processes))
            elif c == "asyncsample-local":
                groups[group].append(_ours(c, env, n, s.local_workers, 0))
            elif c not in (CEILING, *TORCHRL, *VECTOR_ONLY):
                groups[group].append(Config(c, env, n))

    if "ideal" in groups:
        groups["ideal"] = [Config("ideal", env, 1) for env in s.envs]
    if "main" in groups:
        for env in s.envs:
            add_for("main", env, s.n_envs, s.layouts)
    cartpole = "CartPole-v1" in s.envs
    if "big" in groups and cartpole:
        big = [c for c in chosen if c in ("sync", "async", *OURS)]
        for c in big:
            if c == "asyncsample":
                for w, k in s.big_layouts:
                    groups["big"].append(_ours(c, "CartPole-v1", w * k, w, s.n_processes))
            elif c == "asyncsample-local":
                groups["big"].append(_ours(c, "CartPole-v1", s.big_n_envs, s.local_workers, 0))
            else:
                groups["big"].append(Config(c, "CartPole-v1", s.big_n_envs))
    if "scaling" in groups and cartpole:
        for n in s.scaling:
            for c in chosen:
                if c in ("sync", "async", "asyncsample-vector"):
                    groups["scaling"].append(Config(c, "CartPole-v1", n))
                elif c == "asyncsample":
                    groups["scaling"].append(
                        _ours(c, "CartPole-v1", n, s.scaling_workers, s.n_processes)
                    )
    if "policy" in groups:
        for env in s.policy_envs:
            for n in s.policy_n_envs:
                for c in chosen:
                    if c in POLICY_PEERS and c != CEILING:
                        groups["policy"].append(Config(c, env, n, policy="mlp"))
                    elif c == "asyncsample":
                        for inference in s.policy_inference:
                            for w, k in s.policy_layouts.get(n, []):
                                if w * k == n:
                                    groups["policy"].append(
                                        Config(c, env, n, w, k, s.n_processes, "mlp", inference)
                                    )
    if "vector" in groups:
        cells = [(env, s.n_envs) for env in s.vector_envs]
        cells += [(env, s.big_n_envs) for env in s.vector_big_envs if env in s.vector_envs]
        for env, n in cells:
            for c in chosen:
                if c in ("sync", "async", "asyncsample-vector", *VECTOR_ONLY):
                    groups["vector"].append(Config(c, env, n))
    if "host" in groups:
        for env in s.host_envs:
            for c in chosen:
                if c == "async":
                    groups["host"].append(Config(c, env, s.n_envs))
                elif c == "asyncsample":
                    for w, k in s.host_layouts:
                        for inference in ("per_worker", "host"):
                            groups["host"].append(
                                Config(c, env, w * k, w, k, s.n_processes, "", inference,
                                       s.host_fragment_steps)
                            )  # fmt: skip
    if "real" in groups:
        _plan_real(groups["real"], chosen, s)
    if "sweep" in groups:
        _plan_sweep(groups["sweep"], chosen, s)
    if "ray" in groups:
        for env in s.ray_envs:
            for c in chosen:
                if c in ("asyncsample", "asyncsample-ray"):
                    for w, k in s.ray_layouts:
                        groups["ray"].append(
                            _ours(c, env, w * k, w, s.n_processes, steps=s.ray_fragment_steps)
                        )
    if "stragglers" in groups and "asyncsample" in chosen:
        w, k = s.straggler_layout
        for call in s.straggler_calls:
            for f in s.straggler_fractions:
                groups["stragglers"].append(
                    Config("asyncsample", "FixedCost-v0", w * k, w, k, s.n_processes,
                           inference="per_worker", steps=s.straggler_steps, fraction=f,
                           call=call)
                )  # fmt: skip
    if CEILING in chosen:
        _add_ceilings(groups, s)
    if "overhead" in groups and "NoOp-v0" in s.envs:
        for c in chosen:
            if c in ("sync", "async"):
                groups["overhead"].append(Config(c, "NoOp-v0", 1))
            elif c == "asyncsample":
                for n in (1, s.n_envs):  # round trips of one worker: per_worker's
                    groups["overhead"].append(
                        Config(c, "NoOp-v0", n, 1, n, 1, inference="per_worker")
                    )
            elif c == "asyncsample-local":
                groups["overhead"].append(Config(c, "NoOp-v0", 1, 1, 1, 0, inference="per_worker"))
    return groups


def _layout_family(env: str, by_family: dict[str, list[int]]) -> str:
    """The key of ``env``'s layouts in one mode's ``real_layouts``: ``pixels`` for a rendered
    MuJoCo env where the mode has that key, else the env's family."""
    if env in RAW_ENVS and family(env) == "mujoco" and "pixels" in by_family:
        return "pixels"
    return family(env)


def _plan_real(configs: list[Config], chosen: list[str], s: Settings) -> None:
    """The ``real`` group: every real env with a random agent, then with its policy."""
    for env in s.real_envs:
        n = s.real_n_envs.get(env, s.n_envs)
        steps = s.raw_fragment_steps.get(env, s.real_fragment_steps)
        for policy in ("",) if env in RAW_ENVS else ("", REAL_ENVS[env]):
            for c in chosen:
                if c in ("sync", "async", "sb3", "envpool", "envpool-async"):
                    configs.append(Config(c, env, n, policy=policy))
                elif c == "asyncsample":
                    for inference, by_family in s.real_layouts.items():
                        for w in by_family.get(_layout_family(env, by_family), []):
                            configs.append(_ours(c, env, n, w, s.n_processes, policy=policy,
                                                 inference=inference, steps=steps))  # fmt: skip


def _plan_sweep(configs: list[Config], chosen: list[str], s: Settings) -> None:
    """The ``sweep`` group: random agent, 8 to 512 envs (asyncsample: fewer steps per call)."""
    for env in s.sweep_envs:
        budget = s.transitions.get(env, 10_000)
        for n in s.sweep_n:
            steps = max(1, min(32, budget // (4 * n)))
            for c in chosen:
                if c in ("sync", "envpool") or (
                    c == "async" and n <= s.sweep_process_cap.get(env, 128)
                ):
                    configs.append(Config(c, env, n))
                elif c == "asyncsample":
                    for inference, workers in s.sweep_layouts.items():
                        for w in workers:
                            configs.append(_ours(c, env, n, w, s.n_processes, inference=inference,
                                                 steps=steps))  # fmt: skip


def ceiling_config(env: str, n_envs: int, policy: str, cores: int) -> Config:
    """The ceiling config a run of ``env`` with ``n_envs`` envs is set against.

    A random agent's ceiling is one env per loop whatever ``n_envs``; a policy's is
    ``SyncVectorEnv(n_envs / cores)`` per loop.
    """
    return Config(CEILING, env, n_envs if policy else cores, policy=policy)


def _add_ceilings(groups: dict[str, list[Config]], s: Settings) -> None:
    """Put the ceiling of every (env, env count, policy) cell into the group of that cell."""
    for name, configs in groups.items():
        if name in ("ideal", "overhead"):
            continue
        cells = {(c.env, c.n_envs, c.policy) for c in configs if c.contender != CEILING}
        have = {c.key for c in configs}
        for env, n, policy in sorted(cells):
            cfg = ceiling_config(env, n, policy, s.cores)
            if cfg.key not in have:
                configs.append(cfg)
                have.add(cfg.key)


def unique_configs(groups: dict[str, list[Config]]) -> list[Config]:
    """All configs once, in first-seen order."""
    seen: dict[str, Config] = {}
    for configs in groups.values():
        for cfg in configs:
            seen.setdefault(cfg.key, cfg)
    return list(seen.values())


def pre_skip(cfg: Config, settings: Settings) -> str | None:
    """A reason to skip ``cfg`` without starting a process, or None."""
    envpool_envs = ("CartPole-v1", *REAL_ENVS, "PongRaw-v5")
    if cfg.contender.startswith("envpool") and cfg.env not in envpool_envs:
        return "EnvPool runs only its own C++ envs (CartPole-v1, Atari, MuJoCo; no pixel MuJoCo)"
    if cfg.policy and importlib.util.find_spec("torch") is None:
        return "the policy workload needs torch (pip install torch)"
    if family(cfg.env) == "mujoco" and importlib.util.find_spec("mujoco") is None:
        return f"{cfg.env} needs mujoco (pip install 'gymnasium[mujoco]')"
    if family(cfg.env) == "atari" and importlib.util.find_spec("ale_py") is None:
        return f"{cfg.env} needs ale-py (pip install ale-py)"
    if settings.quick and cfg.contender in TORCH_PEERS and not settings.explicit:
        return "--quick skips the torch-based peers (slow to start) unless --contenders names them"
    module = REQUIRES.get(cfg.contender)
    if module is not None and not installed(module):
        return f"{module} is not installed (pip install 'asyncsample[bench]')"
    return None


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (a dotted name whose package is missing: no, where
    ``find_spec`` would raise ``ModuleNotFoundError``)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def make_spec(cfg: Config, settings: Settings, instrument: bool) -> RunSpec:
    """The :class:`RunSpec` of one run of ``cfg``."""
    n = settings.n_transitions(cfg.env, cfg.n_envs, cfg.policy, cfg.steps)
    if cfg.contender == "ideal":
        n = int(n * settings.ideal_factor)
    return RunSpec(
        contender=cfg.contender,
        env=cfg.env,
        env_id=full_id(cfg.env),
        n_envs=cfg.n_envs,
        n_transitions=n,
        warmup=max(1, int(n * settings.warmup_fraction)),
        seed=0,
        n_workers=cfg.n_workers or 1,
        envs_per_worker=cfg.envs_per_worker or cfg.n_envs,
        n_processes=cfg.n_processes or settings.cores,
        cores=settings.cores,
        fragment_steps=cfg.steps or settings.fragment_steps,
        instrument=instrument,
        min_seconds=settings.min_seconds,
        policy=cfg.policy,
        inference=cfg.inference or "auto",
        call=cfg.call or "fragments",
        fraction=cfg.fraction or 1.0,
        slow_worker=1 if cfg.fraction else -1,
        slow_cost=settings.straggler_cost,
        episode_length=settings.straggler_episode_length if cfg.fraction else 0,
    )


#: Seconds one env takes to build and reset on a quiet core (Pong: ALE start-up and up to 30
#: no-op steps): a run's timeout grows with it (512 Pong envs take minutes to start).
STARTUP_S = {"atari": 0.3, "mujoco": 0.05, "": 0.002}


def run_timeout(cfg: Config, settings: Settings) -> float:
    """``settings.timeout`` plus three times the envs' start-up in one process."""
    return settings.timeout + 3 * cfg.n_envs * STARTUP_S[family(cfg.env)]


#: How a suite run's fresh process is started (``python -m benchmarks._runner SPEC OUT``).
RUNNER: tuple[str, ...] = ("-m", "benchmarks._runner")


def run_one(spec: RunSpec, timeout: float, workdir: Path) -> dict[str, Any]:
    """Run one spec in a fresh ``python -m benchmarks._runner`` process.

    Args:
        spec: The run.
        timeout: Seconds before the run (and its process tree) is killed.
        workdir: Scratch directory for the spec, outcome and log files.

    Returns:
        The runner's outcome dict (``status`` ``"timeout"`` when it was killed) plus ``wall``
        (seconds of the whole process); see :func:`benchmarks._runner.run_fresh`.
    """
    return run_fresh(RUNNER, spec.to_dict(), timeout, workdir)


def execute(
    settings: Settings, workdir: Path, progress: bool = True, log: Path | None = None
) -> list[dict[str, Any]]:
    """Run every config ``settings.repeats`` times with a progress bar.

    Args:
        settings: What to run.
        workdir: Scratch directory.
        progress: Show a tqdm bar on stderr.
        log: If given, each record is appended to this JSON-lines file as it completes.

    Returns:
        One record per run (and one per pre-skipped config).
    """
    from tqdm import tqdm

    groups = plan(settings)
    configs = unique_configs(groups)
    records: list[dict[str, Any]] = []
    runnable: list[Config] = []
    for cfg in configs:
        reason = pre_skip(cfg, settings)
        if reason is None:
            runnable.append(cfg)
        else:
            records.append(_record(cfg, -1, {"status": "skipped", "note": reason}))
    once = sum(cfg.contender in settings.once for cfg in runnable)
    bar = tqdm(
        total=len(runnable) * settings.repeats - once * (settings.repeats - 1),
        desc="benchmarks",
        unit="run",
        disable=not progress,
        dynamic_ncols=True,
    )
    try:
        for repeat in range(settings.repeats):
            for cfg in runnable:
                if repeat and cfg.contender in settings.once:
                    continue
                bar.set_postfix_str(f"r{repeat + 1} {cfg.env} {cfg.label} n={cfg.n_envs}")
                spec = make_spec(cfg, settings, instrument=(repeat == 0))
                timeout = run_timeout(cfg, settings)
                outcome = run_one(spec, timeout, workdir)
                attempts = 1
                while attempts <= settings.retry_disturbed and _foreign(outcome) > (
                    settings.max_foreign
                ):
                    time.sleep(2.0)
                    again = run_one(spec, timeout, workdir)
                    attempts += 1
                    if again.get("status") != "ok" or _foreign(again) < _foreign(outcome):
                        outcome = again
                outcome["attempts"] = attempts
                records.append(_record(cfg, repeat, outcome, spec))
                if log is not None:
                    with log.open("a") as fh:
                        fh.write(json.dumps(records[-1]) + "\n")
                bar.update()
    finally:
        bar.close()
    return records


def _foreign(outcome: dict[str, Any]) -> float:
    """Cores others took during a run's timed phase (0 if unknown): other processes on the
    machine, and the hypervisor's steal (CPU time a virtual machine's cores were ready to run
    but another guest had them)."""
    cpu = outcome.get("cpu") or {}
    return float(cpu.get("foreign_cores", 0.0)) + float(cpu.get("steal_cores", 0.0))


def _record(
    cfg: Config, repeat: int, outcome: dict[str, Any], spec: RunSpec | None = None
) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "key": cfg.key,
        "contender": cfg.contender,
        "label": cfg.label,
        "env": cfg.env,
        "n_envs": cfg.n_envs,
        "layout": cfg.layout,
        "n_workers": cfg.n_workers,
        "envs_per_worker": cfg.envs_per_worker,
        "n_processes": cfg.n_processes,
        "policy": cfg.policy,
        "inference": cfg.inference,
        "repeat": repeat,
    }
    if spec is not None:
        rec["n_transitions_target"] = spec.n_transitions
        rec["instrumented"] = spec.instrument
    rec.update(outcome)
    return rec


def aggregate(
    records: list[dict[str, Any]], max_foreign: float = 0.25
) -> dict[str, dict[str, Any]]:
    """Per config: rates of the runs, median, min, max, status and notes.

    The rates (and CPU, wall and disturbance figures) come from the uninstrumented runs when a
    config has any: the instrumented run's probes (a task waking the sampler's event loop every
    millisecond, memory sampling of every process) cost CPU the other runs do not pay, which on
    a 2-core machine whose cores the env hosts keep busy slowed ``inference="host"`` by up to a
    fifth. A config run once keeps its one run. Memory and loop lag come from the instrumented
    run.

    Args:
        records: Output of :func:`execute`.
        max_foreign: A config is ``disturbed`` when other processes took more cores than
            this during one of its runs.

    Returns:
        Config key -> summary.
    """
    out: dict[str, dict[str, Any]] = {}
    plain = {r["key"] for r in records if r.get("status") == "ok" and not r.get("instrumented")}
    for rec in records:
        agg = out.setdefault(
            rec["key"],
            {
                k: rec[k]
                for k in (
                    "contender",
                    "label",
                    "env",
                    "n_envs",
                    "layout",
                    "n_workers",
                    "envs_per_worker",
                    "n_processes",
                )
            }
            | {"policy": rec.get("policy", ""), "inference": rec.get("inference", "")}
            | {
                "rates": [],
                "notes": [],
                "errors": [],
                "memory": None,
                "lag": None,
                "own_cores": [],
                "main_cores": [],
                "host_cores": [],
                "foreign_cores": [],
                "walls": [],
            },
        )
        status = rec.get("status")
        if status == "ok" and rec.get("instrumented") and rec["key"] in plain:
            for note in rec.get("notes") or []:
                if note not in agg["notes"]:
                    agg["notes"].append(note)
            agg["memory"] = rec.get("memory") or agg["memory"]
            agg["lag"] = rec.get("lag") or agg["lag"]
        elif status == "ok":
            agg["rates"].append(rec["rate"])
            agg["walls"].append(rec.get("wall"))
            for note in rec.get("notes") or []:
                if note not in agg["notes"]:
                    agg["notes"].append(note)
            if rec.get("memory"):
                agg["memory"] = rec["memory"]
            if rec.get("lag"):
                agg["lag"] = rec["lag"]
            if rec.get("cpu"):
                agg["own_cores"].append(rec["cpu"]["own_cores"])
                if "main_cores" in rec["cpu"]:
                    agg["main_cores"].append(rec["cpu"]["main_cores"])
                    agg["host_cores"].append(rec["cpu"]["host_cores"])
                agg["foreign_cores"].append(_foreign(rec))
        elif status == "skipped":
            if rec.get("note") and rec["note"] not in agg["notes"]:
                agg["notes"].append(rec["note"])
        else:
            agg["errors"].append(rec.get("note", "error"))
    for agg in out.values():
        agg["disturbed"] = max(agg["foreign_cores"] or [0.0]) > max_foreign
        rates = agg["rates"]
        if rates:
            agg.update(
                status="ok",
                median=statistics.median(rates),
                min=min(rates),
                max=max(rates),
            )
        else:
            agg.update(
                status="error" if agg["errors"] else "skipped", median=None, min=None, max=None
            )
    return out


def derive(
    summary: dict[str, dict[str, Any]], groups: dict[str, list[Config]], settings: Settings
) -> dict[str, Any]:
    """Ratios, best asyncsample layouts, overhead figures and the issue's targets.

    Args:
        summary: Output of :func:`aggregate`.
        groups: Output of :func:`plan`.
        settings: The settings the suite ran with.

    Returns:
        A JSON-able dict of derived figures.
    """
    cores = settings.cores

    def med(key: str) -> float | None:
        agg = summary.get(key)
        return agg["median"] if agg else None

    ideal: dict[str, dict[str, Any]] = {}
    for cfg in groups.get("ideal", []):
        single = med(cfg.key)
        ideal[cfg.env] = {
            "single_rate": single,
            "cores": cores,
            "ideal_rate": single * cores if single else None,
            "env_step_us": 1e6 / single if single else None,
        }

    def ratios(cfg: Config) -> dict[str, float | None]:
        rate = med(cfg.key)
        sync = med(Config("sync", cfg.env, cfg.n_envs, policy=cfg.policy).key)
        peer = med(Config("async", cfg.env, cfg.n_envs, policy=cfg.policy).key)
        ide = ideal.get(cfg.env, {}).get("ideal_rate")
        ceil = med(ceiling_config(cfg.env, cfg.n_envs, cfg.policy, cores).key)
        if cfg.policy and sync and ceil:
            ceil = max(ceil, sync)  # a policy's ceiling: the larger of the two
        pools = [med(Config(c, cfg.env, cfg.n_envs, policy=cfg.policy).key)
                 for c in ("envpool", "envpool-async")]  # fmt: skip
        envpool = max((r for r in pools if r), default=None)
        out = {
            "vs_sync": rate / sync if rate and sync else None,
            "vs_async": rate / peer if rate and peer else None,
            "vs_ideal": None if cfg.policy else (rate / ide if rate and ide else None),
            "vs_ceiling": rate / ceil if rate and ceil else None,
            "vs_envpool": rate / envpool if rate and envpool else None,
        }
        if cfg.contender == "asyncsample-ray":  # against the process backend, same layout
            process = med(dataclasses.replace(cfg, contender="asyncsample").key)
            out["vs_process"] = rate / process if rate and process else None
        if cfg.fraction:  # against the fixed split (fraction_samples=1), same call
            full = med(dataclasses.replace(cfg, fraction=1.0).key)
            out["vs_full"] = rate / full if rate and full else None
        return out

    best: dict[str, dict[str, Any]] = {}
    for group in ("main", "big"):
        for cfg in groups.get(group, []):
            if cfg.contender != "asyncsample" or med(cfg.key) is None:
                continue
            slot = f"{cfg.env}|{cfg.n_envs}"
            if slot not in best or med(cfg.key) > best[slot]["median"]:
                best[slot] = {"key": cfg.key, "layout": cfg.layout, "median": med(cfg.key)}

    per_config = {
        cfg.key: ratios(cfg) for configs in groups.values() for cfg in configs if med(cfg.key)
    }

    overhead: list[dict[str, Any]] = []
    noop_single = ideal.get("NoOp-v0", {}).get("single_rate")
    for group in ("overhead", "main"):
        for cfg in groups.get(group, []):
            rate = med(cfg.key)
            if cfg.env != "NoOp-v0" or not rate or cfg.contender == "ideal":
                continue
            if any(o["key"] == cfg.key for o in overhead):
                continue
            envs_per_step = cfg.envs_per_worker or cfg.n_envs
            workers = cfg.n_workers or 1
            overhead.append(
                {
                    "key": cfg.key,
                    "label": cfg.label,
                    "n_envs": cfg.n_envs,
                    "rate": rate,
                    "us_per_transition": 1e6 / rate,
                    "cpu_us_per_transition": cores * 1e6 / rate,
                    "added_cpu_us_per_transition": (
                        cores * 1e6 / rate - 1e6 / noop_single if noop_single else None
                    ),
                    "us_per_worker_step": envs_per_step * 1e6 / rate,
                    "round_trip_us": workers * envs_per_step * 1e6 / rate,
                }
            )

    def best_rate(env: str, n: int) -> float | None:
        slot = best.get(f"{env}|{n}")
        return slot["median"] if slot else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    n, big = settings.n_envs, settings.big_n_envs
    lag_p99 = [
        agg["lag"]["p99_ms"]
        for agg in summary.values()
        if agg["contender"] == "asyncsample" and agg.get("lag") and agg["lag"].get("p99_ms")
    ]
    targets: list[dict[str, Any]] = [
        {
            "what": "HeavyTail-v0: % of the 2-core ideal",
            "target": 0.85,
            "value": ratio(
                best_rate("HeavyTail-v0", n), ideal.get("HeavyTail-v0", {}).get("ideal_rate")
            ),
        },
        {
            "what": "FixedCost-v0: % of the 2-core ideal",
            "target": 0.90,
            "value": ratio(
                best_rate("FixedCost-v0", n), ideal.get("FixedCost-v0", {}).get("ideal_rate")
            ),
        },
        {
            "what": f"CartPole-v1 ({n} envs): x AsyncVectorEnv",
            "target": 3.0,
            "value": ratio(best_rate("CartPole-v1", n), med(Config("async", "CartPole-v1", n).key)),
        },
        {
            "what": f"CartPole-v1 ({big} envs): x SyncVectorEnv",
            "target": 1.0,
            "value": ratio(
                best_rate("CartPole-v1", big), med(Config("sync", "CartPole-v1", big).key)
            ),
        },
        {
            "what": "Image-v0: x AsyncVectorEnv (shm)",
            "target": 1.5,
            "value": ratio(best_rate("Image-v0", n), med(Config("async", "Image-v0", n).key)),
        },
        {
            "what": "event-loop lag p99 while sampling (ms, worst run)",
            "target": 5.0,
            "value": max(lag_p99) if lag_p99 else None,
            "lower_is_better": True,
        },
    ]
    for t in targets:
        if t["value"] is None:
            t["met"] = None
        elif t.get("lower_is_better"):
            t["met"] = t["value"] < t["target"]
        else:
            t["met"] = t["value"] >= t["target"]
    policy = _derive_policy(med, groups.get("policy", []), per_config)
    real = _derive_real(med, groups.get("real", []), per_config, settings)
    return {
        "policy": policy,
        "real": real,
        "ideal": ideal,
        "ratios": per_config,
        "best_layout": best,
        "overhead": overhead,
        "targets": targets,
    }


#: The policy workload's cells (env, envs) and issue 25's goal in each: the best asyncsample
#: mode and layout at this fraction of the ceiling (the larger of SyncVectorEnv and the loops).
POLICY_TARGETS = {
    ("CartPole-v1", 8): 0.9,
    ("CartPole-v1", 32): 0.9,
    ("HalfCheetah-v5", 8): 0.9,
    ("HalfCheetah-v5", 32): 0.9,
}


def _best_ours(
    med: Any, configs: list[Config], ratios: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The fastest asyncsample config (any mode, any layout) per ``env|n_envs|policy`` cell,
    with its ratios (``vs_ceiling`` against the larger of the loops and SyncVectorEnv)."""
    best: dict[str, dict[str, Any]] = {}
    for cfg in configs:
        rate = med(cfg.key)
        if not rate or cfg.contender != "asyncsample":
            continue
        slot = f"{cfg.env}|{cfg.n_envs}|{cfg.policy}"
        if slot not in best or rate > best[slot]["median"]:
            best[slot] = {"key": cfg.key, "label": cfg.label, "median": rate,
                          **ratios.get(cfg.key, {})}  # fmt: skip
    return best


def _derive_policy(
    med: Any, configs: list[Config], ratios: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Best asyncsample mode/layout per cell and the targets of the policy workload."""
    best = _best_ours(med, configs, ratios)
    targets: list[dict[str, Any]] = []
    for (env, n), goal in POLICY_TARGETS.items():
        slot = best.get(f"{env}|{n}|mlp")
        targets.append(
            {
                "what": f"{env} ({n} envs, MLP): best asyncsample x ceiling",
                "target": goal,
                "value": slot["vs_ceiling"] if slot else None,
                "by": slot["label"] if slot else None,
            }
        )
    for t in targets:
        t["met"] = None if t["value"] is None else t["value"] >= t["target"]
    return {"best": best, "targets": targets}


def _derive_real(
    med: Any, configs: list[Config], ratios: dict[str, dict[str, Any]], s: Settings
) -> dict[str, Any]:
    """The ``real`` group: the best asyncsample mode and layout per cell, and the targets.

    Targets (issue 25 and the real-env goals): Pong-v5 with a random agent at >= 0.95 of the
    ceiling (two plain loops side by side) and >= 0.8x EnvPool; HalfCheetah-v5 with the MLP
    at >= 1x EnvPool.
    """
    best = _best_ours(med, configs, ratios)

    def value(env: str, policy: str, ratio: str) -> tuple[float | None, str | None]:
        slot = best.get(f"{env}|{s.real_n_envs.get(env, s.n_envs)}|{policy}")
        return (slot.get(ratio), slot["label"]) if slot else (None, None)

    targets: list[dict[str, Any]] = []
    for env, policy, ratio, goal, what in (
        ("Pong-v5", "", "vs_ceiling", 0.95, "random agent: x ceiling"),
        ("Pong-v5", "", "vs_envpool", 0.8, "random agent: x EnvPool (the faster mode)"),
        ("HalfCheetah-v5", "mlp", "vs_envpool", 1.0, "MLP policy: x EnvPool (the faster mode)"),
        ("HalfCheetah-v5", "mlp", "vs_ceiling", 0.9, "MLP policy: x ceiling"),
        ("PongRaw-v5", "", "vs_ceiling", 0.9, "raw frames, random agent: x ceiling (issue 35)"),
    ):
        if env not in s.real_envs:
            continue
        val, by = value(env, policy, ratio)
        n = s.real_n_envs.get(env, s.n_envs)
        targets.append({"what": f"{env} ({n} envs) {what}", "target": goal, "value": val,
                        "by": by, "met": None if val is None else val >= goal})  # fmt: skip
    for cfg in configs:  # issue 25: host mode in every layout a user may pick, not the best only
        if cfg.env == "Pong-v5" and not cfg.policy and cfg.inference == "host":
            val = ratios.get(cfg.key, {}).get("vs_ceiling")
            targets.append({"what": f"Pong-v5 ({cfg.n_envs} envs) random agent, host "
                            f"{cfg.n_workers}x{cfg.envs_per_worker}: x ceiling", "target": 0.95,
                            "value": val, "by": cfg.label,
                            "met": None if val is None else val >= 0.95})  # fmt: skip
    return {"best": best, "targets": targets}
