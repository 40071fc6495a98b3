"""Prometheus metrics of a sampler: what it did and where the time went (``metrics=``; the list
is ``docs/metrics.md``; needs the ``metrics`` extra).

The per-step path only counts in plain ints and arrays (:mod:`asyncsample._clock`), and times
a sample of the calls, at a pace that keeps timing cheap (the latency histograms are sampled,
their counts weighted; the counters are exact); :class:`SamplerMetrics` folds them into its
totals once per call, which a custom collector reads when the registry is scraped. Samplers
sharing a registry add up per label set.
"""

from __future__ import annotations

import operator
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncsample._clock import (
    AGENT,
    BOUNDS,
    CALLS,
    ENDS,
    ENV,
    ROWS,
    ROWS_BOUNDS,
    ROWS_N,
    STEPS,
    AgentTimer,
)
from asyncsample._engine import Continuity

if TYPE_CHECKING:
    from asyncsample._batcher import Batcher
    from asyncsample.worker import Worker

__all__ = [
    "BOTTLENECKS",
    "END_KINDS",
    "FAULT_KINDS",
    "HOST_RESTART_CAUSES",
    "WORKER_LABEL_LIMIT",
    "FaceMetrics",
    "SamplerMetrics",
    "fault_kind",
    "make_face_metrics",
    "make_metrics",
]

PREFIX = "asyncsample_"
END_KINDS = ("terminated", "truncated", "deadline")
FAULT_KINDS = ("raised", "hung", "killed", "malformed")
BOTTLENECKS = ("env", "agent", "caller")
WORKER_LABEL_LIMIT = 16
"""Samplers of more workers count under ``worker="all"`` (a label must not grow unbounded)."""

_CALLING = (Continuity.IN_CALL, Continuity.TAKING_OVER)  # where a worker's episodes are open
_N = len(BOUNDS) + 1
_LENGTH_BOUNDS = (1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 10000.0)
_LAG_BOUNDS = (0.0, 1.0, 2.0, 3.0, 4.0, 8.0, 16.0, 32.0, 64.0)
_TALLY_LIMIT = 1 << 16  # the largest value _Hist.observe_counts tallies in an array
_Key = tuple[str, ...]  # label values
_Table = dict[str, dict[_Key, float]]  # by metric name


def _registry(metrics: Any) -> Any:
    """The registry ``metrics=`` names (``None``: metrics off); raises as :func:`make_metrics`."""
    if metrics is None or metrics is False:
        return None
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(
            "metrics= needs prometheus_client: install the metrics extra, "
            "pip install 'asyncsample[metrics]'"
        ) from exc
    if metrics is True:
        return prometheus_client.REGISTRY
    if isinstance(metrics, prometheus_client.CollectorRegistry):
        return metrics
    raise TypeError(
        "metrics must be None, True (prometheus_client's default registry) or a "
        f"prometheus_client.CollectorRegistry, got {type(metrics).__name__}"
    )


def make_metrics(
    metrics: Any,
    *,
    backend: str,
    n_workers: int,
    env_parallel: int,
    agent_parallel: int,
    lanes: bool,
) -> SamplerMetrics | None:
    """The :class:`SamplerMetrics` that ``metrics=`` asks for (``None``: none), for a sampler
    whose env steps run ``env_parallel`` at a time and its agent calls ``agent_parallel``.

    Raises:
        ImportError: ``prometheus_client`` is not installed (the ``metrics`` extra).
        TypeError: ``metrics`` is neither ``None``, ``True`` nor a ``CollectorRegistry``.
    """
    registry = _registry(metrics)
    if registry is None:
        return None
    made = SamplerMetrics(
        _hub_of(registry),
        backend=backend,
        n_workers=n_workers,
        env_parallel=env_parallel,
        agent_parallel=agent_parallel,
    )
    made.state.lanes = lanes
    return made


def fault_kind(exc: BaseException) -> str:
    """The ``kind`` label of a worker failure: ``hung`` (step timeout), ``killed`` (the host
    died), ``malformed`` (what the env returned does not fit, not retried), else ``raised``."""
    from asyncsample.errors import StepTimeoutError, WorkerCrashedError

    if isinstance(exc, StepTimeoutError):
        return "hung"
    if isinstance(exc, WorkerCrashedError):
        return "killed"
    if not getattr(exc, "retry", True):
        return "malformed"
    return "raised"


