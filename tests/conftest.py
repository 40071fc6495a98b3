"""Shared test set-up: the event loops every async test runs under, the ``slow`` marks, the one
Ray fixture, the leak-check fixture and the one sampler factory, ``make_sampler``.

Every async test is parametrised over asyncio's default loop and uvloop. The default run
(``python -m pytest``, which deselects ``slow``) runs the uvloop variant only for a representative
subset: the modules in ``BOTH_LOOPS_MODULES`` and tests marked ``both_loops``. Marked ``slow``:
the uvloop variants of the other tests, the Ray tests (``test_ray_backend.py``, tests using
``ray_cluster``, tests parametrised with ``backend="ray"``), the examples and the benchmarks.
Also marked ``slow``: the variants listed in ``SLOW_VARIANTS``, each the costly twin of a variant
that stays in the default run and checks the same behaviour (the uvloop variant of a test of the
representative subset, another backend, placement, space or size of a parametrised test, the
SB3 face's twin of a gymnasium-face test).
``python -m pytest -m slow`` runs those, so the two runs together cover every test under both
loops.
"""

from __future__ import annotations

import sys

# Bytecode caches (__pycache__, git-ignored) also where PYTHONDONTWRITEBYTECODE is set, as it is in
# the shells of our shared 2-core machine: without them each pytest-xdist worker rewrites the
# asserts of every test module and compiles the package again at every run (about 5 s of CPU per
# worker, four workers), and every fresh interpreter and env host of a test compiles the modules
# it imports. Set before the imports below, so the package's modules are cached too; the env
# hosts and the interpreters the tests start read the caches (they do not write any).
sys.dont_write_bytecode = False

import asyncio
import functools
import gc
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import cloudpickle
import envs as _test_envs
import pytest
import uvloop
from helpers import SamplerFactory, leaves_nothing

from asyncsample import Sampler
from asyncsample.multiagent.testing import AsyncRosterEnv

# The test envs live in a module the env-host processes cannot import by name: ship them by value.
cloudpickle.register_pickle_by_value(_test_envs)

#: Modules whose async tests run under both loops in the default run: faults, cancellation,
#: signals and garbage collection are where the two loops' behaviour can differ.
BOTH_LOOPS_MODULES = frozenset({"test_faults.py", "test_worker.py"})
#: Modules that are slow as a whole: Ray's start-up, the examples' training and web runs, the
#: benchmark suite (test_async_bench.py: the async-env study's runs).
SLOW_MODULES = frozenset(
    {"test_ray_backend.py", "test_examples.py", "test_benchmarks.py", "test_async_bench.py"}
)

#: Modules whose every test is slow (SLOW_MODULES, and those marked slow as a whole): the default
#: run does not import them at all. Their imports (SB3, torch, Ray) cost each pytest-xdist
#: worker seconds of collection for tests it would deselect. A run that collects them checks that
#: every test in them is still slow (pytest_collection_modifyitems).
WHOLLY_SLOW_MODULES = SLOW_MODULES | {
    "test_sb3_example.py",
    "test_sb3_vec_env.py",
    "test_soak.py",
    "test_tool_agent_example.py",
    "test_torch_agent.py",
}

_LOOP_PARAM = "_asyncio_loop_factory"  # pytest-asyncio's parameter for the loop factory

