"""PettingZoo's own API check (``pettingzoo.test.parallel_api_test``) on our adapters of our
test env and of PettingZoo's envs, and the rows layer on a PettingZoo env whose agents die
(Knights-Archers-Zombies).

Skipped where PettingZoo is not installed (``pip install 'asyncsample[multiagent]'``; the
butterfly envs need its ``butterfly`` extra). Pistonball's check takes seconds: marked slow.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import uvloop

from asyncsample._tree import tree_equal
from asyncsample.multiagent import (
    AsyncParallelAdapter,
    BlockingParallelAdapter,
    RandomActions,
    RowTracker,
    Turn,
    check_parallel_env,
    reference_rollout,
)
from asyncsample.multiagent.testing import AsyncRosterEnv, RosterEnv

pettingzoo = pytest.importorskip("pettingzoo")
from pettingzoo.test import parallel_api_test  # noqa: E402

pytestmark = pytest.mark.timeout(120)

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
#: The warnings parallel_api_test gives for an env that breaks the API without failing it.
API_WARNINGS = ("was not given", "but was dead", "not all possible_agents", "No agents present")


def pettingzoo_env(env_id: str) -> Callable[[], Any]:
    """A factory of the Parallel env ``env_id`` (``"butterfly/pistonball-v6"``): PettingZoo's
    registry (``pettingzoo.make``, 1.27 on), else the env module's ``parallel_env`` (older
    releases, whose registry ids differ). Skips if the env's family cannot be imported (its
    extra is not installed)."""
    make = getattr(pettingzoo, "make", None)
    if make is not None:
        try:
            make("parallel", env_id).close()
        except ImportError as exc:  # FailedToImport is one
            pytest.skip(f"{env_id} cannot be made: {exc}")
        return functools.partial(make, "parallel", env_id)
    family, name = env_id.split("/")
    module = f"pettingzoo.{family}.{name.replace('-v', '_v')}"
    try:
        return importlib.import_module(module).parallel_env  # type: ignore[no-any-return]
    except ImportError as exc:
        pytest.skip(f"{module} cannot be imported: {exc}")


@pytest.fixture
def api_clean() -> Iterator[list[warnings.WarningMessage]]:
    """Fail the test if parallel_api_test warned that the env breaks the API."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    broken = [str(w.message) for w in caught if any(s in str(w.message) for s in API_WARNINGS)]
    assert not broken, broken


def passes(env: Any, capsys: pytest.CaptureFixture[str], num_cycles: int = 100) -> None:
    try:
        parallel_api_test(env, num_cycles=num_cycles)
    finally:
        env.close()
    assert "Passed Parallel API test" in capsys.readouterr().out


# --- our env and adapters -------------------------------------------------------------------


def test_our_env_passes(capsys: pytest.CaptureFixture[str], api_clean: Any) -> None:
    passes(RosterEnv(), capsys)


@pytest.mark.parametrize("loop", list(LOOPS))
def test_our_async_twin_passes_through_the_blocking_adapter(
    loop: str, capsys: pytest.CaptureFixture[str], api_clean: Any
) -> None:
    passes(BlockingParallelAdapter(AsyncRosterEnv(), loop_factory=LOOPS[loop]), capsys)


@pytest.mark.parametrize("loop", list(LOOPS))
def test_our_env_passes_through_both_adapters(
    loop: str, capsys: pytest.CaptureFixture[str], api_clean: Any
) -> None:
    face = BlockingParallelAdapter(AsyncParallelAdapter(RosterEnv()), loop_factory=LOOPS[loop])
    passes(face, capsys)


def test_a_short_max_cycles_passes(capsys: pytest.CaptureFixture[str]) -> None:
    # parallel_api_test sets max_cycles on the env it is given: it truncates every live agent.
    # Cut at 3 steps, medic_0 never joins, and PettingZoo warns that it is not done: expected.
    passes(RosterEnv(), capsys, num_cycles=3)


# --- PettingZoo's envs through our adapters -------------------------------------------------

