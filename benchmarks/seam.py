"""The "one seam" study: the caller's own cost at 10,000 episodes of a minimal env (issue 48).

Run from the repository root::

    asyncsample bench seam                  # N = 10,000, every cell, ~10 min on 2 cores
    asyncsample bench seam --quick          # N = 200, short windows (a smoke run)
    python -m benchmarks.seam --cells plain-1 ours-asyncio --episodes 2000 --profile

The env is the issue's minimal env, as a new user writes it: an ``AsyncEnv`` with ``Box(4,)``
float32 observations and ``Discrete(2)`` actions whose ``step`` awaits a heavy-tailed latency
drawn from its seeded RNG (lognormal spread, mean 50 ms, 1% of the steps 20x longer;
:class:`~benchmarks.latency_envs.LatencyModel` with ``sigma``), episodes of 200 steps. The
plain-asyncio contenders step the same env class. Every cell runs in a fresh process
(:func:`benchmarks._runner.run_fresh`), warms up, then measures a timed window:

- ``plain-1``: N asyncio tasks in one process (uvloop), each ``reset`` then ``step`` with random
  actions, forever; env steps counted where they happen.
- ``plain-2``: the ceiling, the same loop in one process per core, N split between them.
- ``ours-asyncio``: ``Sampler(make_env, backend="asyncio", n_workers=100,
  envs_per_worker=N // 100)``, the default (random) agent, consecutive
  ``obtain_fragments(10 * N)`` calls as a trainer writes them.
  ``ours-asyncio-paced``: the same with ``backend_options={"loop_lag": 0.002}``, a window of
  env calls that keeps the caller's loop about 2 ms behind at most (``backends/_pacing.py``).
- ``ours-process-per_worker``, ``ours-process-host``, ``ours-process-batched``: the same on
  ``process`` hosts (one per core), with that ``inference`` (``batched`` needs one agent for
  every worker: a seeded ``RandomAgent``; the others keep the default, one per worker).
- ``tail``: ``ours-asyncio`` at N = 1,000, its steps/s against the ideal ``N / mean latency``;
  ``tail-host``: the same on ``process`` hosts with ``inference="host"`` (runs of steps).

Ours' steps/s are the transitions the calls returned over the window (whole calls); beside it,
with a 5 ms ticker task in the caller's loop, the loop lag p99 (actual wake - scheduled wake),
the caller's CPU per env step (``time.process_time()`` over the window / env steps counted
where the envs step) and the memory per open episode (growth of the process tree's RSS / N).
``--profile`` adds a run of ``ours-asyncio`` under ``cProfile`` over its window: the top
functions by own time, the caller's cost the redesign is judged against. Results:
``benchmarks/results/seam/`` (``results.json``, ``results.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import functools
import gc
import json
import os
import pstats
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncsample.backends._pacing import LOOP_LAG
from benchmarks.async_envs_cells import (
    _SHM,
    CellResult,
    CellSpec,
    _loop_factory,
    children_cpu,
    run_tasks,
    tree_rss,
)
from benchmarks.async_envs_run import run_ceiling
from benchmarks.latency_envs import _LatencyCore, make_env, shared_count
from benchmarks.report import write_own_results
from benchmarks.runs import LagProbe

RESULTS = Path(__file__).resolve().parent / "results" / "seam"

#: The cells, in the order they run and are shown.
CELLS = [
    "plain-1",
    "plain-2",
    "ours-asyncio",
    "ours-asyncio-paced",
    "ours-process-per_worker",
    "ours-process-host",
    "ours-process-batched",
    "tail",
    "tail-host",
]
#: Ours on process hosts: cell -> inference.
PROCESS_CELLS = {
    "ours-process-per_worker": "per_worker",
    "ours-process-host": "host",
    "ours-process-batched": "batched",
}
#: Ours on ``asyncio`` with a ``loop_lag`` (the default has none): cell -> its default
#: ``loop_lag`` (``--loop-lag`` sets another).
PACED_CELLS: dict[str, float | None] = {"ours-asyncio-paced": LOOP_LAG}
#: The tail cells (N = 1,000, against the ideal): cell -> inference on process hosts, or None.
TAIL_CELLS = {"tail": None, "tail-host": "host"}

#: The issue's goals.
GOALS = {
    "asyncio_vs_plain_1": 0.7,
    "process_vs_plain_2": 0.8,
    "lag_p99_ms": 10.0,
    "cpu_us_host": 3.0,
    "cpu_us_batched": 6.0,
    "tail_vs_ideal": 0.9,
    "memory_vs_plain_1": 2.0,
}


@dataclass
class SeamSpec:
    """One cell (JSON-able).

    Attributes:
        cell: One of :data:`CELLS`, or ``"profile"`` (``ours-asyncio`` under ``cProfile``).
        n_episodes: Episodes open at once (N).
        n_workers: Ours: workers (``envs_per_worker = N // n_workers``).
        hosts: Processes of ``plain-2`` and env hosts of ours on ``process``.
        mean: Mean step latency, seconds.
        sigma: Lognormal spread of every step (the log's standard deviation).
        tail_probability: Share of the steps 20x (``tail_factor``) longer.
        tail_factor: How much longer a tail step is.
        episode_length: Steps per episode.
        warmup: Seconds before the timed window.
        seconds: Seconds of the timed window (ours: whole calls, at least one).
        call_factor: Ours' calls are ``obtain_fragments(call_factor * N)``.
        ticker: Interval of the lag ticker in ours' caller loop, seconds.
        loop: ``"uvloop"`` or ``"asyncio"``.
        seed: Seed of the envs (and of the sampler).
        top: Functions kept from the profile.
        gc_freeze: ``gc.freeze()`` in the cell's process before it starts: what imports left is
            out of the cyclic collector's full walks (plain-2's own processes are not frozen).
        gc_threshold: The cyclic collector's thresholds (``gc.set_threshold``) in the cell's
            process and plain-2's loops, forked from it; empty: Python's own. Ours' env hosts
            set their own either way (``_lane_serve.quiet_collector``).
        loop_lag: The paced cells' ``loop_lag`` (``None``: each cell's own, :data:`PACED_CELLS`).
    """

    cell: str
    n_episodes: int
    n_workers: int = 100
    hosts: int = 2
    mean: float = 0.050
    sigma: float = 0.5
    tail_probability: float = 0.01
    tail_factor: float = 20.0
    episode_length: int = 200
    warmup: float = 10.0
    seconds: float = 30.0
    call_factor: int = 10
    ticker: float = 0.005
    loop: str = "uvloop"
    seed: int = 0
    top: int = 25
    gc_freeze: bool = False
    gc_threshold: list[int] = dataclasses.field(default_factory=list)
    loop_lag: float | None = None

    @property
    def envs_per_worker(self) -> int:
        """Ours' envs per worker (N // n_workers, at least 1)."""
        return max(1, self.n_episodes // self.n_workers)

    @property
    def workers(self) -> int:
        """Ours' workers: no more than there are episodes."""
        return min(self.n_workers, self.n_episodes)

    def cell_spec(self, contender: str) -> CellSpec:
        """The async-env study's spec of this cell (its env and window) as ``contender``."""
        return CellSpec(
            contender,
            self.n_episodes,
            mean=self.mean,
            tail_probability=self.tail_probability,
            tail_factor=self.tail_factor,
            sigma=self.sigma,
            episode_length=self.episode_length,
            warmup_s=self.warmup,
            seconds=self.seconds,
            calls=0,
            loop=self.loop,
            cores=self.hosts,
            seed=self.seed,
        )

    def paced_lag(self) -> float | None:
        """This paced cell's ``loop_lag``."""
        return PACED_CELLS[self.cell] if self.loop_lag is None else self.loop_lag

    def layout(self) -> str:
        """How the cell holds its episodes, for the table."""
        if self.cell == "plain-1":
            return f"{self.n_episodes:,} tasks, 1 process"
        if self.cell == "plain-2":
            return f"{self.hosts} processes x {self.n_episodes // self.hosts:,} tasks"
        text = f"{self.workers}x{self.envs_per_worker}"
        if self.cell in PACED_CELLS:
            text += f", loop_lag={self.paced_lag()}"
        inference = PROCESS_CELLS.get(self.cell) or TAIL_CELLS.get(self.cell)
        if inference is not None:
            text += f" over {self.hosts} hosts, inference={inference}"
        return text


# --------------------------------------------------------------------------------------------
# The cells (in the child process)


def _plain(spec: SeamSpec) -> dict[str, Any]:
    """``plain-1`` and ``plain-2``: the async-env study's plain asyncio tasks on this env."""
    cell = spec.cell_spec("plain-asyncio" if spec.cell == "plain-1" else "ceiling")
    if spec.cell == "plain-2":
        result = run_ceiling(cell)
    else:
        with asyncio.Runner(loop_factory=_loop_factory(spec.loop)) as runner:
            result = runner.run(run_tasks(cell))
    done = result.finish(cell)
    return {
        "steps": done["steps"],
        "seconds": done["seconds"],
        "steps_per_s": done["steps_per_s"],
        "lag": done["lag"],
        # plain-2's caller only waits: its loops' CPU is the one to show
        "cpu_us_per_step": done["cpu_us_per_step"] if spec.cell == "plain-1" else None,
        "host_cpu_us_per_step": done["host_cpu_us_per_step"] if spec.cell == "plain-2" else None,
        "bytes_per_episode": done["bytes_per_episode"],
        "notes": done["notes"],
    }


class FullCollections:
    """The cyclic collector's full collections (generation 2) while :meth:`watch` runs: how
    many and how long each held the loop (each is one pass of the collector over every tracked
    object, with the loop stopped)."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._began = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._began)

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        gc.callbacks.append(self._callback)
        try:
            yield
        finally:
            gc.callbacks.remove(self._callback)

    def summary(self, calls: int) -> dict[str, Any]:
        n = len(self.pauses)
        return {
            "n": n,
            "per_call": n / calls if calls else None,
            "mean_ms": 1e3 * sum(self.pauses) / n if n else None,
            "max_ms": 1e3 * max(self.pauses) if n else None,
        }


async def _calls(
    sampler: Any,
    spec: SeamSpec,
    probe: LagProbe,
    count: Callable[[], int],
    profiler: cProfile.Profile | None,
    collections: FullCollections,
) -> CellResult:
    """Consecutive ``obtain_fragments(call_factor * N)`` calls: ``warmup`` seconds of them,
    then whole calls until ``seconds`` have passed (at least one), counted: each call's length
    and transitions (``calls``, ``call_steps``), the env steps where they happen (``steps``),
    the caller's and the hosts' CPU, the RSS at the window's end."""
    size = spec.call_factor * spec.n_episodes
    end = time.perf_counter() + spec.warmup
    await sampler.obtain_fragments(size)
    while time.perf_counter() < end:
        await sampler.obtain_fragments(size)
    out = CellResult()
    probe.lags.clear()
    if profiler is not None:
        profiler.enable()
    s0, c0, h0 = count(), time.process_time(), children_cpu()
    t0 = time.perf_counter()
    with collections.watch():
        while not out.calls or time.perf_counter() - t0 < spec.seconds:
            t = time.perf_counter()
            batch = await sampler.obtain_fragments(size)
            out.calls.append(time.perf_counter() - t)
            out.call_steps.append(batch.n_transitions)
    out.seconds = time.perf_counter() - t0
    out.cpu_s = time.process_time() - c0
    if profiler is not None:
        profiler.disable()
    out.steps, out.host_cpu_s = count() - s0, max(0.0, children_cpu() - h0)
    out.rss_open = tree_rss()
    return out


async def _ours(spec: SeamSpec, profiler: cProfile.Profile | None) -> dict[str, Any]:
    """Ours: a sampler of N envs with the default agent, measured over :func:`_calls`."""
    from gymnasium import spaces

    from asyncsample import RandomAgent, Sampler

    rss_before = tree_rss()
    inference = PROCESS_CELLS.get(spec.cell) or TAIL_CELLS.get(spec.cell)
    counter_dir = None
    count: Callable[[], int] = _LatencyCore.count
    options: dict[str, Any] = {"backend": "asyncio"}
    if inference is not None:  # envs in the hosts count their steps in shared files
        counter_dir = tempfile.mkdtemp(prefix="asyncsample-seam-", dir=_SHM)
        count = functools.partial(shared_count, counter_dir)
        options = {"backend": "process", "n_processes": spec.hosts, "inference": inference}
    if spec.cell in PACED_CELLS:
        options["backend_options"] = {"loop_lag": spec.paced_lag()}
    if inference == "batched":  # one agent shared by every worker: a seeded random one
        options["agent"] = RandomAgent(spaces.Discrete(2), seed=spec.seed)
    kwargs = spec.cell_spec("ours-asyncio").env_kwargs()
    make = functools.partial(make_env, False, counter_dir=counter_dir, **kwargs)
    probe = LagProbe(spec.ticker)
    full = FullCollections()
    t0 = time.perf_counter()
    try:
        sampler = Sampler(
            make,
            n_workers=spec.workers,
            envs_per_worker=spec.envs_per_worker,
            seed=spec.seed,
            **options,
        )
        async with sampler:
            start_s = time.perf_counter() - t0
            probe.start()
            try:
                window = await _calls(sampler, spec, probe, count, profiler, full)
            finally:
                await probe.stop()
    finally:
        if counter_dir is not None:
            shutil.rmtree(counter_dir, ignore_errors=True)
    n = spec.workers * spec.envs_per_worker
    steps, transitions = window.steps, sum(window.call_steps)
    return {
        "steps_per_s": transitions / window.seconds,
        "env_steps_per_s": steps / window.seconds,
        "transitions": transitions,
        "env_steps": steps,
        "calls": len(window.calls),
        "call_size": spec.call_factor * spec.n_episodes,
        "call_mean_s": window.seconds / len(window.calls),
        "call_max_s": max(window.calls),
        "seconds": window.seconds,
        "start_s": start_s,
        "lag": probe.summary(),
        "full_collections": full.summary(len(window.calls)),
        "cpu_us_per_step": 1e6 * window.cpu_s / steps if steps else None,
        "host_cpu_us_per_step": 1e6 * window.host_cpu_s / steps if steps and inference else None,
        "bytes_per_episode": (window.rss_open - rss_before) / n,
        "ideal_steps_per_s": n / spec.mean,
        "ratio_to_ideal": transitions / window.seconds / (n / spec.mean),
    }


def profile_rows(profiler: cProfile.Profile, top: int, steps: int) -> list[dict[str, Any]]:
    """The ``top`` functions by own time: where, calls, own and cumulative seconds, and the own
    time per env step of the window (microseconds)."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in stats.items():
        where = "/".join(Path(path).parts[-2:]) if path != "~" else "~"
        rows.append(
            {
                "function": f"{where}:{line}({name})",
                "ncalls": ncalls,
                "tottime_s": tottime,
                "cumtime_s": cumtime,
                "us_per_step": 1e6 * tottime / steps if steps else None,
            }
        )
    rows.sort(key=lambda r: r["tottime_s"], reverse=True)
    return rows[:top]


def run_cell(spec: SeamSpec) -> dict[str, Any]:
    """One cell in this process: its numbers (``steps_per_s`` and the rest)."""
    if spec.gc_threshold:
        gc.set_threshold(*spec.gc_threshold)
    if spec.gc_freeze:
        gc.freeze()
    if spec.cell in ("plain-1", "plain-2"):
        out = _plain(spec)
    else:
        # CPU time, not cProfile's wall-clock default: a function's own time is then the CPU it
        # used, not the waits of the loop that happened to fall in it.
        profiler = cProfile.Profile(time.process_time) if spec.cell == "profile" else None
        with asyncio.Runner(loop_factory=_loop_factory(spec.loop)) as runner:
            out = runner.run(_ours(spec, profiler))
        if profiler is not None:
            out["profile"] = profile_rows(profiler, spec.top, out["env_steps"])
    return {"cell": spec.cell, "n_episodes": spec.n_episodes, "layout": spec.layout(), **out}


def run_file(spec_path: str, out_path: str) -> int:
    """The child's entry point: run the :class:`SeamSpec` in ``spec_path``, write its outcome."""
    spec = SeamSpec(**json.loads(Path(spec_path).read_text()))
    try:
        outcome = {"status": "ok", **run_cell(spec)}
    except Exception as exc:  # reported in the table, never a silent gap
        outcome = {
            "status": "error",
            "note": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=20),
        }
    Path(out_path).write_text(json.dumps(outcome, default=str))
    return 0


