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


import cloudpickle  # noqa: E402
import envs as _test_envs  # noqa: E402

# The test envs live in a module the env-host processes cannot import by name: ship them by value.
cloudpickle.register_pickle_by_value(_test_envs)
