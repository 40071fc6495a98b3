"""Shared test set-up: every async test runs under asyncio's default loop and under uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Parametrise every asyncio test over both event loops."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def ray_cluster():  # type: ignore[no-untyped-def]
    """One local Ray cluster for the whole session, started on first use, shut down at the end.

    Not autouse: Ray's daemons would otherwise be children of every test, and the tests that
    check for leftover processes would see them. Four CPUs, so evaluate()'s extra actor can be
    scheduled beside a sampler's two on this 2-core machine.
    """
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


import cloudpickle  # noqa: E402
import envs as _test_envs  # noqa: E402

# The test envs live in a module the env-host processes cannot import by name: ship them by value.
cloudpickle.register_pickle_by_value(_test_envs)
