"""What the SB3 face's env hosts build: the user's env inside :class:`SB3Access`.

A module of its own, without Stable-Baselines3: the factories the face pickles to its hosts
name this module, so a host imports gymnasium, not SB3 and torch (seconds per host)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gymnasium as gym

from asyncsample.env_update import make_env

__all__ = ["SB3Access", "SB3EnvFactory"]


class SB3Access(gym.Wrapper[Any, Any, Any, Any]):
    """Wraps every sub-env in its host for SB3's attribute semantics, which no gymnasium
    ``call`` has (``get_attr`` never calls, ``set_attr`` sets on the outermost env,
    ``env_is_wrapped`` walks the wrappers); invisible to the user's code otherwise."""

    @property
    def spec(self) -> Any:  # type: ignore[override]
        return self.env.spec

    def get_wrapper_attr(self, name: str) -> Any:
        if name.startswith("_asyncsample_"):
            return getattr(self, name)
        return self.env.get_wrapper_attr(name)

    def set_wrapper_attr(self, name: str, value: Any, *, force: bool = True) -> bool:
        return self.env.set_wrapper_attr(name, value, force=force)

    def _asyncsample_get(self, name: str) -> Any:
        """The attribute ``name`` of the env, never called (SB3's ``get_attr``)."""
        return self.env.get_wrapper_attr(name)

    def _asyncsample_setattr(self, name: str, value: Any) -> None:
        """Plain ``setattr`` on the user's outermost env (SB3's ``set_attr``)."""
        setattr(self.env, name, value)

    def _asyncsample_method(self, name: str, args: Any, kwargs: Any) -> Any:
        """Call the method ``name`` of the env (SB3's ``env_method``)."""
        return self.env.get_wrapper_attr(name)(*args, **kwargs)

    def _asyncsample_is_wrapped(self, wrapper_class: type) -> bool:
        """Whether the user's env is wrapped with ``wrapper_class`` (SB3's ``env_is_wrapped``)."""
        env: Any = self.env
        while isinstance(env, gym.Wrapper):
            if isinstance(env, wrapper_class):
                return True
            env = env.env
        return False


@dataclass
class SB3EnvFactory:
    """Builds one sub-env in its host: the user's env inside an :class:`SB3Access`."""

    source: Any

    def __call__(self) -> gym.Env[Any, Any]:
        return SB3Access(make_env(self.source))