# --------------------------------------------------------------------------------------------
# The study (in the parent)


def targets(cells: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets from the cells that ran: name, value, goal, met (or why none)."""

    def ok(name: str) -> dict[str, Any] | None:
        c = cells.get(name)
        return c if c is not None and c.get("status") == "ok" else None

    rows: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: float, at_least: bool, unit: str = "") -> None:
        met = None if value is None else (value >= goal if at_least else value <= goal)
        rows.append(
            {
                "target": name,
                "value": value,
                "goal": goal,
                "at_least": at_least,
                "unit": unit,
                "met": met,
            }
        )

    plain_1, plain_2, asyncio_ = ok("plain-1"), ok("plain-2"), ok("ours-asyncio")
    processes = [c for name in PROCESS_CELLS if (c := ok(name)) is not None]
    best = max(processes, key=lambda c: c["steps_per_s"], default=None)
    for name in ("ours-asyncio", *PACED_CELLS):
        c = ok(name)
        add(
            f"{name} / plain-1 (steps/s)",
            c["steps_per_s"] / plain_1["steps_per_s"] if c and plain_1 else None,
            GOALS["asyncio_vs_plain_1"],
            True,
        )
    add(
        f"best process layout ({best['cell'] if best else '-'}) / plain-2 (steps/s)",
        best["steps_per_s"] / plain_2["steps_per_s"] if best and plain_2 else None,
        GOALS["process_vs_plain_2"],
        True,
    )
    for name in ("ours-asyncio", *PACED_CELLS, *PROCESS_CELLS):
        c = ok(name)
        if c is not None:
            add(
                f"caller loop lag p99, {name}",
                c["lag"].get("p99_ms"),
                GOALS["lag_p99_ms"],
                False,
                " ms",
            )
    for name, goal in (
        ("ours-process-host", "cpu_us_host"),
        ("ours-process-batched", "cpu_us_batched"),
    ):
        c = ok(name)
        add(
            f"caller CPU per env step, {name}",
            c["cpu_us_per_step"] if c else None,
            GOALS[goal],
            False,
            " us",
        )
    tails = [c for name in TAIL_CELLS if (c := ok(name)) is not None]
    tail = max(tails, key=lambda c: c["ratio_to_ideal"]) if tails else None
    add(
        f"tail: {tail['n_episodes'] if tail else '-'} episodes, best layout "
        f"({tail['cell'] if tail else '-'}), steps/s / ideal",
        tail["ratio_to_ideal"] if tail else None,
        GOALS["tail_vs_ideal"],
        True,
    )
    add(
        "memory per open episode, ours-asyncio / plain-1",
        asyncio_["bytes_per_episode"] / plain_1["bytes_per_episode"]
        if asyncio_ and plain_1 and plain_1["bytes_per_episode"] > 0
        else None,
        GOALS["memory_vs_plain_1"],
        False,
        "x",
    )
    return rows


def _num(value: float | None, digits: int = 2, unit: str = "") -> str:
    return "-" if value is None else f"{value:,.{digits}f}{unit}"


def markdown(results: dict[str, Any]) -> str:
    """The study's report: the set-up, one row per cell, the targets, the profile."""
    spec = results["spec"]
    cells: dict[str, dict[str, Any]] = results["cells"]
    lines = [
        "# One seam: the caller's cost at scale (`asyncsample bench seam`)",
        "",
        f"Command: `{results['command']}`",
        "",
        f"{spec['n_episodes']:,} concurrent episodes of {spec['episode_length']} steps of a "
        f"minimal AsyncEnv (Box(4,) float32, Discrete(2)); step latency lognormal (sigma "
        f"{spec['sigma']:g}) with mean {spec['mean'] * 1000:g} ms, "
        f"{spec['tail_probability']:.0%} of the steps {spec['tail_factor']:g}x longer; "
        f"{spec['loop']}. Window {spec['seconds']:g} s after {spec['warmup']:g} s of warm-up. "
        f"Ours: consecutive `obtain_fragments({spec['call_factor']} * N)` calls, "
        f"steps/s = transitions returned / time, a {spec['ticker'] * 1000:g} ms ticker "
        "in the caller's loop; plain: env steps / time, the lag of the async-env study's "
        "1 ms probe in each loop (plain-2: the worse loop's)."
        + (
            " `gc.freeze()` at the start of each cell's process (not in plain-2's own "
            "processes): what imports left is out of the cyclic collector's full walks."
            if spec.get("gc_freeze")
            else ""
        )
        + (
            f" The cyclic collector's thresholds {tuple(spec['gc_threshold'])} in each cell's "
            "process and plain-2's loops (ours' env hosts set their own either way)."
            if spec.get("gc_threshold")
            else ""
        ),
        "",
        "| cell | N | layout | steps/s | ratio | loop lag p99 | full collections per call "
        "(mean) | caller CPU/step | hosts' (loops') CPU/step | memory/episode |",
        "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    refs = {
        "ours-asyncio": "plain-1",
        **dict.fromkeys(PACED_CELLS, "plain-1"),
        **dict.fromkeys(PROCESS_CELLS, "plain-2"),
    }
    for name, c in cells.items():
        if name == "profile":
            continue
        if c.get("status") != "ok":
            note = str(c.get("note", c.get("status")))[:150].replace("|", "/")
            lines.append(f"| {name} | - | - | {c.get('status')}: {note} | | | | | | |")
            continue
        ref = cells.get(refs.get(name, ""), {})
        if name in TAIL_CELLS:
            ratio = f"{c['ratio_to_ideal']:.2f} of ideal"
        elif ref.get("status") == "ok" and ref["steps_per_s"]:
            ratio = f"{c['steps_per_s'] / ref['steps_per_s']:.2f} of {refs[name]}"
        else:
            ratio = "-"
        per_ep = c.get("bytes_per_episode")
        full = c.get("full_collections") or {}
        collected = (
            f"{full['per_call']:.2f} ({_num(full['mean_ms'], 1, ' ms')})"
            if full.get("per_call") is not None
            else "-"
        )
        lines.append(
            f"| {name} | {c['n_episodes']:,} | {c['layout']} | {c['steps_per_s']:,.0f} | "
            f"{ratio} | {_num(c['lag'].get('p99_ms'), 1, ' ms')} | {collected} | "
            f"{_num(c.get('cpu_us_per_step'), 1, ' us')} | "
            f"{_num(c.get('host_cpu_us_per_step'), 1, ' us')} | "
            f"{_num(per_ep / 1024 if per_ep is not None else None, 1, ' KiB')} |"
        )
    lines += [
        "",
        "## Targets (issue 48)",
        "",
        "| target | value | goal | met |",
        "|---|--:|--:|---|",
    ]
    for t in results["targets"]:
        sign = ">=" if t["at_least"] else "<="
        met = {True: "yes", False: "no", None: "not measured"}[t["met"]]
        lines.append(
            f"| {t['target']} | {_num(t['value'], 2, t['unit'])} | {sign} {t['goal']:g}{t['unit']} "
            f"| {met} |"
        )
    prof = cells.get("profile")
    if prof is not None:
        lines += ["", "## Profile of the caller (ours-asyncio, by own time)", ""]
        if prof.get("status") != "ok":
            lines.append(f"{prof.get('status')}: {prof.get('note')}")
        else:
            lines += [
                f"`cProfile` over the window of a separate `ours-asyncio` run at N = "
                f"{prof['n_episodes']:,} ({prof['env_steps']:,} env steps in "
                f"{prof['seconds']:.1f} s, {prof['steps_per_s']:,.0f} steps/s under the profiler); "
                "own time is CPU time (`time.process_time` as cProfile's timer), the envs' own "
                "coroutines included (backend='asyncio' steps them in the caller's loop).",
                "",
                "| function | calls | own s | cumulative s | own us per env step |",
                "|---|--:|--:|--:|--:|",
            ]
            for r in prof["profile"]:
                lines.append(
                    f"| `{r['function']}` | {r['ncalls']:,} | {r['tottime_s']:.3f} | "
                    f"{r['cumtime_s']:.3f} | {_num(r['us_per_step'], 2)} |"
                )
    return "\n".join(lines) + "\n"


def _overrides(pairs: list[str], kind: type, option: str) -> dict[str, Any]:
    """``CELL=VALUE`` pairs of ``option`` as a dict (values of ``kind``)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in [*CELLS, "profile"]:
            raise SystemExit(
                f"{option}: expected CELL=VALUE with CELL one of {[*CELLS, 'profile']}, "
                f"got {pair!r}"
            )
        out[name] = kind(value)
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module's docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.seam", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--cell", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--cells", nargs="+", choices=CELLS, default=CELLS)
    parser.add_argument("--episodes", type=int, help="N of every cell but tail (10,000)")
    parser.add_argument("--tail-episodes", type=int, help="N of the tail cell (1,000)")
    parser.add_argument("--workers", type=int, default=100, help="ours' workers")
    parser.add_argument(
        "--hosts",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="plain-2's processes and ours' process hosts (every core)",
    )
    parser.add_argument("--warmup", type=float, help="seconds before each window (10)")
    parser.add_argument("--seconds", type=float, help="each cell's window (30)")
    parser.add_argument(
        "--cell-episodes",
        nargs="*",
        default=[],
        metavar="CELL=N",
        help="N of one cell, e.g. ours-process-host=5000",
    )
    parser.add_argument(
        "--cell-seconds",
        nargs="*",
        default=[],
        metavar="CELL=S",
        help="window of one cell, seconds",
    )
    parser.add_argument(
        "--cell-warmup",
        nargs="*",
        default=[],
        metavar="CELL=S",
        help="warm-up of one cell, seconds",
    )
    parser.add_argument("--mean", type=float, default=0.050, help="mean step latency, seconds")
    parser.add_argument("--sigma", type=float, default=0.5, help="lognormal spread of a step")
    parser.add_argument("--episode-length", type=int, default=200)
    parser.add_argument(
        "--call-factor",
        type=int,
        default=10,
        help="ours' calls are obtain_fragments(CALL_FACTOR * N)",
    )
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also run ours-asyncio under cProfile (its top functions)",
    )
    parser.add_argument("--top", type=int, default=25, help="functions kept from the profile")
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() in each cell's process before it starts (see docs/async-envs.md)",
    )
    parser.add_argument(
        "--gc-threshold",
        nargs=3,
        type=int,
        metavar=("GEN0", "GEN1", "GEN2"),
        help="the cyclic collector's thresholds in each cell's process and plain-2's loops "
        "(default: Python's own, as users run it)",
    )
    parser.add_argument(
        "--loop-lag",
        type=float,
        help=f"the paced cells' loop_lag, seconds (default {LOOP_LAG:g})",
    )
    parser.add_argument("--quick", action="store_true", help="N = 200, short windows")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    quick = {"episodes": 200, "tail_episodes": 200, "warmup": 1.0, "seconds": 2.0}
    full = {"episodes": 10_000, "tail_episodes": 1_000, "warmup": 10.0, "seconds": 30.0}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for name in ("episodes", "tail_episodes", "workers", "hosts", "call_factor", "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if args.loop_lag is not None and not args.loop_lag > 0:
        parser.error(f"--loop-lag: expected seconds > 0, got {args.loop_lag}")
    if args.gc_threshold and min(args.gc_threshold) < 0:
        parser.error(f"--gc-threshold: expected three counts >= 0, got {args.gc_threshold}")
    return args


def specs(args: argparse.Namespace) -> list[SeamSpec]:
    """The cells to run, in order (the profile last)."""
    sizes = _overrides(args.cell_episodes, int, "--cell-episodes")
    windows = _overrides(args.cell_seconds, float, "--cell-seconds")
    warmups = _overrides(args.cell_warmup, float, "--cell-warmup")
    names = [c for c in CELLS if c in args.cells] + (["profile"] if args.profile else [])
    out = []
    for name in names:
        default_n = args.tail_episodes if name in TAIL_CELLS else args.episodes
        out.append(
            SeamSpec(
                cell=name,
                n_episodes=sizes.get(name, default_n),
                n_workers=args.workers,
                hosts=args.hosts,
                mean=args.mean,
                sigma=args.sigma,
                episode_length=args.episode_length,
                warmup=warmups.get(name, args.warmup),
                seconds=windows.get(name, args.seconds),
                call_factor=args.call_factor,
                loop=args.loop,
                top=args.top,
                gc_freeze=args.gc_freeze,
                gc_threshold=list(args.gc_threshold or []),
                loop_lag=args.loop_lag,
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the study; writes ``results.json`` and ``results.md`` to ``--out``."""
    from benchmarks._runner import run_fresh
    from benchmarks.report import command_line

    args = parse(argv)
    if args.cell:
        return run_file(*args.cell)
    todo = specs(args)
    cells: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="asyncsample-seam-") as tmp:
        for spec in todo:
            print(f"seam: {spec.cell} N={spec.n_episodes:,} ({spec.layout()})", flush=True)
            # start-up, the warm-up's calls and the window's last call, generously
            timeout = 240 + 4 * (spec.warmup + spec.seconds) + spec.n_episodes / 50
            cells[spec.cell] = run_fresh(
                ["-m", "benchmarks.seam", "--cell"], dataclasses.asdict(spec), timeout, Path(tmp)
            )
            if cells[spec.cell].get("status") != "ok":
                print(
                    f"  {cells[spec.cell].get('status')}: {cells[spec.cell].get('note')}",
                    file=sys.stderr,
                )
    first = next((s for s in todo if s.cell not in TAIL_CELLS), todo[0])
    results: dict[str, Any] = {
        "command": command_line("python -m benchmarks.seam", argv),
        "quick": args.quick,
        "spec": dataclasses.asdict(first),
        "cells": cells,
    }
    results["targets"] = targets(cells)
    if "profile" in cells and cells["profile"].get("status") == "ok":
        results["profile"] = cells["profile"]["profile"]
    write_own_results(args.out, results, markdown(results))
    return 1 if any(c.get("status") != "ok" for c in cells.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
