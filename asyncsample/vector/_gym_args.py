"""``AsyncVectorEnv``'s arguments and errors, as :class:`~asyncsample.VectorEnv` takes and raises
them: its users switch with one line, and code that catches its errors keeps working."""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium.error import AlreadyPendingCallError, CustomSpaceError, NoAsyncCallError
from gymnasium.spaces import Space
from gymnasium.spaces.utils import is_space_dtype_shape_equiv
from gymnasium.vector.utils import batch_differing_spaces, create_shared_memory

from asyncsample import _validate
from asyncsample.backends import pool_size
from asyncsample.env_update import make_env

__all__ = [
    "AlreadyPending",
    "NoAsyncCall",
    "check_async_vector_env_options",
    "check_shared_memory",
    "check_spaces",
    "concurrency_limit",
    "observation_spaces",
]


class AlreadyPending(AlreadyPendingCallError, RuntimeError):
    """gymnasium's ``AlreadyPendingCallError``, also a ``RuntimeError`` (as before)."""


class NoAsyncCall(NoAsyncCallError, RuntimeError):
    """gymnasium's ``NoAsyncCallError``, also a ``RuntimeError`` (as before)."""


def check_async_vector_env_options(
    shared_memory: Any, copy: Any, context: Any, daemon: Any, worker: Any, observation_mode: Any
) -> None:
    """``AsyncVectorEnv``'s own arguments, checked as it checks them (a ``worker`` is refused)."""
    _validate.flag("shared_memory", shared_memory)
    _validate.flag("copy", copy)
    _validate.flag("daemon", daemon)
    if context is not None:
        if not isinstance(context, str) or context not in multiprocessing.get_all_start_methods():
            raise ValueError(
                f"context must be None or one of {multiprocessing.get_all_start_methods()}, got "
                f"{context!r}"
            )
    if worker is not None:
        raise ValueError(
            "worker: a custom worker function cannot be used: the sub-envs live in asyncsample's "
            "env hosts, several to a process, which step them with the sampler's own env-group "
            "code (no per-env pipe for a worker function to serve); wrap the env instead"
        )
    if isinstance(observation_mode, tuple) and len(observation_mode) == 2:
        if not all(isinstance(space, Space) for space in observation_mode):
            raise TypeError(  # gymnasium's words
                "Expected both elements of observation_mode to be Spaces, got "
                f"{type(observation_mode[0])} and {type(observation_mode[1])}"
            )
    elif not (isinstance(observation_mode, str) and observation_mode in ("same", "different")):
        raise ValueError(  # gymnasium's words
            "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single and "
            f"batch observation space, actual got {observation_mode}"
        )


def concurrency_limit(max_concurrency: Any, n_processes: int | None, num_envs: int) -> int | None:
    """The ``n_processes`` that keeps at most ``max_concurrency`` sub-envs stepping at once (a
    host steps its sub-envs one after another), checked as ``AsyncVectorEnv`` checks it."""
    if max_concurrency is None:
        return n_processes
    # AsyncVectorEnv's checks and words (gymnasium 1.4).
    if not isinstance(max_concurrency, (int, np.integer)):
        raise ValueError(
            f"`max_concurrency` must be an integer or None, got {type(max_concurrency)}."
        )
    if max_concurrency < 1:
        raise ValueError(f"`max_concurrency` must be a positive or None, got {max_concurrency}.")
    limit = int(max_concurrency)
    if n_processes is None:
        return min(pool_size(None, num_envs), limit)
    if n_processes > limit:
        raise ValueError(
            f"n_processes={n_processes} would step up to {n_processes} sub-envs at once (one per "
            f"env-host process), more than max_concurrency={limit}: give one of them, or "
            "n_processes <= max_concurrency"
        )
    return n_processes


class _NoMemory:
    """A ``ctx`` for gymnasium's ``create_shared_memory`` that allocates nothing."""

    def Array(self, typecode_or_type: Any, size: int) -> None:
        return None


def check_shared_memory(space: Space[Any]) -> None:
    """Refuse what ``AsyncVectorEnv(shared_memory=True)`` refuses, with its errors (our
    buffers would not need it, but code written against ``AsyncVectorEnv`` expects it)."""
    try:
        create_shared_memory(space, n=1, ctx=_NoMemory())  # type: ignore[arg-type]
    except CustomSpaceError as exc:
        raise ValueError(  # gymnasium's words
            "Using `AsyncVector(..., shared_memory=True)` caused an error, you can disable this "
            "feature with `shared_memory=False` however this is slower."
        ) from exc


def observation_spaces(
    observation_mode: Any, sources: list[Any]
) -> tuple[Space[Any] | None, Space[Any] | None]:
    """The single and batched observation spaces ``observation_mode`` asks for (``None``: the
    first sub-env's, batched), as ``AsyncVectorEnv`` computes them."""
    if isinstance(observation_mode, tuple):
        batched, single = observation_mode
        return single, batched
    if observation_mode == "different":
        # Each sub-env built once in this process, as AsyncVectorEnv does.
        spaces = []
        for source in sources:
            env = make_env(source)
            try:
                spaces.append(env.observation_space)
            finally:
                env.close()
        return spaces[0], batch_differing_spaces(spaces)
    return None, None


def check_spaces(
    obs_spaces: Sequence[Space[Any]],
    act_spaces: Sequence[Space[Any]],
    single_observation_space: Space[Any],
    single_action_space: Space[Any],
    observation_mode: Any,
) -> None:
    """Every sub-env's spaces are the first one's (``AsyncVectorEnv``'s check and words)."""
    single = single_observation_space
    if observation_mode != "same":
        if not all(is_space_dtype_shape_equiv(single, space) for space in obs_spaces):
            raise RuntimeError(
                "VectorEnv(..., observation_mode='different' or custom space) however the "
                "sub-environment's observation spaces do not share a common shape and dtype."
            )
    elif any(space != single for space in obs_spaces):
        raise RuntimeError(
            "VectorEnv(..., observation_mode='same') however some of the sub-environments "
            "observation spaces are not equivalent. If this is intentional, use "
            "`observation_mode='different'` instead (with gymnasium's AsyncVectorEnv: "
            "asyncsample's VectorEnv batches identical spaces only)."
        )
    if any(space != single_action_space for space in act_spaces):
        raise RuntimeError(
            f"Some environments have an action space different from "
            f"`{single_action_space}`. In order to batch actions, the action spaces "
            "from all environments must be equal."
        )