class _Hist:
    """A histogram kept as per-bucket counts (the last bucket is +Inf) and a sum."""

    def __init__(self, bounds: Sequence[float] | np.ndarray) -> None:
        self.bounds = np.asarray(bounds, dtype=np.float64)
        self.counts = np.zeros(len(bounds) + 1, dtype=np.float64)
        self.sum = 0.0

    def observe(
        self, values: Sequence[float] | np.ndarray, weights: Sequence[float] | None = None
    ) -> None:
        """Count each of ``values`` once, or as many times as its ``weights`` (a sample's)."""
        values = np.asarray(values, dtype=np.float64)
        if not len(values):
            return
        where = np.searchsorted(self.bounds, values, side="left")
        if weights is None:
            self.counts += np.bincount(where, minlength=len(self.counts))
            self.sum += float(values.sum())
            return
        counts = np.asarray(weights, dtype=np.float64)
        self.counts += np.bincount(where, counts, minlength=len(self.counts))
        self.sum += float((values * counts).sum())  # (np.dot of floats wakes BLAS threads)

    def observe_counts(self, values: np.ndarray) -> None:
        """Count each of ``values``, small non-negative integers (by their tally: cheaper than
        :meth:`observe` for many repeated values)."""
        if not len(values):
            return
        if int(values.max()) > _TALLY_LIMIT or int(values.min()) < 0:
            self.observe(values)
            return
        tally = np.bincount(values)
        seen = np.flatnonzero(tally)
        times = tally[seen]
        np.add.at(self.counts, np.searchsorted(self.bounds, seen, side="left"), times)
        self.sum += float(np.dot(seen, times))

    def tally(self, times_by_value: dict[int, int]) -> None:
        """Count each value the number of times ``times_by_value`` gives it."""
        for value, times in times_by_value.items():
            self.counts[int(np.searchsorted(self.bounds, value, side="left"))] += times
            self.sum += float(value * times)

    def add_counts(self, counts: np.ndarray, total: float) -> None:
        self.counts += counts
        self.sum += total

    def buckets(self) -> list[tuple[str, float]]:
        cumulative = np.cumsum(self.counts)
        out = [(repr(float(b)), float(c)) for b, c in zip(self.bounds, cumulative)]
        out.append(("+Inf", float(cumulative[-1])))
        return out


_HISTOGRAMS: dict[str, tuple[Sequence[float], str]] = {
    "env_step_seconds": (BOUNDS, "Seconds of one env step, measured where the env runs."),
    "agent_call_seconds": (BOUNDS, "Seconds of one agent call (get_actions)."),
    "agent_call_rows": (ROWS_BOUNDS, "Observations (rows) per agent call."),
    "episode_length": (_LENGTH_BOUNDS, "Steps of each finished episode."),
    "episode_seconds": (BOUNDS, "Wall-clock seconds of each finished episode."),
    "call_wait_seconds": (BOUNDS, "Seconds the caller waited for a call or a streamed batch."),
    "policy_lag": (_LAG_BOUNDS, "Agent versions between each returned step's and the newest."),
}


#: Counters and gauges: their help text and labels besides ``backend``.
_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "env_steps_total": ("Env steps taken.", ("worker",)),
    "restarts_total": ("Env-host restarts (after env faults or dead hosts).", ("worker",)),
    "env_faults_total": (
        "Env faults by kind (raised, hung, killed, malformed).",
        ("worker", "kind"),
    ),
    "episodes_total": ("Episodes finished, by how they ended.", ("end",)),
    "agent_calls_total": ("Agent calls (get_actions).", ()),
    "host_restarts_total": (
        "Env hosts (processes, Ray actors) restarted, by cause: died, hung (a call past "
        "step_timeout), blocked (its event loop stood still for step_timeout).",
        ("cause",),
    ),
}
#: The causes of ``host_restarts_total``.
HOST_RESTART_CAUSES = ("died", "hung", "blocked")
_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "episodes_in_flight": ("Episodes started and not yet ended (now).", ()),
    "oldest_episode_seconds": (
        "Age of the oldest episode in flight, in seconds (now; 0 when none is).",
        (),
    ),
    "env_calls_in_flight": (
        "Env calls running now (async envs in hosts: as of their loop's last tick, every "
        "50 ms; a lockstep host's step counts its worker's envs); compare with max_concurrency.",
        (),
    ),
    "agent_version": ("The newest agent version.", ()),
    "bottleneck": (
        "1 for the side the last window's time went to (env, agent, caller).",
        ("side",),
    ),
}


