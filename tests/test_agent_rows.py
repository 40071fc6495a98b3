"""An agent that fails some rows of a call (AgentRowsError): each failed row is its env's fault
alone, handled as an env fault is (the episode dropped, the env rebuilt, max_restarts), on the
lanes in the caller and in the env hosts, and with envs stepped in lockstep (the host restarted).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from async_envs import CountingAsyncEnv
from envs import GridWorldEnv, first_to_claim
from helpers import SamplerFactory

from asyncsample import AgentRowsError, EpisodeBatch, WorkerError

LENGTH = 5


class RowFailingAgent:
    """Acts 1 everywhere; fails the rows whose observation's step count is ``at`` while
    ``times`` allows (``None``: always), with a ``RuntimeError`` as each row's cause. With a
    ``flag`` file, only the first row to claim it fails (once, whichever process or agent copy
    asks)."""

    def __init__(self, at: int = 2, times: int | None = 1, flag: str | None = None) -> None:
        self.at = at
        self.left = times
        self.flag = flag
        self.failed = 0

    def _failures(self, observations: np.ndarray) -> dict[int, BaseException]:
        failures: dict[int, BaseException] = {}
        for j, row in enumerate(np.asarray(observations).reshape(len(observations), -1)):
            if int(row[0]) == self.at and (self.left is None or self.left > 0):
                if self.flag is not None and not first_to_claim(self.flag):
                    continue
                if self.left is not None:
                    self.left -= 1
                failures[j] = RuntimeError(f"no reply for row {j}")
        return failures

    def get_actions(self, observations: np.ndarray) -> Any:
        actions = np.ones(len(observations), dtype=np.int64)
        infos = {"seen": np.asarray(observations).reshape(len(observations), -1)[:, 0].copy()}
        failures = self._failures(observations)
        if failures:
            self.failed += len(failures)
            raise AgentRowsError(actions, infos, failures)
        return actions, infos


class AsyncRowFailingAgent(RowFailingAgent):
    async def get_actions(self, observations: np.ndarray) -> Any:  # type: ignore[override]
        return super().get_actions(observations)


def _intact(batch: EpisodeBatch, length: int) -> None:
    """Every episode is whole: ``length`` steps, its observations' counts 0, 1, 2, ..."""
    assert batch.lengths.tolist() == [length] * len(batch.lengths)
    for episode in batch.split():
        np.testing.assert_array_equal(episode.observations[:, 0], np.arange(length))
        np.testing.assert_array_equal(episode.agent_infos["seen"], np.arange(length))


@pytest.mark.both_loops
@pytest.mark.parametrize(
    ("backend", "inference"),
    [("asyncio", "per_worker"), ("asyncio", "batched"), ("process", "per_worker")],
)
async def test_a_failed_row_costs_only_its_envs_episode(
    make_sampler: SamplerFactory, backend: str, inference: str
) -> None:
    agent = AsyncRowFailingAgent()
    sampler = make_sampler(
        backend,
        lambda: CountingAsyncEnv(LENGTH),
        agent,
        n_workers=2,
        envs_per_worker=4,
        n_processes=1,
        inference=inference,
        seed=3,
    )
    batch = await sampler.obtain_exact_episodes(8)
    assert agent.failed == 1
    assert sampler.last_stats is not None and sampler.last_stats.restarts == 1
    assert len(batch.lengths) == 16  # the quota is met: the dropped episode was redone
    _intact(batch, LENGTH)
    again = await sampler.obtain_samples(40)  # the rebuilt env steps on
    _intact(again, LENGTH)


async def test_a_failed_row_in_an_env_host_agent_copy_is_that_envs_fault(
    make_sampler: SamplerFactory,
) -> None:
    sampler = make_sampler(
        "process",
        lambda: CountingAsyncEnv(LENGTH),
        AsyncRowFailingAgent(),
        n_workers=1,
        envs_per_worker=4,
        n_processes=1,
        inference="host",
    )
    batch = await sampler.obtain_exact_episodes(8)
    assert sampler.last_stats is not None and sampler.last_stats.restarts == 1
    assert len(batch.lengths) == 8
    _intact(batch, LENGTH)


@pytest.mark.parametrize(
    ("backend", "inference"),
    [("local", "per_worker"), ("process", "per_worker"), ("local", "batched"), ("process", "host")],
)
async def test_with_lockstep_envs_a_failed_row_restarts_the_host(
    make_sampler: SamplerFactory, backend: str, inference: str, tmp_path: Path
) -> None:
    """In the worker's call, in a merged call of the workers' rows, in the host's agent copy."""
    # Action 1 walks the grid world's cells 0, 4, 8, 12 (a hole); one row at cell 4 fails.
    agent = RowFailingAgent(at=4, flag=str(tmp_path / "failed"))
    sampler = make_sampler(
        backend,
        GridWorldEnv,
        agent,
        n_workers=2,
        envs_per_worker=3,
        n_processes=1,
        inference=inference,
    )
    batch = await sampler.obtain_exact_episodes(6)
    if inference != "host":  # (a copy acts in the host)
        assert agent.failed == 1
    assert sampler.last_stats is not None and sampler.last_stats.restarts == 1
    assert batch.lengths.tolist() == [3] * 12  # whole episodes: cells 0, 4, 8, then the hole
    assert all(step_types[-1] == 2 for step_types in (e.step_types for e in batch.split()))


async def test_past_max_restarts_the_call_names_the_env_and_the_cause(
    make_sampler: SamplerFactory,
) -> None:
    sampler = make_sampler(
        "asyncio",
        lambda: CountingAsyncEnv(LENGTH),
        AsyncRowFailingAgent(times=None),
        n_workers=1,
        envs_per_worker=2,
        max_restarts=2,
    )
    with pytest.raises(WorkerError) as caught:
        await sampler.obtain_samples(100)
    err = caught.value
    assert err.worker == 0 and err.env in (0, 1)
    assert "the agent failed this env's row: RuntimeError: no reply for row" in str(err)
    assert isinstance(err.__cause__, RuntimeError)


def test_agent_rows_error_needs_a_failed_row_and_pickles() -> None:
    import pickle

    with pytest.raises(ValueError, match="at least one failed row"):
        AgentRowsError(np.zeros(2), None, {})
    err = pickle.loads(pickle.dumps(AgentRowsError(np.zeros(2), None, {1: KeyError("x")})))
    assert list(err.failures) == [1] and isinstance(err.failures[1], KeyError)
    fault = err.row_fault(1, worker=3, env=1)
    assert (fault.worker, fault.env, fault.retry) == (3, 1, True)
    assert isinstance(fault.__cause__, KeyError)


class _OutOfRange:
    """Fails a row it was never given."""

    async def get_actions(self, observations: np.ndarray) -> Any:
        raise AgentRowsError(np.ones(len(observations), np.int64), None, {99: KeyError("x")})


@pytest.mark.parametrize(
    ("backend", "env"), [("asyncio", CountingAsyncEnv), ("local", GridWorldEnv)]
)
async def test_a_failure_of_a_row_not_given_is_the_agents_mistake(
    make_sampler: SamplerFactory, backend: str, env: Any
) -> None:
    sampler = make_sampler(backend, env, _OutOfRange(), n_workers=1, envs_per_worker=2)
    with pytest.raises(ValueError, match=r"rows \[99\] are not rows of the agent's call"):
        await sampler.obtain_samples(10)