QUICK = ["classic/rps-v2", "butterfly/cooperative_pong-v6"]
#: PettingZoo's check takes more than a second on these (5 s on Pistonball).
SLOW = ["butterfly/knights_archers_zombies-v11", "butterfly/pistonball-v6"]


@pytest.mark.parametrize("module", QUICK + [pytest.param(m, marks=pytest.mark.slow) for m in SLOW])
def test_pettingzoo_envs_pass_through_both_adapters(
    module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    make = pettingzoo_env(module)
    face = BlockingParallelAdapter(AsyncParallelAdapter(make()))
    passes(face, capsys, num_cycles=50)


def test_the_global_state_passes_through_both_adapters() -> None:
    """PettingZoo's state_test (its suite runs it on every butterfly env) on our adapters: the
    round trip keeps ``state_space`` and ``state()``; an env without them still has none."""
    from pettingzoo.butterfly import cooperative_pong_v6
    from pettingzoo.test import state_test

    face = BlockingParallelAdapter(AsyncParallelAdapter(cooperative_pong_v6.parallel_env()))
    state_test(cooperative_pong_v6.env(), face)
    assert not hasattr(BlockingParallelAdapter(AsyncParallelAdapter(RosterEnv())), "state_space")


@pytest.mark.parametrize("module", QUICK + SLOW)
def test_pettingzoo_envs_pass_our_check(module: str) -> None:
    env = pettingzoo_env(module)()
    try:
        spec = check_parallel_env(env)
        assert spec.possible_agents == tuple(env.possible_agents) and not spec.is_async
    finally:
        env.close()


# --- agents as rows on an env whose agents die ------------------------------------------------


def test_knights_archers_zombies_dead_agents_get_no_more_rows() -> None:
    make = pettingzoo_env("butterfly/knights_archers_zombies-v11")
    spec = check_parallel_env(make())
    result = reference_rollout(make, 6, RandomActions(spec, 6), 130)
    rows = result.rows["default"]  # archers and knights share their spaces
    ends: dict[tuple[int, int], int] = {}  # (env, episode) -> its last env step
    for (env, _, episode), idx in rows.segments().items():
        ends[(env, episode)] = max(ends.get((env, episode), -1), int(rows.env_steps[idx].max()))
    died_early = 0
    for (env, agent, episode), idx in rows.segments().items():
        seg = rows.select(idx)
        assert seg.agent_steps.tolist() == list(range(len(seg)))
        assert seg.env_steps.tolist() == list(range(seg.env_steps[0], seg.env_steps[0] + len(seg)))
        assert not seg.dones[:-1].any(), (agent, episode)  # only the last row ends it
        if seg.dones[-1] and seg.env_steps[-1] < ends[(env, episode)]:
            died_early += 1  # the episode went on without it: no row of it after its death
    assert died_early >= 1  # with this seed archer_1 dies on step 118, and the others go on


def test_the_tracker_follows_pettingzoos_live_agents() -> None:
    make = pettingzoo_env("butterfly/knights_archers_zombies-v11")
    env = make()
    spec = check_parallel_env(env)
    tracker, choose = RowTracker(spec), RandomActions(spec, 1)
    try:
        obs, infos = env.reset(seed=1)
        tracker.reset(0, obs, infos)
        for _ in range(150):
            if not tracker.running[0]:
                assert not env.agents
                obs, infos = env.reset()
                tracker.reset(0, obs, infos)
            assert tracker.live_agents(0) == sorted(env.agents, key=spec.index)
            turn = Turn(spec, 0, 0, tracker.observations(0), tracker.action_masks(0))
            assert all(tree_equal(turn.observations[a], obs[a]) for a in env.agents)
            actions = choose(turn)
            obs, rewards, terminations, truncations, infos = env.step(actions)
            outcome = tracker.step(0, actions, obs, rewards, terminations, truncations, infos)
            acted = outcome.rows["default"]
            assert acted.agent_ids.tolist() == list(actions)
            assert np.array_equal(acted.rewards, [rewards[a] for a in actions])
    finally:
        env.close()