class _State:
    """One sampler's totals (guarded by its hub's lock)."""

    def __init__(self, backend: str, n_workers: int) -> None:
        self.backend = backend
        self.labelled = n_workers <= WORKER_LABEL_LIMIT
        slots = n_workers if self.labelled else 1
        self.steps = [0] * slots
        self.restarts = [0] * slots
        self.faults = {k: [0] * slots for k in FAULT_KINDS}
        self.episodes = [0, 0, 0]
        self.agent_calls = 0
        self.hists = {name: _Hist(bounds) for name, (bounds, _) in _HISTOGRAMS.items()}
        self.in_flight = 0
        self.workers: list[Any] = []  # the sampler's workers: their episodes, read live
        self.host_restarts = dict.fromkeys(HOST_RESTART_CAUSES, 0)  # updated at each read
        self.agent_version = 0
        self.bottleneck: str | None = None
        self.hosts: list[Any] = []  # the lane hosts, whose env_calls are live
        self.lanes = False  # whether the hosts count env calls in flight (lane backends)
        self.live = True
        self.pull: Any = None  # called under the hub's lock before a scrape (the faces)

    def slot(self, worker: int) -> int:
        return worker if self.labelled else 0

    def read_host_restarts(self) -> None:
        """Read the host restarts so far from the hosts (each pool place once: its workers'
        hosts share its counts)."""
        places = {id(r): r for h in self.hosts if (r := getattr(h, "host_restarts", None))}
        if not places:
            return
        counts = dict.fromkeys(HOST_RESTART_CAUSES, 0)
        for restarts in places.values():
            for cause, n in restarts.items():
                counts[cause] = counts.get(cause, 0) + n
        self.host_restarts = counts

    def live_episodes(self) -> tuple[int, float]:
        """The episodes in flight now and the age of the oldest, in seconds (read at scrape
        time, from any thread: a few numpy reductions per worker, nothing per step)."""
        open_now, oldest = 0, 0.0
        now = time.perf_counter()
        for w in self.workers:
            ep = w.episodes
            running = ep.lengths > 0  # (a lane writes its length back at its episode's end)
            if ep.state in _CALLING:  # reset and not ended yet: open, stepped or not
                running |= ~ep.needs_reset
            n = int(np.count_nonzero(running))
            open_now += n
            starts = ep.started_at
            if n and starts is not None:
                first = min(t for t, on in zip(starts, running.tolist()) if on)
                oldest = max(oldest, now - first)
        return open_now, oldest

    def tallies(self) -> list[list[int]]:
        return [self.steps, self.restarts, self.episodes, *self.faults.values()]

    def absorb(self, other: _State) -> None:
        """Add ``other``'s counters and histograms to these (a closed state's)."""
        for mine, theirs in zip(self.tallies(), other.tallies()):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n
        self.agent_calls += other.agent_calls
        for cause, n in other.host_restarts.items():
            self.host_restarts[cause] += n
        for name, h in other.hists.items():
            self.hists[name].add_counts(h.counts, h.sum)


