"""Telling a multi-agent env apart, and checking a user's env or factory before any work.

:func:`check_parallel_env` accepts PettingZoo's ``ParallelEnv`` and its async twin (see
:mod:`asyncsample.multiagent.protocols`) and returns their :class:`ParallelEnvSpec`; anything
else is a :class:`~asyncsample.errors.ParallelEnvError` (a ``TypeError``) whose message names
the argument, what was expected and what was given: a single-agent gymnasium env, a PettingZoo
AEC env (one agent at a time), an env whose ``reset`` is a coroutine and ``step`` not, a
missing or empty ``possible_agents``, a space that is not a gymnasium space.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import gymnasium as gym

from asyncsample.errors import ParallelEnvError
from asyncsample.multiagent.protocols import AgentID

__all__ = [
    "ParallelEnvSpec",
    "check_parallel_env",
    "check_parallel_env_factory",
    "is_async_parallel_env",
    "is_parallel_env",
]

_EXPECTED = (
    "a PettingZoo ParallelEnv (possible_agents, observation_space(agent), "
    "action_space(agent), reset(seed, options), step(actions)) or its async twin (the same "
    "with async def reset/step)"
)


@dataclasses.dataclass(frozen=True)
class ParallelEnvSpec:
    """What the multi-agent layer needs to know of an env before its first step.

    Attributes:
        possible_agents: every agent id the env can have, in the env's order; an agent's
            index in it is its slot.
        observation_spaces: the observation space of each possible agent.
        action_spaces: the action space of each possible agent.
        is_async: whether ``reset``/``step`` are coroutines (the async twin).
        slots: each possible agent's index in :attr:`possible_agents`.
    """

    possible_agents: tuple[AgentID, ...]
    observation_spaces: Mapping[AgentID, gym.Space[Any]]
    action_spaces: Mapping[AgentID, gym.Space[Any]]
    is_async: bool

    slots: Mapping[AgentID, int] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "slots", {agent: i for i, agent in enumerate(self.possible_agents)}
        )

    def index(self, agent: AgentID) -> int:
        """The slot of ``agent`` in :attr:`possible_agents`.

        Raises:
            KeyError: ``agent`` is not one of the possible agents.
        """
        return self.slots[agent]


def _is_coroutine(obj: object, name: str) -> bool:
    return inspect.iscoroutinefunction(getattr(obj, name, None))


def _is_agent_method(obj: object, name: str) -> bool:
    """Whether ``obj.name`` is a method of the agent (PettingZoo), not a gymnasium space."""
    value = getattr(obj, name, None)
    return callable(value) and not isinstance(value, gym.Space)


def is_parallel_env(obj: object) -> bool:
    """Whether ``obj`` has the shape of a PettingZoo ``ParallelEnv`` or of its async twin:
    ``possible_agents``, ``observation_space``/``action_space`` methods, ``reset``/``step``
    (no call is made; :func:`check_parallel_env` checks the values)."""
    return (
        hasattr(obj, "possible_agents")
        and _is_agent_method(obj, "observation_space")
        and _is_agent_method(obj, "action_space")
        and callable(getattr(obj, "reset", None))
        and callable(getattr(obj, "step", None))
    )


def is_async_parallel_env(obj: object) -> bool:
    """Whether ``obj`` is the async twin of a ``ParallelEnv``: :func:`is_parallel_env` with
    ``reset`` and ``step`` coroutine functions."""
    return is_parallel_env(obj) and _is_coroutine(obj, "reset") and _is_coroutine(obj, "step")


def _kind(obj: object) -> str:
    """``obj``'s type, and its gymnasium id where it has one."""
    env_id = getattr(getattr(obj, "spec", None), "id", None)
    return type(obj).__name__ + (f" (id {env_id!r})" if isinstance(env_id, str) else "")


def _refuse_other_kinds(env: object, name: str) -> None:
    """A clear error for the envs people mistake for a ParallelEnv."""
    kind = _kind(env)
    if isinstance(getattr(env, "observation_space", None), gym.Space) or isinstance(env, gym.Env):
        raise ParallelEnvError(
            f"{name}: expected {_EXPECTED}; got {kind}, a single-agent env (its "
            "observation_space is a gymnasium space, not a method of the agent): sample it "
            "with asyncsample.Sampler as it is"
        )
    if hasattr(env, "agent_selection") and callable(getattr(env, "last", None)):
        raise ParallelEnvError(
            f"{name}: expected {_EXPECTED}; got {kind}, a PettingZoo AEC env (one agent acts "
            "at a time): convert it with pettingzoo.utils.conversions.aec_to_parallel(env), "
            "or use the env module's parallel_env()"
        )


def _check_methods(env: object, name: str) -> bool:
    """Check ``reset``/``step``; return whether they are coroutines."""
    kind = _kind(env)
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise ParallelEnvError(
            f"{name}: expected {_EXPECTED}; got {kind}, which has no "
            f"{' and no '.join(missing)} method"
        )
    reset_async, step_async = _is_coroutine(env, "reset"), _is_coroutine(env, "step")
    if reset_async != step_async:
        coro, plain = ("reset", "step") if reset_async else ("step", "reset")
        raise ParallelEnvError(
            f"{name}: expected reset and step both plain (a ParallelEnv) or both async def "
            f"(its async twin); got {kind}, whose {coro} is a coroutine function and {plain} "
            "is not"
        )
    return reset_async


