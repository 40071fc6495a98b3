"""The benchmark studies: each one a named plan, run by ``asyncsample bench STUDY``.

A *plan study* is a set of the suite's groups (:mod:`benchmarks.suite`) with its own default
budget: it runs on the one settings / plan / fresh-process runner / aggregation / report layer
(``suite.Settings``, ``suite.plan``, :func:`benchmarks._runner.run_fresh`, ``suite.aggregate``
and ``suite.derive``, :mod:`benchmarks.report`), and every one of its groups carries the
machine's ceiling (:mod:`benchmarks.ceiling`) as a contender measured in the same run.

A *script study* is not a throughput measurement and keeps a runner of its own (its module's
``main(argv)``), given ``--out benchmarks/results/STUDY`` and a tiny budget for ``--quick``:
``soak`` (faults injected for minutes: nothing lost), ``chaos`` (faults of async envs) and
``ab`` (an A/B of two source trees, a tool). To add a study, add a :class:`Study` to
:data:`STUDIES` (a plan study names its groups; a new group goes in ``suite.plan``).

Every study writes ``benchmarks/results/STUDY/results.json`` and ``results.md`` (and its
charts, when matplotlib is installed).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

__all__ = ["RESULTS", "STUDIES", "Study", "get", "listing"]


@dataclass(frozen=True)
class Study:
    """One study: its name, what it measures and how it runs.

    Attributes:
        name: What ``asyncsample bench NAME`` calls it; results go to ``results/NAME``.
        measures: One line: what it measures (``--list`` and the README's table).
        groups: The suite groups of a plan study (empty for a script study).
        settings: ``suite.Settings`` fields of the study's default budget.
        quick: ``suite.Settings`` fields of its ``--quick`` budget (on the quick settings).
        script: Module whose ``main(argv)`` runs a script study.
        script_args: Extra arguments of a script study: ``(default, quick)``.
        minutes: Rough length of the default budget on a quiet 2-core machine (script studies;
            plan studies estimate theirs from the plan).
        needs: What the study needs beyond the test extra (shown in the listing).
    """

    name: str
    measures: str
    groups: tuple[str, ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)
    quick: dict[str, Any] = field(default_factory=dict)
    script: str = ""
    script_args: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    minutes: float = 0.0
    needs: str = ""

    @property
    def is_plan(self) -> bool:
        """True when the study runs on the suite's plan layer."""
        return bool(self.groups)

    def out(self) -> Path:
        """The default results directory, ``benchmarks/results/NAME``."""
        return RESULTS / self.name


_SYNTHETIC = ["CartPole-v1", "FixedCost-v0", "HeavyTail-v0", "Image-v0", "NoOp-v0"]
_RANDOM_PEERS = ["ceiling", "sync", "async", "sb3", "tianshou-subproc", "tianshou-shmem"]
_POLICY = [
    "ceiling",
    "sync",
    "async",
    "asyncsample",
    "torchrl-collector",
    "torchrl-multisync",
    "torchrl-multiasync",
    "torchrl-asyncbatched",
]

STUDIES: list[Study] = [
    Study(
        "throughput",
        "random agent, 8 envs of 5 synthetic envs: asyncsample's layouts against every vector "
        "env and the ceiling",
        groups=("ideal", "main"),
        settings={
            "envs": _SYNTHETIC,
            "contenders": [*_RANDOM_PEERS, "envpool", "asyncsample", "asyncsample-local"],
            "repeats": 1,
        },
        needs="SB3, tianshou, EnvPool (bench extra) or skipped",
    ),
    Study(
        "big",
        "CartPole-v1 with 64 envs: asyncsample (2x32, 4x16, 8x8) against Sync/AsyncVectorEnv "
        "and the ceiling",
        groups=("ideal", "big"),
        settings={
            "envs": ["CartPole-v1"],
            "contenders": ["ceiling", "sync", "async", "asyncsample"],
            "repeats": 3,
        },
    ),
    Study(
        "scaling",
        "CartPole-v1 steps/s against the number of envs (2-64)",
        groups=("ideal", "scaling"),
        settings={
            "envs": ["CartPole-v1"],
            "contenders": ["ceiling", "sync", "async", "asyncsample", "asyncsample-vector"],
            "repeats": 1,
        },
    ),
    Study(
        "overhead",
        "NoOp-v0: the sampler's own cost per transition and per worker round trip",
        groups=("ideal", "overhead"),
        settings={"envs": ["NoOp-v0"], "contenders": ["sync", "async", "asyncsample"]},
    ),
    Study(
        "policy",
        "a torch MLP in the loop (CartPole-v1, HalfCheetah-v5; 8 and 32 envs; 128-step calls): "
        "the default (auto) and per_worker/batched/host against Sync/AsyncVectorEnv, the "
        "two-loop ceiling and TorchRL",
        groups=("policy",),
        settings={"contenders": _POLICY, "repeats": 3, "once": _POLICY[-4:]},
        needs="torch, mujoco; TorchRL (bench extra) or skipped",
    ),
    Study(
        "vector",
        "asyncsample.VectorEnv (its default placement, and forced onto hosts) against "
        "gymnasium's vector envs, PufferLib's multiprocessing (a worker per core, one worker) "
        "and TorchRL's AsyncEnvPool: CartPole-v1, FixedCost-v0, Image-v0 with 8 envs and "
        "CartPole-v1 with 64, random actions",
        groups=("ideal", "vector"),
        settings={
            "envs": ["CartPole-v1", "FixedCost-v0", "Image-v0"],
            "contenders": [
                "ceiling",
                "sync",
                "async",
                "asyncsample-vector",
                "asyncsample-vector-hosts",
                "pufferlib",
                "pufferlib-1w",
                "torchrl-pool",
            ],
            "repeats": 3,
        },
        needs="pufferlib-core (pip install --no-deps), TorchRL (bench extra) or skipped",
    ),
    Study(
        "host",
        'inference="host" with a random agent in every 8-env layout (2x4, 4x2, 8x1), '
        "256-step calls, against per_worker, AsyncVectorEnv and the ceiling",
        groups=("ideal", "host"),
        settings={
            "envs": ["FixedCost-v0", "HeavyTail-v0", "CartPole-v1"],
            "contenders": ["ceiling", "async", "asyncsample"],
            "repeats": 3,
        },
    ),
    Study(
        "real_envs",
        "Pong-v5 (8 envs) and HalfCheetah-v5 (32 envs), random agent and policy; raw-frame "
        "Pong (PongRaw-v5) and HalfCheetah observed through 84x84 and 256x256 renders (8 envs, "
        "random agent): asyncsample's modes against EnvPool sync/async, the gymnasium peers, "
        "SB3 and the ceiling",
        groups=("ideal", "real"),
        settings={
            "envs": ["Pong-v5", "HalfCheetah-v5"],
            "real_envs": [
                "Pong-v5",
                "HalfCheetah-v5",
                "PongRaw-v5",
                "HalfCheetahPixels84-v5",
                "HalfCheetahPixels256-v5",
            ],
            "contenders": [
                "ceiling",
                "sync",
                "async",
                "sb3",
                "envpool",
                "envpool-async",
                "asyncsample",
            ],
            "repeats": 3,
        },
        quick={"envs": ["HalfCheetah-v5"], "real_envs": ["HalfCheetah-v5"]},
        needs="ale-py, mujoco (EGL or OSMesa for the renders), EnvPool, torch",
    ),
    Study(
        "sweep",
        "CartPole-v1 and Pong-v5 with 8 to 512 envs: steps/s, memory (PSS) and run length "
        "against EnvPool, Sync/AsyncVectorEnv and the ceiling",
        groups=("sweep",),
        settings={
            "contenders": ["ceiling", "sync", "async", "envpool", "asyncsample"],
            "repeats": 1,
        },
        needs="ale-py, EnvPool",
    ),
    Study(
        "ray",
        'backend="ray" against backend="process", same layout: CartPole-v1, Image-v0, '
        "NoiseImage-v0",
        groups=("ray",),
        settings={"contenders": ["ceiling", "asyncsample", "asyncsample-ray"], "repeats": 3},
        needs="ray",
    ),
    Study(
        "stragglers",
        "fraction_samples against the fixed per-worker split with a 10x slower worker",
        groups=("stragglers",),
        settings={"contenders": ["ceiling", "asyncsample"], "repeats": 4},
    ),
    Study(
        "soak",
        "minutes of sampling in the host, batched and per_worker modes while envs raise, hang "
        "and end their host: nothing lost, short, half-made or left behind (own runner)",
        script="benchmarks.soak",
        script_args=(("--minutes", "3"), ("--minutes", "0.15", "--batch", "800")),
        minutes=3.0,
    ),
    Study(
        "chaos",
        "2,048 async episodes in flight on asyncio and on process (the envs in two hosts' "
        "event loops) while 1 in 350 steps raises, 1% of resets hang and an env never answers: "
        "every call by its deadline, no healthy episode lost, max_concurrency kept, loop lag "
        "p99 < 20 ms, nothing left after aclose() (own runner)",
        script="benchmarks.chaos",
        script_args=((), ("--quick",)),
        minutes=4.0,
    ),
    Study(
        "async_envs",
        "envs whose step waits (mean 50 ms, 1% of steps 20x longer) at 100, 1,000 and 10,000 "
        "concurrent episodes, and 50,000 of 1 s: backend asyncio/thread, and process/ray with "
        "the envs in the hosts' event loops (every inference mode) against the ceiling "
        "(plain asyncio in a process per core), plain asyncio tasks, AsyncVectorEnv, thread "
        "pools of 32 and 256 and TorchRL's asyncio AsyncEnvPool where installed; consecutive "
        "obtain_fragments calls, loop lag, CPU per step in the caller and the hosts, memory per "
        "episode, call p99 with episode_timeout (own runner)",
        script="benchmarks.async_envs",
        script_args=((), ("--quick",)),
        minutes=30.0,
    ),
    Study(
        "text_envs",
        "10,000 concurrent text episodes on process hosts (1 KB prompts, 200-character replies "
        "and tool outputs, Text spaces; the async-env study's latency model, 200-step "
        "episodes) against the same study with 4-float observations: steps/s, memory per "
        "open episode, and a profile of the caller with what the reply messages carried "
        "(own runner)",
        script="benchmarks.text_envs",
        script_args=((), ("--quick",)),
        minutes=5.0,
    ),
    Study(
        "seam",
        "10,000 concurrent episodes of a minimal AsyncEnv (4 floats, lognormal step latency, mean "
        "50 ms, 1% of steps 20x longer, 200-step episodes): plain asyncio in 1 process and in "
        "a process per core against backend='asyncio' and process hosts (per_worker, host, "
        "batched) with consecutive obtain_fragments(10 * N) calls; loop lag p99 with a 5 ms "
        "ticker, caller CPU per env step, memory per open episode, 1,000 episodes against the "
        "ideal, and a profile of the caller (own runner)",
        script="benchmarks.seam",
        script_args=(("--profile",), ("--quick",)),
        minutes=10.0,
    ),
    Study(
        "first_run",
        "the README's run (CartPole-v1, 4x8, every default) against SyncVectorEnv(32) with "
        "random actions and the ceiling, and with each explicit inference mode; 3 rounds, "
        "each rated against its own round's loops; the caller's loop lag and the cores used; "
        "--calls for other call sizes (own runner)",
        script="benchmarks.first_run",
        script_args=((), ("--quick",)),
        minutes=4.5,
    ),
    Study(
        "hostloop",
        'the env host\'s own cost per step in inference="host" (its chunk loop with a random '
        "agent, in one process) against a plain env.step loop: NoOp-v0, CartPole-v1, "
        "FixedCost-v0 with 1, 4, 8 (the README run's slots) and 16 envs per slot; and one env "
        "host of each policy-study layout with its MLP against the ceiling's loop; and a host "
        "of async envs (runs of 10 steps of the seam study's env, 2,000 envs) against plain "
        "asyncio tasks on the same envs (own runner)",
        script="benchmarks.hostloop",
        script_args=((), ("--quick",)),
        minutes=1.5,
    ),
    Study(
        "clients",
        "the vector env inside training loops: a CleanRL-shaped PPO iteration (CartPole-v1 4 "
        "and 8 envs, HalfCheetah-v5 1 and 4) and SB3's PPO.learn (8 envs): Sync/AsyncVectorEnv, "
        "DummyVecEnv/SubprocVecEnv and ours in each placement (own runner)",
        script="benchmarks.clients",
        script_args=((), ("--quick",)),
        minutes=15.0,
        needs="torch, mujoco, SB3",
    ),
    Study(
        "ab",
        "A/B of two source trees, alternating runs: --a OLD_TREE [--b NEW_TREE] (own runner)",
        script="benchmarks.ab",
        script_args=(("--repeats", "3"), ("--repeats", "1", "--quick")),
        minutes=6.0,
        needs="--a PATH of the baseline tree; not in `all`",
    ),
]


def get(name: str) -> Study:
    """The study called ``name``.

    Raises:
        KeyError: No such study (the message lists them).
    """
    for study in STUDIES:
        if study.name == name:
            return study
    raise KeyError(f"no study {name!r}; the studies: {', '.join(s.name for s in STUDIES)}")


def listing() -> str:
    """One line per study: name, length of its default budget, what it measures."""
    width = max(len(s.name) for s in STUDIES)
    lines = []
    for study in STUDIES:
        length = (
            f"~{estimate_minutes(study):.0f} min" if study.is_plan else f"~{study.minutes:.0f} min"
        )
        needs = f" [{study.needs}]" if study.needs else ""
        lines.append(f"{study.name:<{width}}  {length:>8}  {study.measures}{needs}")
    return "\n".join(lines)


def settings_for(study: Study, quick: bool, **overrides: Any) -> Any:
    """The ``suite.Settings`` of a plan study: its default (or ``--quick``) budget + overrides."""
    from benchmarks import suite

    fields = {f.name for f in dataclasses.fields(suite.Settings)}
    values = dict(study.settings) | {"groups": list(study.groups)}
    if quick:
        values |= study.quick
        values.pop("repeats", None)
    values |= {k: v for k, v in overrides.items() if v is not None}
    unknown = set(values) - fields
    if unknown:
        raise ValueError(f"unknown settings of study {study.name!r}: {sorted(unknown)}")
    if quick:
        return suite.Settings.quick_settings(**values)
    settings = suite.Settings()
    for key, value in values.items():
        setattr(settings, key, value)
    return settings


#: Seconds a run of a contender spends starting (processes, imports) and closing, on a quiet
#: 2-core machine; the rest of a run is its warm-up and timed phase. Rough, for the plan only.
STARTUP_S = {
    "ideal": 0.5,
    "ceiling": 1.0,
    "sync": 0.7,
    "async": 1.0,
    "sb3": 8.0,
    "tianshou-subproc": 6.0,
    "tianshou-shmem": 6.0,
    "envpool": 1.0,
    "envpool-async": 1.0,
    "asyncsample": 2.0,
    "asyncsample-ray": 12.0,
    "asyncsample-local": 1.0,
    "asyncsample-vector": 2.0,
    "asyncsample-vector-hosts": 2.0,
    "pufferlib": 3.0,
    "pufferlib-1w": 3.0,
    "torchrl-pool": 8.0,
    "torchrl-collector": 6.0,
    "torchrl-multisync": 15.0,
    "torchrl-multiasync": 15.0,
    "torchrl-asyncbatched": 30.0,
}
#: Steps/s assumed for the timed phase when nothing better is known (rough, for the plan only).
GUESS_RATE = {"": 20_000.0, "mlp": 8_000.0, "atari": 1_500.0, "cnn": 700.0, "mujoco": 8_000.0}


def estimate_seconds(settings: Any) -> tuple[int, float]:
    """(runs, seconds) of a plan: start-up per contender plus warm-up and timed phase, rough."""
    from benchmarks import suite

    runs = 0
    seconds = 0.0
    for cfg in suite.unique_configs(suite.plan(settings)):
        if suite.pre_skip(cfg, settings) is not None:
            continue
        n = suite.make_spec(cfg, settings, instrument=False).n_transitions
        rate = min(GUESS_RATE.get(cfg.policy, 20_000.0),
                   GUESS_RATE.get(suite.family(cfg.env), 20_000.0))  # fmt: skip
        if cfg.fraction:  # a 2 ms straggler among 200 us envs
            rate = 4_000.0
        if "Pixels" in cfg.env:  # a software render per step: tens of steps/s
            rate = 25.0
        timed = max(settings.min_seconds, n / rate)
        start = STARTUP_S.get(cfg.contender, 2.0) + (1.5 if cfg.policy else 0.0)
        if cfg.contender == "async":
            start += 0.1 * cfg.n_envs
        # the envs' own start-up, over the env hosts (or the peers' processes, or one)
        start += cfg.n_envs * suite.STARTUP_S[suite.family(cfg.env)] / (cfg.n_processes or 1)
        per_run = start + timed * (1 + settings.warmup_fraction)
        repeats = 1 if cfg.contender in settings.once else settings.repeats
        runs += repeats
        seconds += repeats * per_run
    return runs, seconds


def estimate_minutes(study: Study, quick: bool = False) -> float:
    """Rough minutes of a study's budget on a quiet 2-core machine."""
    if not study.is_plan:
        return study.minutes if not quick else 0.5
    return estimate_seconds(settings_for(study, quick))[1] / 60


def run_script(study: Study, quick: bool, out: Path, extra: Sequence[str]) -> int:
    """Run a script study's ``main(argv)`` with its budget, ``--out`` and ``extra``."""
    module = importlib.import_module(study.script)
    main: Callable[[list[str]], Any] = module.main
    out_arg = out / "results.json" if study.name == "soak" else out
    argv = [*study.script_args[1 if quick else 0], "--out", str(out_arg), *extra]
    print(f"{study.name}: python -m {study.script} {' '.join(argv)}", flush=True)
    result = main(argv)
    return result if isinstance(result, int) else 0