class _Hub:
    """The collector registered once per registry: the sum of its samplers' states."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.states: list[_State] = []

    def retire(self, state: _State) -> None:
        """A closed sampler's (or face's) ``state`` joins the closed one of its backend (one per
        backend, not per job), its gauges leave. Call it holding :attr:`lock`."""
        if state not in self.states:
            return
        self.states.remove(state)
        state.read_host_restarts()
        state.live, state.pull, state.hosts, state.workers = False, None, [], []
        for old in self.states:
            if not old.live and old.backend == state.backend and old.labelled == state.labelled:
                old.absorb(state)
                return
        self.states.append(state)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        with self.lock:
            states = list(self.states)
            for s in states:
                if s.pull is not None:
                    s.pull()
            counters: _Table = {}
            gauges: _Table = {name: {} for name in _GAUGES}

            def count(name: str, key: _Key, value: float, into: _Table = counters) -> None:
                per = into.setdefault(name, {})
                per[key] = per.get(key, 0.0) + value

            hists: dict[tuple[str, str], _Hist] = {}
            for s in states:
                b = s.backend

                def wl(i: int, s: _State = s) -> tuple[str, ...]:
                    return (s.backend, str(i) if s.labelled else "all")

                for i, n in enumerate(s.steps):
                    count("env_steps_total", wl(i), n)
                for i, n in enumerate(s.restarts):
                    count("restarts_total", wl(i), n)
                for kind, per_worker in s.faults.items():
                    for i, n in enumerate(per_worker):
                        count("env_faults_total", (*wl(i), kind), n)
                for end, n in zip(END_KINDS, s.episodes):
                    count("episodes_total", (b, end), n)
                if s.live:
                    s.read_host_restarts()
                for cause, n in s.host_restarts.items():
                    count("host_restarts_total", (b, cause), n)
                count("agent_calls_total", (b,), s.agent_calls)
                for name, h in s.hists.items():
                    total = hists.setdefault((name, b), _Hist(h.bounds))
                    total.add_counts(h.counts, h.sum)
                if not s.live:
                    continue
                if s.workers:
                    in_flight, oldest = s.live_episodes()
                else:  # a face: as of its last step
                    in_flight, oldest = s.in_flight, 0.0
                count("episodes_in_flight", (b,), in_flight, gauges)
                g = gauges["oldest_episode_seconds"]
                g[(b,)] = max(g.get((b,), 0.0), oldest)
                calls = [h.env_calls for h in s.hosts if hasattr(h, "env_calls")]
                if s.lanes or calls:
                    count("env_calls_in_flight", (b,), sum(calls), gauges)
                g = gauges["agent_version"]
                g[(b,)] = max(g.get((b,), 0.0), float(s.agent_version))
                if s.bottleneck is not None:
                    for side in BOTTLENECKS:
                        gauges["bottleneck"][(b, side)] = float(side == s.bottleneck)
        for name, totals in counters.items():
            doc, labels = _COUNTERS[name]
            family = CounterMetricFamily(PREFIX + name, doc, labels=["backend", *labels])
            for key, value in sorted(totals.items()):
                family.add_metric(list(key), value)
            yield family
        for name, (_, doc) in _HISTOGRAMS.items():
            hfamily = HistogramMetricFamily(PREFIX + name, doc, labels=["backend"])
            for (hname, b), h in sorted(hists.items()):
                if hname == name:
                    hfamily.add_metric([b], h.buckets(), h.sum)
            yield hfamily
        for name, values in gauges.items():
            doc, labels = _GAUGES[name]
            gfamily = GaugeMetricFamily(PREFIX + name, doc, labels=["backend", *labels])
            for key, value in sorted(values.items()):
                gfamily.add_metric(list(key), value)
            yield gfamily


_HUBS: weakref.WeakKeyDictionary[Any, _Hub] = weakref.WeakKeyDictionary()
_HUBS_LOCK = threading.Lock()


def _hub_of(registry: Any) -> _Hub:
    with _HUBS_LOCK:
        hub = _HUBS.get(registry)
        if hub is None:
            hub = _HUBS[registry] = _Hub()
            registry.register(hub)
        return hub


class SamplerMetrics:
    """One sampler's metrics: the hooks the sampler core calls, and the fold.

    Args:
        backend: the ``backend`` label.
        n_workers: the sampler's workers (``worker`` labels up to :data:`WORKER_LABEL_LIMIT`).
        env_parallel: how many env steps can run at once (hosts in parallel), to read the
            envs' share of a window.
        agent_parallel: how many agent calls can run at once (1 in the caller's loop; the
            number of hosts with ``inference="host"``).
    """

    def __init__(
        self, hub: _Hub, *, backend: str, n_workers: int, env_parallel: int, agent_parallel: int
    ) -> None:
        self._hub = hub
        self.state = _State(backend, n_workers)
        self.timer = AgentTimer()  # agent calls made in this process
        self.env_parallel = max(1, env_parallel)
        self.agent_parallel = max(1, agent_parallel)
        self.verdict: str | None = None
        """Where the last window's time went: ``"env"``, ``"agent"`` or ``"caller"``."""
        self.shares: dict[str, float] = {}
        """The last window's shares behind :attr:`verdict`: busy fractions of the envs and the
        agent, and the fraction of the window the sampler sat idle waiting for the caller."""
        self._seen_clock: dict[int, np.ndarray] = {}
        self._finished_steps: dict[int, int] = {}
        self._steps_told: dict[int, int] = {}
        self._ends_told: dict[int, list[int]] = {}
        self._restarts_told: dict[int, int] = {}
        self._calls_told: dict[int, int] = {}
        self._lane_untimed: dict[int, int] = {}  # by worker: steps no timed step stood for yet
        self._idle = 0.0
        self._last_end: float | None = None
        with hub.lock:
            hub.states.append(self.state)

    # -- hooks ------------------------------------------------------------------------------

    def attach(self, workers: Sequence[Worker], requests: Batcher | None) -> None:
        """The sampler started: time the episodes and the agent calls made here."""
        if requests is not None:
            requests.timer = self.timer
        for w in workers:
            w.episodes.started_at = [time.perf_counter()] * w.n_envs
            if w.batcher is not None:
                w.batcher.timer = self.timer
            elif requests is None:  # (with inference="host" the hosts time their agents)
                w.agent_timer = self.timer
        self.state.hosts = [w.host for w in workers if w.host is not None]
        self.state.workers = list(workers)

    def call_started(self) -> float:
        """A call begins: the time since the last one ended was the caller's (idle)."""
        now = time.perf_counter()
        if self._last_end is not None:
            self._idle += now - self._last_end
            self._last_end = None
        return now

    def call_ended(self, started: float) -> None:
        """A call returns: the caller waited since ``started``."""
        self._last_end = time.perf_counter()
        self.batch_waited(self._last_end - started)

    def caller_idle(self, seconds: float) -> None:
        """A stream's rounds waited ``seconds`` for the consumer to take a batch."""
        self._idle += seconds

    def batch_waited(self, seconds: float) -> None:
        """A stream's consumer waited ``seconds`` for its batch."""
        with self._hub.lock:
            self.state.hists["call_wait_seconds"].observe([seconds])

    def fault(self, worker: int, exc: BaseException) -> None:
        """Worker ``worker``'s envs failed with ``exc`` (counted by kind)."""
        with self._hub.lock:
            self.state.faults[fault_kind(exc)][self.state.slot(worker)] += 1

    def close(self) -> None:
        """The sampler closed: its gauges leave the registry, its counters stay."""
        with self._hub.lock:
            self._hub.retire(self.state)

    # -- the fold ---------------------------------------------------------------------------

    def fold(self, workers: Sequence[Worker], versions: np.ndarray | None, seconds: float) -> None:
        """Fold a round's plain counts into the totals, and judge the window.

        Args:
            workers: the sampler's workers (``finished`` holds this round's episodes).
            versions: the agent version of every returned step (for the policy lag).
            seconds: the round's wall time.
        """
        s = self.state
        agent_calls, agent_rows, agent_seconds, agent_weights = self.timer.drain()
        for w in workers:  # the workers' own agent calls (inference="per_worker")
            calls = w.agent_calls - self._calls_told.get(w.worker_number, 0)
            if calls:
                self._calls_told[w.worker_number] = w.agent_calls
                agent_calls += calls
                agent_rows[w.n_envs] = agent_rows.get(w.n_envs, 0) + calls
        # the timed calls, a sample, stand for all of them
        agent_total = sum(map(operator.mul, agent_seconds, agent_weights))
        env_seconds = 0.0
        newest = max(w.agent_version for w in workers)
        # one observe per histogram for every worker (each costs a few numpy calls)
        lengths: list[int] = []
        durations: list[float] = []
        lanes: list[tuple[int, Any, int]] = []  # lane hosts in this process: worker, take, steps
        with self._hub.lock:
            hists = s.hists
            in_flight = 0
            for w in workers:
                n = w.worker_number
                ep = w.episodes
                slot = s.slot(n)
                finished = [f.length for f in w.finished]
                self._finished_steps[n] = self._finished_steps.get(n, 0) + sum(finished)
                ever = self._finished_steps[n] + int(ep.lengths.sum()) + ep.dropped_steps
                told = self._steps_told.get(n, 0)
                stepped = max(ever - told, 0)
                if stepped:
                    s.steps[slot] += stepped
                    self._steps_told[n] = ever
                ends_told = self._ends_told.setdefault(n, [0, 0, 0])
                for k in range(3):
                    s.episodes[k] += ep.ends[k] - ends_told[k]
                    ends_told[k] = ep.ends[k]
                s.restarts[slot] += w.restarts - self._restarts_told.get(n, 0)
                self._restarts_told[n] = w.restarts
                lengths += finished
                if ep.durations:
                    durations += ep.durations
                    ep.durations = []
                in_flight += int(np.count_nonzero(ep.lengths))
                host = w.host
                take = getattr(host, "take_timed", None)
                if take is not None:  # a lane host in this process: its timed steps, no clock
                    lanes.append((n, take, stepped))
                elif host is not None and host.buffers.clock is not None:
                    env_s, agent_s = self._fold_clock(n, host.buffers.clock, w.n_envs)
                    env_seconds += env_s
                    agent_total += agent_s
            if lanes:
                env_seconds += self._fold_lanes(lanes, seconds)
            hists["episode_length"].observe(lengths)
            hists["episode_seconds"].observe(durations)
            hists["agent_call_seconds"].observe(agent_seconds, agent_weights)
            hists["agent_call_rows"].tally(agent_rows)
            s.agent_calls += agent_calls
            if versions is not None and len(versions):
                _fold_lags(hists["policy_lag"], newest, versions)
            s.in_flight = in_flight
            s.agent_version = newest
            self._judge(seconds, env_seconds, agent_total)
            s.bottleneck = self.verdict

    def _fold_lanes(self, lanes: list[tuple[int, Any, int]], seconds: float) -> float:
        """Fold the timed steps of in-process lane hosts (every step of some envs: see
        ``LaneHost.timed_envs``; ``lanes``: each one's worker, ``take_timed`` and the steps it
        took this round); the env seconds they stand for. Each weighs its worker's steps since
        the last fold (and those of folds without a timed step) over the timed ones, so that
        the histogram counts every step. The round's seconds per step (``seconds`` over them
        all) paces the hosts' timing: their steps overlap, so a step's own seconds are not what
        it costs."""
        per_step = seconds / max(sum(stepped for _, _, stepped in lanes), 1)
        values: list[float] = []
        weights: list[float] = []
        total = 0.0
        for worker, take, stepped in lanes:
            timed: list[float] = take(per_step)
            steps = self._lane_untimed.pop(worker, 0) + stepped
            if not timed:
                if steps:
                    self._lane_untimed[worker] = steps  # counted with the next timed steps
                continue
            weight = steps / len(timed)
            values += timed
            weights += [weight] * len(timed)
            total += weight * sum(timed)
        self.state.hists["env_step_seconds"].observe(values, weights)
        return total

    def _fold_clock(self, worker: int, clock: np.ndarray, n_envs: int) -> tuple[float, float]:
        """Fold what worker ``worker``'s host clock gained; its env and agent seconds."""
        delta = _gained(self._seen_clock, worker, clock)
        hists, s = self.state.hists, self.state
        hists["env_step_seconds"].add_counts(delta[ENV : ENV + _N], float(delta[ENV + _N]))
        n_calls = int(delta[AGENT + _N + 1])  # exact; the buckets weigh a sample of them
        if n_calls:  # inference="host": the hosts' agent copies
            hists["agent_call_seconds"].add_counts(
                delta[AGENT : AGENT + _N], float(delta[AGENT + _N])
            )
            rows = hists["agent_call_rows"]
            by_rows = delta[ROWS : ROWS + ROWS_N]
            if by_rows.any():  # async envs: each call's rows, the envs ready in a pass
                rows.add_counts(by_rows, float(delta[ROWS + ROWS_N]))
            else:  # chunks: every call has a row per env
                where = int(np.searchsorted(rows.bounds, n_envs))
                rows.counts[where] += n_calls
                rows.sum += float(n_envs * n_calls)
            s.agent_calls += n_calls
        return float(delta[ENV + _N]), float(delta[AGENT + _N])

    def _judge(self, seconds: float, env_seconds: float, agent_seconds: float) -> None:
        """Where the window (the caller's idle before the round, and the round) went."""
        idle, self._idle = self._idle, 0.0
        window = idle + seconds
        if window <= 0:
            return
        env_busy = env_seconds / (seconds * self.env_parallel) if seconds > 0 else 0.0
        agent_busy = agent_seconds / (seconds * self.agent_parallel) if seconds > 0 else 0.0
        caller = idle / window
        self.shares = {"env": env_busy, "agent": agent_busy, "caller": caller}
        self.verdict = "caller" if caller > 0.5 else "agent" if agent_busy > env_busy else "env"