#: Variants run in the slow pass only, by ``module::test``: a variant is slow when its parameters
#: (``callspec.params``; ``loop`` is "asyncio" or "uvloop") match every name of one of the test's
#: dicts, each name with the values it lists. Each entry says which quick test still checks the
#: same behaviour on asyncio's default loop. Together they were about a sixth of the default run's
#: test time on a loaded 2-core machine, mostly spent in deliberate hangs, step_timeouts and host
#: start-ups.
SLOW_VARIANTS: dict[str, tuple[dict[str, tuple[Any, ...]], ...]] = {
    # Multi-agent rows: thread's twin is local's and asyncio's, the async twin's in a host is
    # asyncio's; batched's is per_worker's; a host's failing env or update is local's or
    # host's (the default run keeps one process variant of each).
    "test_multiagent_sampler.py::test_rows_equal_the_reference_loop": (
        {"backend": ("thread",)},
        {"backend": ("process",), "env_fn": (AsyncRosterEnv,)},
    ),
    "test_multiagent_sampler.py::test_policies_act_for_their_agents_in_any_mode": (
        {"inference": ("batched",)},
    ),
    "test_multiagent_sampler.py::test_a_failing_env_loses_its_agents_segments_and_nothing_else": (
        {"backend": ("process",)},
    ),
    "test_multiagent_sampler.py::test_an_update_sets_the_parameters_of_the_policies_it_names": (
        {"inference": ("per_worker",)},
    ),
    # Under uvloop: their asyncio variants stay; so do the representative subset's other uvloop
    # variants (a killed host, a spent budget, cancellation on "local", garbage collection).
    "test_faults.py::test_hanging_env_times_out_and_is_replaced": ({"loop": ("uvloop",)},),
    "test_faults.py::test_hanging_env_past_the_budget": ({"loop": ("uvloop",)},),
    "test_faults.py::test_external_sigkill_mid_call": ({"loop": ("uvloop",)},),
    "test_faults.py::test_cancellation_at_any_moment_leaves_the_sampler_usable": (
        {"loop": ("uvloop",), "backend": ("process",)},  # [asyncio-process], [uvloop-local] stay
    ),
    # Both loops in the slow pass (3 s each: a chunk's deliberate wait); the run-ahead chunk
    # being dropped stays checked by test_closing_the_stream_then_calls_start_fresh_episodes.
    "test_stream_ahead.py::test_a_stream_closed_mid_round_drops_the_chunks_run_ahead": (
        {"loop": ("asyncio", "uvloop")},
    ),
    # Both loops in the slow pass (each 1-1.7 s of deliberate waiting), each with a twin that
    # stays: a step_timeout kill logged (test_faults.py::test_hanging_env_times_out_and_is_replaced
    # times it out and replaces the host), local aclose bounded by close_timeout
    # (test_local_restart_does_not_wait_past_close_timeout, the same stuck close), a process
    # host waiting for a slow close (test_process_kills_a_host_past_close_timeout), the SB3 face
    # placed as the gymnasium face (the gymnasium face's placement tests).
    "test_backends_shared.py::test_step_timeout_kill_is_logged": ({"loop": ("asyncio", "uvloop")},),
    "test_faults_close.py::test_local_aclose_is_bounded_by_close_timeout": (
        {"loop": ("asyncio", "uvloop")},
    ),
    "test_faults_close.py::test_process_waits_close_timeout_for_an_env_to_close": (
        {"loop": ("asyncio", "uvloop")},
    ),
    "test_placement.py::test_sb3_face_places_as_the_gymnasium_face": ({},),
    # Both loops in the slow pass (a 2.5 s step_timeout): the hung host's process tree killed;
    # test_faults.py::test_hanging_env_times_out_and_is_replaced[asyncio] keeps a hung step
    # timed out and its host replaced in the default run.
    "test_process_backend.py::test_step_timeout_kills_the_process_tree_then_restart": (
        {"loop": ("asyncio", "uvloop")},
    ),
    "test_stream_ahead.py::test_a_host_killed_or_an_env_failing_during_a_chunk_run_ahead": (
        {"loop": ("uvloop",), "fault": ("raise",)},  # [asyncio-raise], [uvloop-kill] stay
    ),
    # Every kind of fault on the thread lane: [asyncio-*] stay for each kind. On "thread", in this
    # module: test_one_failing_env_of_fifty_costs_only_its_own_episode checks that the faulty env
    # alone is rebuilt in every call mode, test_past_max_restarts_the_call_names_the_worker_and_env
    # (raise, cancel, reward) and test_a_malformed_step_names_worker_env_field_and_type (info)
    # that each kind is caught, test_episode_timeout_cuts_a_hung_reset that a hung call is cut.
    # On "process" (async envs in a host) every kind stays checked by
    # test_hosted_async_envs.py::test_a_fault_is_the_envs_own[asyncio-process-*].
    "test_lane_faults.py::test_every_kind_of_fault_is_the_envs_own": (
        {"lane": ("thread", "process")},
    ),
    # On "process" under uvloop: its [asyncio-process-*] variants stay.
    "test_lane_faults.py::test_one_failing_env_of_fifty_costs_only_its_own_episode": (
        {"loop": ("uvloop",), "lane": ("process",)},
    ),
    # The cap with n_processes derived from it and given: [2-None] and [3-3] stay.
    "test_vector_env.py::test_max_concurrency_caps_the_sub_envs_stepping_at_once": (
        {"limit": (1,), "n_processes": (None,)},
        {"limit": (2,), "n_processes": (2,)},
    ),
    # Box and Discrete spaces on hosts: every space in-process and the Dict and Tuple spaces
    # (Box and Discrete parts) on hosts and mixed stay.
    "test_vector_env.py::test_equal_to_sync": (
        {"placed": ("hosts", "mixed"), "kind": ("box", "discrete")},
    ),
    "test_process_backend.py::test_matches_local_host": ({"kind": ("box", "discrete")},),
    # The process backend: every mode on "local" and the threaded modes on "process" stay.
    "test_batched_inference.py::test_deterministic_agent_matches_per_worker": (
        {"backend": ("process",), "call": ("sync", "async")},
    ),
    # Run ahead with a delay and buffer_size=1 as fragments: [0.02-1-False] and [0.0-2-True] stay.
    "test_stream_ahead.py::test_batches_equal_those_without_run_ahead": (
        {"delay": (0.02,), "fragments": (True,)},
    ),
    # One step per chunk: [None] (the default chunks) and [3] (chunks cut mid-episode) stay.
    "test_host_inference.py::test_deterministic_agent_matches_per_worker": ({"chunk_steps": (1,)},),
    # The episode deadline on "process": [local] stays (the caller's worker checks it after each
    # step on both lockstep backends).
    "test_lane_backends.py::test_episode_timeout_on_lockstep_backends": (
        {"backend": ("process",)},
    ),
    # The same seed on "process": [local] stays, and test_digest.py's process scenarios check a
    # fixed seed's batches bit for bit in every call mode.
    "test_sampler.py::test_same_seed_same_batches_different_seed_different": (
        {"backend": ("process",)},
    ),
    # The SB3 face hands metrics= to the HostedEnvs the gymnasium face uses (the rest of the SB3
    # face is in the slow pass, tests/test_sb3_vec_env.py): test_metrics.py's
    # test_vector_env_counts_match_the_steps counts the same steps and episodes.
    "test_metrics.py::test_sb3_face_counts": ({},),
    # Bounded closes (issue 32) under uvloop: their asyncio variants stay.
    "test_faults_close.py::test_process_kills_a_host_past_close_timeout": ({"loop": ("uvloop",)},),
    # The lanes' fill-in rule under uvloop: its asyncio variants stay, for each lane and mode.
    "test_lane_faults.py::test_a_fast_worker_does_not_fill_in_for_minimums_still_owed": (
        {"loop": ("uvloop",)},
    ),
    # Faults of async envs in process hosts under uvloop: [uvloop-cancel] (the env's own
    # CancelledError, where the loops differ most) and every [asyncio-*] stay.
    "test_hosted_async_envs.py::test_a_fault_is_the_envs_own": (
        {"loop": ("uvloop",), "kind": ("raise", "hang", "reward", "info")},
    ),
    # The step arena's fallbacks with a batched agent: [CrashOnce-per_worker] stays (its
    # [FrameEnv] variants are marked slow in the module), and
    # test_held_batches_are_never_overwritten[batched] and test_batched_agent_reads_the_arena
    # keep batched on the arena in the default run.
    "test_zero_copy.py::test_step_arena_small_or_none_gives_the_same_batches": (
        {"inference": ("batched", "per_worker")},  # per_worker too: 5 s; [host] stays
    ),
    # Async envs in process hosts equal to the asyncio backend's: [host-fragments] and
    # [batched-episodes] stay (each call mode, agents in the hosts and in the caller);
    # test_inference_host_runs_the_agent_in_the_hosts keeps per_worker's twin, host.
    "test_hosted_async_envs.py::test_batches_equal_the_asyncio_backends": (
        {"inference": ("per_worker",)},
        {"inference": ("batched",), "mode": ("fragments",)},
        {"inference": ("host",), "mode": ("episodes",)},
    ),
    # Held batches with the agent in the hosts, and batched (4.7 s): [per_worker] stays (the
    # same arena, the same hold).
    "test_zero_copy.py::test_held_batches_are_never_overwritten": (
        {"inference": ("host", "batched")},
    ),
    # The gymnasium face's equality with SyncVectorEnv in mixed placement (some sub-envs in this
    # process, some in hosts): in-process and hosts stay for each; mixed placement stays checked
    # by test_episode_statistics_and_any_action_batch_equal_to_sync[mixed],
    # test_a_host_killed_in_mixed_placement_is_restarted and the malformed-step cases below.
    **{
        f"test_vector_env.py::{name}": ({"placed": ("mixed",)},)
        for name in (
            "test_equal_to_sync",
            "test_steady_infos_equal_to_sync",
            "test_float_actions_reach_the_envs_as_given",
            "test_observation_mode_different",
            "test_step_async_and_step_equal_to_sync",
            "test_equal_to_sync_cartpole_by_id",
            "test_custom_spaces_travel_pickled",
        )
    },
    # A malformed sub-env step: every kind in-process, a reward and an observation on hosts and
    # mixed stay (the same check of the same answer, wherever the sub-env runs).
    "test_vector_env.py::test_a_malformed_sub_env_step_names_the_sub_env": (
        {"placed": ("hosts", "mixed"), "what": ("info", "short")},
    ),
    # A loop-free round through step_async/step_wait: [step] stays (the same round).
    "test_vector_env.py::test_quiet_lockstep_steps_run_no_event_loop": ({"call": ("step_async",)},),
    # Text/Sequence layouts on blocking envs in process hosts: every layout on async envs in
    # process hosts and in this process, and the "dict" layout (Text and Sequence nested) on
    # blocking envs in process hosts, stay.
    "test_text_spaces.py::test_every_layout_and_backend_records_the_reference_episodes": (
        {
            "backend": ("process",),
            "kind": ("sync",),
            "layout": ("text", "tokens", "embed", "tuple"),
        },
    ),
}


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Parametrise every asyncio test over both event loops."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def _is_slow(item: pytest.Item) -> bool:
    if item.path.name in SLOW_MODULES or "ray_cluster" in getattr(item, "fixturenames", ()):
        return True
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "ray":
        return True  # a `backend` fixture that asks for ray_cluster only when the test runs
    on_uvloop = callspec is not None and callspec.params.get(_LOOP_PARAM) is uvloop.new_event_loop
    representative = (
        item.path.name in BOTH_LOOPS_MODULES or item.get_closest_marker("both_loops") is not None
    )
    return (on_uvloop and not representative) or _is_slow_variant(item, on_uvloop)


