"""What the vector-env faces are given: the source of every sub-env, and the spaces they carry."""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from asyncsample.env_group import fixed_rows
from asyncsample.env_update import EnvId

__all__ = ["check_bufferable", "env_sources"]


def env_sources(env: Any, num_envs: int) -> list[Any]:
    """The source of every sub-env: ``env`` is an id, a factory or a list of ``num_envs``."""
    if isinstance(env, (list, tuple)):
        if len(env) != num_envs:
            raise ValueError(
                f"env: a list of factories must have num_envs={num_envs} entries, got {len(env)}"
            )
        sources = list(env)
    else:
        sources = [env] * num_envs
    out: list[Any] = []
    for i, source in enumerate(sources):
        if isinstance(source, str):
            out.append(EnvId(source))
        elif callable(source) and not isinstance(source, gym.Env):
            out.append(source)
        else:
            what = f"env[{i}]" if isinstance(env, (list, tuple)) else "env"
            raise TypeError(
                f"{what} must be a gymnasium id (str) or a zero-argument callable returning a "
                f"gymnasium.Env, got {type(source).__name__}"
            )
    return out


def check_bufferable(what: str, space: gym.Space[Any]) -> None:
    """Refuse a space whose values have no fixed-size row in the shared step buffers (the SB3
    face's only transport): stored anyway, they would come back as placeholders."""
    if fixed_rows(space):
        return
    if any(isinstance(s, (gym.spaces.Sequence, gym.spaces.Graph)) for s in _leaves(space)):
        raise TypeError(
            f"the {what} space {space} has a dynamic shape so its not possible to make a static "
            "shared memory."
        )
    raise TypeError(
        f"the {what} space {space} has values without a fixed-size row in the shared step "
        "buffers of this vector env (Text, OneOf, Sequence, Graph and custom spaces are not "
        "supported here; asyncsample.VectorEnv supports them)"
    )


def _leaves(space: gym.Space[Any]) -> list[gym.Space[Any]]:
    if isinstance(space, gym.spaces.Dict):
        return [leaf for sub in space.spaces.values() for leaf in _leaves(sub)]
    if isinstance(space, gym.spaces.Tuple):
        return [leaf for sub in space.spaces for leaf in _leaves(sub)]
    return [space]