def _gained(seen: dict[int, np.ndarray], key: int, clock: np.ndarray) -> np.ndarray:
    """What ``clock``'s counters gained since ``seen[key]`` (all of it when a new host started
    it again). Its last cell, ``CALLS``, is a gauge (it goes down as calls end), not a counter:
    left out, or each fall would read as a restart and count everything again."""
    now = clock[:CALLS].copy()
    last = seen.get(key)
    delta = now if last is None else now - last
    if (delta < 0).any():
        delta = now
    seen[key] = now
    return delta


def _fold_lags(hist: _Hist, newest: int, versions: np.ndarray) -> None:
    """Count ``newest`` minus each of ``versions`` into the policy-lag ``hist``: one bucket's
    add when every step came from one version (no update during the call, the usual case)."""
    versions = np.asarray(versions)
    low, high = int(versions.min()), int(versions.max())
    if low == high:
        hist.tally({newest - high: len(versions)})
    else:
        hist.observe_counts(newest - versions.astype(np.int64))


def make_face_metrics(metrics: Any, backend: str, hosted: Any) -> FaceMetrics | None:
    """The :class:`FaceMetrics` of a vector face's ``metrics=`` (raises as :func:`make_metrics`)."""
    registry = _registry(metrics)
    return None if registry is None else FaceMetrics(_hub_of(registry), backend, hosted)