def _check_agents(env: Any, name: str) -> tuple[AgentID, ...]:
    kind = _kind(env)
    if not hasattr(env, "possible_agents"):
        raise ParallelEnvError(
            f"{name}: expected {_EXPECTED}; got {kind}, which has no possible_agents (the "
            "list of every agent id the env can have)"
        )
    agents = env.possible_agents
    if isinstance(agents, (str, bytes)) or not isinstance(agents, Sequence):
        raise ParallelEnvError(
            f"{name}: possible_agents must be a list of agent ids; got "
            f"{type(agents).__name__} from {kind}"
        )
    if not agents:
        raise ParallelEnvError(
            f"{name}: possible_agents must list at least one agent id; {kind} lists none"
        )
    unhashable = [a for a in agents if not isinstance(a, Hashable)]
    if unhashable:
        raise ParallelEnvError(
            f"{name}: agent ids must be hashable (they key the env's dicts); {kind}'s "
            f"possible_agents holds {type(unhashable[0]).__name__} {unhashable[0]!r}"
        )
    seen: set[AgentID] = set()
    for agent in agents:
        if agent in seen:
            raise ParallelEnvError(
                f"{name}: possible_agents must list each agent once; {kind} lists {agent!r} "
                "more than once"
            )
        seen.add(agent)
    return tuple(agents)


def _space_of(env: object, name: str, which: str, agent: AgentID) -> gym.Space[Any]:
    """``env.<which>(agent)``, or the entry of PettingZoo's older ``<which>s`` dict."""
    kind = _kind(env)
    has_method = _is_agent_method(env, which)
    # The older dict only where there is no method: PettingZoo's wrappers warn when it is read.
    table = None if has_method else getattr(env, which + "s", None)
    if not has_method and not isinstance(table, Mapping):
        raise ParallelEnvError(
            f"{name}: expected {_EXPECTED}; got {kind}, which has no {which}(agent) method"
        )
    try:
        space = getattr(env, which)(agent) if has_method else table[agent]  # type: ignore[index]
    except Exception as exc:
        raise ParallelEnvError(
            f"{name}: {kind}.{which}({agent!r}) raised {type(exc).__name__}: {exc} (every "
            "agent of possible_agents needs a space)"
        ) from exc
    if not isinstance(space, gym.Space):
        raise ParallelEnvError(
            f"{name}: {kind}.{which}({agent!r}) must return a gymnasium.spaces.Space; got "
            f"{type(space).__name__}"
        )
    return space


def check_parallel_env(env: object, name: str = "env") -> ParallelEnvSpec:
    """Check that ``env`` is a PettingZoo ``ParallelEnv`` or its async twin, and describe it.

    Nothing is stepped or reset: the checks read ``possible_agents`` and ask each possible
    agent's spaces.

    Args:
        env: the env to check.
        name: the argument's name, for the messages (``"env"``, ``"env_fn()"``...).

    Returns:
        The env's :class:`ParallelEnvSpec`.

    Raises:
        ParallelEnvError: ``env`` is of another kind, or one of its members is not what a
            ParallelEnv has; the message names ``name``, what was expected and what was given.
    """
    _refuse_other_kinds(env, name)
    is_async = _check_methods(env, name)
    agents = _check_agents(env, name)
    observation_spaces = {a: _space_of(env, name, "observation_space", a) for a in agents}
    action_spaces = {a: _space_of(env, name, "action_space", a) for a in agents}
    return ParallelEnvSpec(agents, observation_spaces, action_spaces, is_async)


def check_parallel_env_factory(
    env_fn: Callable[[], Any], name: str = "env"
) -> tuple[Any, ParallelEnvSpec]:
    """Build one env from ``env_fn`` and check it (:func:`check_parallel_env`).

    Args:
        env_fn: a zero-argument callable returning a ParallelEnv or its async twin (a
            PettingZoo module's ``parallel_env`` function is one).
        name: the argument's name, for the messages.

    Returns:
        ``(env, spec)``: the env built (the caller closes it, or uses it) and its spec.

    Raises:
        ParallelEnvError: ``env_fn`` is not callable (an env given in place of its factory
            says so), it raised (the cause is chained), or what it returned is not a usable
            ParallelEnv.
    """
    if not callable(env_fn):
        given = _kind(env_fn)
        hint = ""
        if is_parallel_env(env_fn):
            hint = ": that is an env, not its factory; pass a function that builds one"
        raise ParallelEnvError(
            f"{name}: expected a zero-argument callable returning {_EXPECTED}; got {given}{hint}"
        )
    try:
        env = env_fn()
    except Exception as exc:
        raise ParallelEnvError(
            f"{name}: the env factory {getattr(env_fn, '__qualname__', _kind(env_fn))} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if inspect.isawaitable(env):
        close = getattr(env, "close", None)
        if callable(close):
            close()  # a coroutine never awaited warns otherwise
        raise ParallelEnvError(
            f"{name}: the env factory must return the env itself; it returned an awaitable "
            f"({_kind(env)}): make the factory a plain function that builds the async env"
        )
    return env, check_parallel_env(env, f"{name}()")