def _is_slow_variant(item: pytest.Item, on_uvloop: bool) -> bool:
    """Whether ``item`` is one of the variants ``SLOW_VARIANTS`` lists."""
    name = getattr(item, "originalname", item.name)
    variants = SLOW_VARIANTS.get(f"{item.path.name}::{name}", ())
    callspec = getattr(item, "callspec", None)
    params = dict(callspec.params) if callspec is not None else {}
    params["loop"] = "uvloop" if on_uvloop else "asyncio"
    return any(
        all(key in params and params[key] in values for key, values in variant.items())
        for variant in variants
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker that sets ``make_sampler``'s defaults."""
    config.addinivalue_line(
        "markers",
        "sampler_defaults(**kwargs): default Sampler arguments of the make_sampler fixture "
        "(the closest marker wins per argument: test, then class, then module)",
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection imported (torch among it) out of the garbage collector's reach.

    None of it is garbage, and every full collection would walk it again: the leak checks'
    ``gc.collect()`` costs a few tenths of a second each once torch is imported, and far less
    after this.
    """
    gc.freeze()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two pytest-xdist workers per core. Most of a test's time is spent waiting on
    env hosts (their start-up, replies, exits), not computing: on 2 cores the default run took
    137 s with 2 workers, 123 s with 3, 113 s with 4 and 139 s with 6 (each worker collects the
    whole suite)."""
    return 2 * (os.cpu_count() or 1)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave out the modules of slow tests only, in a run that leaves out the slow tests."""
    if collection_path.name in WHOLLY_SLOW_MODULES and config.option.markexpr == "not slow":
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the slow tests (see the module docstring)."""
    for item in items:
        if item.get_closest_marker("slow") is None and _is_slow(item):
            item.add_marker(pytest.mark.slow)
    quick = [
        item.nodeid
        for item in items
        if item.path.name in WHOLLY_SLOW_MODULES and item.get_closest_marker("slow") is None
    ]
    if quick:
        raise pytest.UsageError(
            f"WHOLLY_SLOW_MODULES (tests/conftest.py) lists the modules of these tests, which are "
            f"not slow: the default run would never collect them: {quick}"
        )


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """One local Ray cluster for the whole session, started on first use, shut down at the end.

    The only Ray fixture of the suite. Not autouse: Ray's daemons would otherwise be children of
    every test, and the tests that check for leftover processes would see them. Four CPUs, so
    evaluate()'s extra actor can be scheduled beside a sampler's two on a 2-core machine. An
    already initialised Ray is reused and left running.
    """
    import ray

    started = not ray.is_initialized()
    if started:
        # The test modules' own envs (tests/async_envs.py, classes of a test module) are
        # imported by name in the actors, as in the env-host processes: tests/ on their path.
        tests = os.path.dirname(os.path.abspath(__file__))
        path = os.pathsep.join(p for p in [tests, os.environ.get("PYTHONPATH", "")] if p)
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        )
    yield ray
    if started:
        ray.shutdown()


#: Where a vector-env face's sub-envs step (the ``placed`` fixture): on two env hosts, all in the
#: caller's process, and mixed (the last sub-env in the caller's process, the others on one
#: host): results are the same in each.
PLACEMENTS = {
    "hosts": {"n_processes": 2},
    "in-process": {"n_processes": 0},
    "mixed": {"n_processes": 1, "caller_envs": 1},
}


@pytest.fixture(params=list(PLACEMENTS))
def placed(request: pytest.FixtureRequest) -> dict[str, int]:
    """The placement arguments of a test run in every placement."""
    return dict(PLACEMENTS[request.param])


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """Fail the test if it leaves a child process or a /dev/shm entry of ours behind."""
    with leaves_nothing():
        yield


#: ``make_sampler``'s defaults when neither the call nor a ``sampler_defaults`` marker gives them.
SAMPLER_DEFAULTS: dict[str, Any] = {"n_processes": 2}


@pytest.fixture
async def make_sampler(request: pytest.FixtureRequest) -> AsyncIterator[SamplerFactory]:
    """The one sampler factory of the suite: builds samplers, closes them, checks for leaks.

    ``make_sampler(backend=None, env=None, agent=None, **kwargs)`` returns a new, unstarted
    :class:`Sampler`. Each argument the call leaves out comes from the closest
    ``@pytest.mark.sampler_defaults(...)`` marker (test, class, then module ``pytestmark``), then
    from :data:`SAMPLER_DEFAULTS`. When none of them gives it, ``env`` is the 4x4 grid world and
    ``backend`` the value of the test's own ``backend`` fixture if it has one (set up first, so a
    Ray cluster it starts is not taken for a leak), else ``"local"``.

    At the end of the test every sampler it made is closed (whether or not the test closed it),
    and the test fails if it left a child process, a /dev/shm entry of ours or a Ray actor
    behind (see :class:`helpers.leaves_nothing`; on Ray, by Ray's own account of its actors).
    """
    default_backend = "local"
    if "backend" in request.fixturenames:
        default_backend = str(request.getfixturevalue("backend"))
    defaults: dict[str, Any] = {}
    for marker in request.node.iter_markers("sampler_defaults"):  # closest first
        for key, value in marker.kwargs.items():
            defaults.setdefault(key, value)
    for key, value in SAMPLER_DEFAULTS.items():
        defaults.setdefault(key, value)
    made: list[Sampler] = []

    def make(
        backend: str | None = None, env: Any = None, agent: Any = None, **kwargs: Any
    ) -> Sampler:
        options = {**defaults, **kwargs}
        backend = backend or options.pop("backend", default_backend)
        env = env if env is not None else options.pop("env", None)
        agent = agent if agent is not None else options.pop("agent", None)
        for key in ("backend", "env", "agent"):
            options.pop(key, None)
        if env is None:
            env = functools.partial(_test_envs.GridWorldEnv, "4x4")
        sampler = Sampler(env, agent, backend=backend, **options)
        made.append(sampler)
        return sampler

    check = leaves_nothing(collect=False)  # every sampler it made is closed below
    check.__enter__()
    yield make
    for sampler in made:
        await sampler.aclose()
    check.__exit__(None, None, None)