class FaceMetrics:
    """A vector face's metrics (``hosted``: its ``HostedEnvs``, held weakly): its hosts' clocks,
    read at each scrape, and its restart counts (``worker``: the env host's index)."""

    def __init__(self, hub: _Hub, backend: str, hosted: Any) -> None:
        self._hub = hub
        self._hosted = weakref.ref(hosted)
        self.state = _State(backend, len(hosted.slices))
        self.state.pull = self._pull
        self._seen: dict[int, np.ndarray] = {}
        with hub.lock:
            hub.states.append(self.state)

    def fault(self, host: int, exc: BaseException) -> None:
        """Env host ``host`` failed with ``exc``."""
        with self._hub.lock:
            self.state.faults[fault_kind(exc)][self.state.slot(host)] += 1

    def close(self) -> None:
        """The face closes: read the clocks a last time (before their memory goes)."""
        with self._hub.lock:
            self._pull()
            self._hub.retire(self.state)

    def _pull(self) -> None:
        hosted = self._hosted()
        s = self.state
        if hosted is None or hosted.closed or not hosted.hosts:
            return
        restarts = [0] * len(s.restarts)
        for h, host in enumerate(hosted.hosts):
            clock = host.buffers.clock
            if clock is None:
                continue
            delta = _gained(self._seen, h, clock)
            s.steps[s.slot(h)] += int(delta[STEPS])
            s.hists["env_step_seconds"].add_counts(delta[ENV : ENV + _N], float(delta[ENV + _N]))
            s.episodes[0] += int(delta[ENDS])
            s.episodes[1] += int(delta[ENDS + 1])
            if h < len(hosted.restarts):
                restarts[s.slot(h)] += hosted.restarts[h]
        s.restarts = restarts
