"""Argument checks name the argument; misuse raises instead of hanging; restarts are logged."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from envs import FailingEnv, GridWorldEnv, ScriptedAgent

from asyncsample import Sampler

pytestmark = pytest.mark.timeout(60)

GRID = functools.partial(GridWorldEnv, "4x4")


def local(**kwargs: Any) -> Sampler:
    kwargs.setdefault("agent", ScriptedAgent())
    kwargs.setdefault("backend", "local")
    return Sampler(GRID, **kwargs)


CONSTRUCTOR_ERRORS = [
    ({"seed": -1}, ValueError, r"seed must be >= 0, got -1"),
    ({"seed": 1.5}, TypeError, r"seed must be an int >= 0 or None, got float 1.5"),
    ({"seed": True}, TypeError, r"seed must be an int >= 0 or None, got bool True"),
    ({"n_workers": 0}, ValueError, r"n_workers must be >= 1, got 0"),
    ({"n_workers": "2"}, TypeError, r"n_workers must be an int >= 1, got str '2'"),
    ({"envs_per_worker": 2.0}, TypeError, r"envs_per_worker must be an int >= 1, got float"),
    ({"n_processes": 0}, ValueError, r"n_processes must be >= 1, got 0"),
    ({"n_processes": "4"}, TypeError, r"n_processes must be an int >= 1 or None, got str"),
    ({"max_episode_length": 0}, ValueError, r"max_episode_length must be >= 1, got 0"),
    ({"max_episode_length": 9.5}, TypeError, r"max_episode_length must be an int >= 1 or None"),
    ({"max_restarts": -1}, ValueError, r"max_restarts must be >= 0, got -1"),
    ({"max_restarts": None}, TypeError, r"max_restarts must be an int >= 0, got NoneType"),
    ({"backend": 3}, ValueError, r"backend must be one of .*got 3"),
    ({"step_timeout": "1"}, TypeError, r"step_timeout must be a number of seconds or None"),
    ({"step_timeout": 0}, ValueError, r"step_timeout must be a finite number of seconds > 0"),
    ({"step_timeout": float("inf")}, ValueError, r"step_timeout must be a finite number"),
    ({"worker_class": object}, TypeError, r"worker_class must be a subclass of Worker"),
    ({"worker_args": [1]}, TypeError, r"worker_args must be a dict .*got list"),
    ({"worker_args": {1: 2}}, TypeError, r"worker_args keys must be argument names"),
    ({"backend_options": "fast"}, TypeError, r"backend_options must be a dict .*got str"),
    ({"test_env": 5}, TypeError, r"test_env must be a gymnasium id"),
    ({"agent": object()}, TypeError, r"agent must have a get_actions"),
]


@pytest.mark.parametrize(("kwargs", "error", "pattern"), CONSTRUCTOR_ERRORS)
def test_constructor_arguments(kwargs: dict[str, Any], error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        local(**kwargs)


def test_numpy_ints_are_accepted() -> None:
    s = Sampler(GRID, n_workers=np.int64(3), seed=np.uint32(7), backend="local")
    assert s.n_workers == 3 and type(s.n_workers) is int
    assert s.seed == 7


@pytest.mark.parametrize(
    ("backend", "kwargs", "hosts"),
    [
        ("local", {"n_workers": 4}, 1),
        ("process", {"n_workers": 4, "n_processes": 2}, 2),
        ("process", {"n_workers": 2, "n_processes": 8}, 2),
        ("process", {"n_workers": 3}, min(os.cpu_count() or 1, 3)),
        ("ray", {"n_workers": 5, "backend_options": {"workers_per_actor": 2}}, 3),
    ],
)
def test_n_processes_is_the_number_of_hosts_started(
    backend: str, kwargs: dict[str, Any], hosts: int
) -> None:
    # Construction starts nothing, so this needs no Ray cluster.
    assert Sampler(GRID, backend=backend, **kwargs).n_processes == hosts


async def test_process_backend_starts_n_processes_hosts() -> None:
    async with Sampler(GRID, n_workers=3, n_processes=8, backend="process") as s:
        assert s.n_processes == 3
        assert len(s._backend.pids) == 3  # type: ignore[union-attr]


async def test_call_arguments() -> None:
    async with local(n_workers=2) as s:
        with pytest.raises(TypeError, match=r"num_samples must be an int >= 1, got float"):
            await s.obtain_samples(1.0)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"num_samples must be an int >= 1, got bool"):
            await s.obtain_fragments(True)
        with pytest.raises(ValueError, match=r"n_episodes must be >= 1, got 0"):
            await s.evaluate(0)
        with pytest.raises(TypeError, match=r"deterministic must be a bool, got int 1"):
            await s.evaluate(1, deterministic=1)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"render must be a bool"):
            await s.evaluate(1, render="yes")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"get_actions\(observations\) method or be None"):
            await s.evaluate(1, agent=42)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"env must be a gymnasium id"):
            await s.evaluate(1, env=3.5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"fragments must be a bool, got str"):
            await anext(s.stream(5, fragments="no"))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"max_policy_lag must be an int >= 0 or None"):
            await anext(s.stream(5, max_policy_lag=0.5))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"buffer_size must be >= 1, got 0"):
            await anext(s.stream(5, buffer_size=0))
        with pytest.raises(TypeError, match=r"agent_update must be None, parameters"):
            await s.update_agent("new")  # type: ignore[arg-type]
        # Nothing was sampled by the refused calls.
        assert s.total_env_steps == 0
        assert (await s.obtain_samples(12)).n_transitions == 12


@pytest.mark.parametrize(
    "call",
    ["obtain_samples", "obtain_exact_episodes", "obtain_fragments", "stream"],
)
async def test_call_from_the_streaming_task_raises(call: str) -> None:
    async with local(n_workers=1) as s:
        async with contextlib.aclosing(s.stream(6)) as it:
            first = await anext(it)
            with pytest.raises(RuntimeError, match=rf"{call}\(\) was called from the task that"):
                if call == "stream":
                    await anext(s.stream(6))
                else:
                    await getattr(s, call)(6)
            # update_agent stays legal during a stream (it applies at the next step boundary).
            await s.update_agent(ScriptedAgent())
            # The stream carries on.
            second = await anext(it)
        assert first.lengths.tolist() == second.lengths.tolist() == [6]
        # Evaluation uses its own hosts: it works from the streaming task too.
        async with contextlib.aclosing(s.stream(6)) as it:
            await anext(it)
            result = await s.evaluate(1)
        assert result.lengths.tolist() == [6]
        # Once the stream is closed the same task samples again.
        assert (await s.obtain_samples(6)).n_transitions == 6


async def test_restarts_are_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    flag = str(tmp_path / "failed")
    caplog.set_level(logging.INFO, logger="asyncsample")
    async with Sampler(
        functools.partial(FailingEnv, flag, fail_at=8),
        n_workers=2,
        envs_per_worker=3,
        backend="local",
        seed=0,
        max_episode_length=20,
    ) as s:
        await s.obtain_samples(200)
        assert s.restarts == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert warnings[0].name == "asyncsample"
    assert "restarting its env host" in text and "RuntimeError" in text
    assert "injected failure in step" in text
    assert "(restart 1 of at most 3 in this call, 1 in all)" in text
    dropped = [r for r in caplog.records if "dropped by the env-host restart" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].levelno == logging.INFO


async def test_policy_lag_drops_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="asyncsample")
    # Env 1 never reaches a goal: its 9-step episodes are still running when a round ends
    # (after env 0's 6-step episode) and continue, under version 0, into the next round.
    envs = [[GRID, functools.partial(GridWorldEnv, "no_goal")]]
    async with Sampler(
        envs, ScriptedAgent(), n_workers=1, envs_per_worker=2, backend="local", max_episode_length=9
    ) as s:
        async with contextlib.aclosing(s.stream(6, max_policy_lag=0, buffer_size=1)) as it:
            await anext(it)
            # Episodes that started under version 0 are dropped once the newest is 2.
            await s.update_agent(ScriptedAgent())
            await s.update_agent(ScriptedAgent())
            batch = await anext(it)
            assert (batch.episode_infos["agent_version"] == 2).all()
    drops = [r for r in caplog.records if "max_policy_lag=0" in r.getMessage()]
    assert drops and all(r.levelno == logging.INFO for r in drops)


# -- the same mistake, the same error, wherever it is made ---------------------------------------


def _sampler(**kwargs: Any) -> object:
    return Sampler(GRID, backend="process", **kwargs)


def _backend(name: str) -> Any:
    def make(**kwargs: Any) -> object:
        from asyncsample.backends import make_backend

        if name == "ray":
            pytest.importorskip("ray")

        return make_backend(name, **kwargs)

    return make


def _vector_env(**kwargs: Any) -> object:
    from asyncsample.vector import VectorEnv

    return VectorEnv("CartPole-v1", 2, **kwargs)


def _sb3(**kwargs: Any) -> object:
    pytest.importorskip("stable_baselines3")
    from asyncsample.sb3 import AsyncSampleVecEnv

    return AsyncSampleVecEnv("CartPole-v1", 2, **kwargs)


STEP_TIMEOUT_FACES = [
    pytest.param(_sampler, id="Sampler"),
    pytest.param(_backend("process"), id="process"),
    pytest.param(_backend("local"), id="local"),
    # Slow: importing Ray and SB3 (2-9 s); the same check of the other faces stays quick.
    pytest.param(_backend("ray"), id="ray", marks=pytest.mark.slow),
    pytest.param(_vector_env, id="VectorEnv"),
    pytest.param(_sb3, id="AsyncSampleVecEnv", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("make", STEP_TIMEOUT_FACES)
def test_step_timeout_of_the_wrong_type_is_the_same_type_error_everywhere(make: Any) -> None:
    with pytest.raises(
        TypeError, match=r"step_timeout must be a number of seconds or None, got str"
    ):
        make(step_timeout="1")
    with pytest.raises(TypeError, match=r"step_timeout must be a number of seconds or None"):
        make(step_timeout=True)


@pytest.mark.parametrize("make", [STEP_TIMEOUT_FACES[i] for i in (0, 1, 3, 4, 5)])
def test_step_timeout_out_of_range_is_the_same_value_error_everywhere(make: Any) -> None:
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"step_timeout must be a finite number of seconds"):
            make(step_timeout=bad)


def test_backend_names_and_options_go_through_validate() -> None:
    from asyncsample.backends import backend_options, make_backend

    for bad in ("threads", 3, None):
        with pytest.raises(ValueError, match=r"backend must be one of 'process', 'local', 'ray'"):
            make_backend(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"backend must be one of"):
            backend_options(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"n_processes must be >= 1, got 0"):
        make_backend("local", n_processes=0)
    with pytest.raises(TypeError, match=r"n_processes must be an int >= 1 or None, got str"):
        make_backend("process", n_processes="2")


def test_validate_helpers() -> None:
    from asyncsample import _validate as v

    assert v.amount("num_cpus", np.float32(0.5)) == 0.5
    with pytest.raises(ValueError, match=r"num_cpus must be >= 0 and finite, got inf"):
        v.amount("num_cpus", float("inf"))
    with pytest.raises(TypeError, match=r"num_cpus must be a number >= 0, got bool"):
        v.amount("num_cpus", True)
    assert v.amounts("resources", {"sim": 2}) == {"sim": 2.0} and v.amounts("r", None) == {}
    with pytest.raises(TypeError, match=r"resources must be a dict of resource name"):
        v.amounts("resources", ["sim"])
    with pytest.raises(TypeError, match=r"resources keys must be resource names"):
        v.amounts("resources", {1: 2})
    with pytest.raises(ValueError, match=r"resources\['sim'\] must be >= 0"):
        v.amounts("resources", {"sim": -1})
    assert v.choice("mode", "a", ("a", "b")) == "a"
    for bad in ("c", ["a"], None):
        with pytest.raises(ValueError, match=r"mode must be one of 'a', 'b', got"):
            v.choice("mode", bad, ("a", "b"))
    assert v.optional_str("address", None) is None
    with pytest.raises(TypeError, match=r"address must be a str or None, got int 1"):
        v.optional_str("address", 1)
    assert v.subclass("cls", bool, int) is bool
    with pytest.raises(TypeError, match=r"cls must be a subclass of int, got 1"):
        v.subclass("cls", 1, int)
    v.has_method("agent", None, "get_actions", optional=True)
    with pytest.raises(TypeError, match=r"agent must have a get_actions\(...\) method or be None"):
        v.has_method("agent", 3, "get_actions", optional=True)
    with pytest.raises(TypeError, match=r"agent must have a get_actions\(observations\) method,"):
        v.has_method("agent", 3, "get_actions", args="observations")
    assert v.unit_interval("min_fraction", 0) == 0.0
    with pytest.raises(ValueError, match=r"min_fraction must be >= 0 and <= 1, got nan"):
        v.unit_interval("min_fraction", float("nan"))
    assert v.seed_list("seeds", None, 2) is None
    assert v.seed_list("seeds", np.array([3, 4]), 2) == [3, 4]
    assert v.seed_list("seeds", [None, 1], 2) == [None, 1]
    with pytest.raises(TypeError, match=r"seeds must be None or a sequence of 2 ints"):
        v.seed_list("seeds", "12", 2)
    with pytest.raises(ValueError, match=r"seeds must hold one seed per env \(2\), got 1"):
        v.seed_list("seeds", [1], 2)
    with pytest.raises(ValueError, match=r"seeds\[1\] must be an int >= 0 or None, got -1"):
        v.seed_list("seeds", [1, -1], 2)
    with pytest.raises(TypeError, match=r"seeds\[0\] must be an int >= 0 or None, got True"):
        v.seed_list("seeds", [True, 1], 2)
    assert v.env_indices("envs", None, 3) == [0, 1, 2]
    assert v.env_indices("envs", (np.int8(2),), 3) == [2]
    with pytest.raises(ValueError, match=r"envs: index 3 is out of range for 3 envs"):
        v.env_indices("envs", [3], 3)
    with pytest.raises(TypeError, match=r"envs must hold int env indices, got 1.0"):
        v.env_indices("envs", [1.0], 3)
    with pytest.raises(TypeError, match=r"envs must be None or a sequence of env indices"):
        v.env_indices("envs", 1, 3)
    assert v.attr_name("name", "render") == "render"
    with pytest.raises(TypeError, match=r"name must be an attribute name \(str\), got 3"):
        v.attr_name("name", 3)
