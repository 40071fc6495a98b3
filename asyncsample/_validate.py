"""Argument checks, one helper per kind of argument: a wrong type is a ``TypeError``, a value
out of range a ``ValueError``, each naming the argument, what was expected and what was given.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard, TypeVar

import cloudpickle
import gymnasium as gym
import numpy as np
import psutil

from asyncsample.columns import is_variable_space
from asyncsample.env_update import EnvId, EnvSource, is_env_source

__all__ = [
    "PER_ENV_BYTES",
    "RECORDABLE_SPACES",
    "amount",
    "amounts",
    "attr_name",
    "call_targets",
    "check_picklable",
    "choice",
    "env_indices",
    "env_source",
    "flag",
    "fraction",
    "has_method",
    "memory_fits",
    "nonnegative_int",
    "optional_nonnegative_int",
    "optional_positive_int",
    "optional_str",
    "options_dict",
    "per_worker_sources",
    "positive_int",
    "positive_seconds",
    "recordable_space",
    "reset_arguments",
    "seconds",
    "seed",
    "seed_list",
    "set_attr_targets",
    "subclass",
    "unit_interval",
]


_T = TypeVar("_T")


def _is_int(value: object) -> TypeGuard[int | np.integer[Any]]:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float | np.integer[Any] | np.floating[Any]]:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def _shown(value: object) -> str:
    return f"{type(value).__name__} {value!r}"


def _is_sequence(value: object) -> TypeGuard[Sequence[Any] | np.ndarray[Any, Any]]:
    return isinstance(value, (Sequence, np.ndarray)) and not isinstance(value, (str, bytes))


def _int_at_least(name: str, value: object, low: int, tail: str = "") -> int:
    """``value`` as an int >= ``low``; ``tail`` ends the type error (``" or None"``)."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an int >= {low}{tail}, got {_shown(value)}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def positive_int(name: str, value: object) -> int:
    """``value`` as an int >= 1 (numpy ints accepted, bool rejected)."""
    return _int_at_least(name, value, 1)


def optional_positive_int(name: str, value: object) -> int | None:
    """``None``, or ``value`` as an int >= 1."""
    return None if value is None else _int_at_least(name, value, 1, " or None")


def nonnegative_int(name: str, value: object) -> int:
    """``value`` as an int >= 0 (numpy ints accepted, bool rejected)."""
    return _int_at_least(name, value, 0)


def optional_nonnegative_int(name: str, value: object) -> int | None:
    """``None``, or ``value`` as an int >= 0."""
    return None if value is None else _int_at_least(name, value, 0, " or None")


def optional_niceness(name: str, value: object, default: int) -> int:
    """``value`` as an increment of a process's niceness, an int from 0 to 19 (``None``:
    ``default``)."""
    if value is None:
        return default
    nice = _int_at_least(name, value, 0, " or None")
    if nice > 19:
        raise ValueError(f"{name} must be from 0 to 19, got {nice}")
    return nice


def seed(name: str, value: object) -> int | None:
    """``None`` or an int in ``[0, 2**128)`` (what ``numpy.random.SeedSequence`` takes)."""
    return optional_nonnegative_int(name, value)


def positive_seconds(name: str, value: object) -> float | None:
    """``None`` or a finite number of seconds > 0."""
    if value is None:
        return None
    if not _is_number(value):
        raise TypeError(f"{name} must be a number of seconds or None, got {_shown(value)}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def seconds(name: str, value: object) -> float:
    """A finite number of seconds > 0 (``None`` refused: the argument has a default)."""
    if value is None:
        raise TypeError(f"{name} must be a number of seconds > 0, got None")
    checked = positive_seconds(name, value)
    assert checked is not None
    return checked


def flag(name: str, value: object) -> bool:
    """``value`` as a bool (numpy bools accepted; ints and other types rejected)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {_shown(value)}")
    return bool(value)


def fraction(name: str, value: object) -> float:
    """``value`` as a float in ``(0, 1]`` (ints and numpy numbers accepted, bool rejected)."""
    if not _is_number(value):
        raise TypeError(f"{name} must be a number in (0, 1], got {_shown(value)}")
    if not 0 < value <= 1:  # also rejects NaN
        raise ValueError(f"{name} must be > 0 and <= 1, got {value!r}")
    return float(value)


def unit_interval(name: str, value: object) -> float:
    """``value`` as a float in ``[0, 1]`` (ints and numpy numbers accepted, bool rejected)."""
    if not _is_number(value):
        raise TypeError(f"{name} must be a number in [0, 1], got {_shown(value)}")
    if not 0 <= value <= 1:  # also rejects NaN
        raise ValueError(f"{name} must be >= 0 and <= 1, got {value!r}")
    return float(value)


def amount(name: str, value: object) -> float:
    """``value`` as a finite float >= 0: an amount of a resource (CPUs, GPUs, ...)."""
    if not _is_number(value):
        raise TypeError(f"{name} must be a number >= 0, got {_shown(value)}")
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be >= 0 and finite, got {value!r}")
    return float(value)


def amounts(name: str, value: object) -> dict[str, float]:
    """``None`` (nothing) or a mapping of resource name (str) to :func:`amount`, copied."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{name} must be a dict of resource name to amount or None, got {_shown(value)}"
        )
    out: dict[str, float] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise TypeError(f"{name} keys must be resource names (str), got {_shown(key)}")
        out[key] = amount(f"{name}[{key!r}]", item)
    return out


def choice(name: str, value: _T, choices: Sequence[_T]) -> _T:
    """``value`` if it is one of ``choices``; else (whatever its type) a ``ValueError``."""
    try:
        if value in choices:
            return value
    except TypeError:  # unhashable or uncomparable: not one of them either
        pass
    raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def optional_str(name: str, value: object) -> str | None:
    """``None`` or a str."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {_shown(value)}")
    return value


def subclass(name: str, value: object, base: type[_T]) -> type[_T]:
    """``value`` if it is a class derived from ``base`` (or ``base`` itself)."""
    if not (isinstance(value, type) and issubclass(value, base)):
        raise TypeError(f"{name} must be a subclass of {base.__name__}, got {value!r}")
    return value


def has_method(
    name: str, value: object, method: str, *, args: str = "...", optional: bool = False
) -> None:
    """Raise ``TypeError`` unless ``value`` has a callable ``method`` (or is ``None``, if optional);
    ``args`` only shows the call in the message."""
    if optional and value is None:
        return
    if not callable(getattr(value, method, None)):
        tail = " or be None" if optional else ""
        raise TypeError(
            f"{name} must have a {method}({args}) method{tail}, got {type(value).__name__}"
        )


def seed_list(name: str, value: object, n: int) -> list[int | None] | None:
    """``None``, or a sequence of ``n`` seeds (each an int >= 0 or ``None``), as a list."""
    if value is None:
        return None
    if not _is_sequence(value) or isinstance(value, Mapping):
        raise TypeError(
            f"{name} must be None or a sequence of {n} ints or None, got {type(value).__name__}"
        )
    if len(value) != n:
        raise ValueError(f"{name} must hold one seed per env ({n}), got {len(value)}")
    out: list[int | None] = []
    for k, item in enumerate(value):
        if item is None:
            out.append(None)
        elif not _is_int(item):
            raise TypeError(f"{name}[{k}] must be an int >= 0 or None, got {item!r}")
        elif item < 0:
            raise ValueError(f"{name}[{k}] must be an int >= 0 or None, got {item}")
        else:
            out.append(int(item))
    return out


def env_indices(name: str, value: object, n: int) -> list[int]:
    """``None`` (every env) or a sequence of env indices in ``[0, n)``, as a list of ints."""
    if value is None:
        return list(range(n))
    if not _is_sequence(value):
        raise TypeError(f"{name} must be None or a sequence of env indices, got {value!r}")
    out: list[int] = []
    for i in value:
        if not _is_int(i):
            raise TypeError(f"{name} must hold int env indices, got {i!r}")
        if not 0 <= i < n:
            raise ValueError(f"{name}: index {i} is out of range for {n} envs")
        out.append(int(i))
    return out


def attr_name(name: str, value: object) -> str:
    """``value`` as the name of an attribute or method (a str)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be an attribute name (str), got {value!r}")
    return value


def options_dict(name: str, value: object) -> dict[str, Any]:
    """``None`` (no options) or a mapping with string keys, copied."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict of keyword arguments or None, got {_shown(value)}")
    for key in value:
        if not isinstance(key, str):
            raise TypeError(f"{name} keys must be argument names (str), got {_shown(key)}")
    return dict(value)


def env_source(name: str, source: object) -> EnvSource:
    """Check an env source; a gymnasium id becomes an :class:`EnvId` carrying its registration."""
    if isinstance(source, str):
        try:
            return EnvId(source)
        except gym.error.Error as exc:
            raise ValueError(f"{name}: unknown gymnasium env id {source!r} ({exc})") from None
        except ImportError as exc:  # "module:EnvId": the module that registers the id
            module = source.rpartition(":")[0]
            raise ValueError(
                f"{name}: gymnasium env id {source!r} names the module {module!r} to import "
                f"first, which could not be imported ({type(exc).__name__}: {exc})"
            ) from None
    if not is_env_source(source):
        raise TypeError(
            f"{name} must be a gymnasium id (str), a zero-argument callable returning a "
            f"gymnasium.Env, a gymnasium.Env, an EnvUpdate or a list of those; got "
            f"{type(source).__name__}"
        )
    return source


def per_worker_sources(name: str, value: object, n_workers: int, n_envs: int) -> list[Any]:
    """One resolved env source (or update, ``None`` kept) per worker, or a list per env."""
    if not isinstance(value, list):
        # One source for every worker: resolved (and later pickled) once, not per worker.
        return per_worker_sources(name, [value], 1, n_envs) * n_workers
    if len(value) != n_workers:
        raise ValueError(
            f"{name}: a list must hold exactly n_workers ({n_workers}), one per worker, "
            f"got {len(value)}"
        )
    out: list[Any] = []
    for item in value:
        if isinstance(item, list):
            if len(item) != n_envs:
                raise ValueError(
                    f"{name}: a list inside the per-worker list must hold exactly "
                    f"envs_per_worker ({n_envs}), one per env, got {len(item)}"
                )
            out.append([None if x is None else env_source(name, x) for x in item])
        else:
            out.append(None if item is None else env_source(name, item))
    return out


def check_picklable(name: str, obj: object) -> None:
    """Raise ``TypeError`` naming ``name`` when cloudpickle cannot pickle ``obj``."""
    try:
        cloudpickle.dumps(obj)
    except Exception as exc:
        raise TypeError(
            f"{name} must be picklable with cloudpickle to reach the env hosts, but pickling "
            f"{obj!r} failed: {type(exc).__name__}: {exc}"
        ) from exc


#: The fixed-size leaf spaces the sampler records (as numpy arrays), nested in any ``Dict`` or
#: ``Tuple``; beside them ``Text`` and ``Sequence`` of ``Box``/``Discrete`` (as columns, see
#: :mod:`asyncsample.columns`).
RECORDABLE_SPACES: tuple[type[gym.Space[Any]], ...] = (
    gym.spaces.Box,
    gym.spaces.Discrete,
    gym.spaces.MultiDiscrete,
    gym.spaces.MultiBinary,
)


def recordable_space(name: str, space: object) -> None:
    """Refuse, naming where it is, a space the sampler cannot record (``Graph``, ``OneOf``, a
    ``Sequence`` of anything but ``Box``/``Discrete``, custom spaces), which would otherwise
    fail mid-call."""
    found = _unrecordable(name, space)
    if found is None:
        return
    path, leaf = found
    wrapper = "ActionWrapper" if name.endswith("action_space") else "ObservationWrapper"
    raise ValueError(
        f"{path} is {leaf!r} ({type(leaf).__name__}), which the sampler cannot record: it "
        "records Box, Discrete, MultiDiscrete, MultiBinary and Text spaces and Sequence spaces "
        "of Box or Discrete, nested in Dict and Tuple; wrap the env in a "
        f"gymnasium.{wrapper} that encodes it as one of these"
    )


def _subspaces(space: object) -> list[tuple[object, gym.Space[Any]]] | None:
    """``(key, subspace)`` of a ``Dict`` or ``Tuple`` space; ``None`` for a leaf space."""
    if isinstance(space, gym.spaces.Dict):
        return list(space.spaces.items())
    if isinstance(space, gym.spaces.Tuple):
        return list(enumerate(space.spaces))
    return None


def _unrecordable(path: str, space: object) -> tuple[str, object] | None:
    subspaces = _subspaces(space)
    if subspaces is None:
        recordable = isinstance(space, RECORDABLE_SPACES) or is_variable_space(space)
        return None if recordable else (path, space)
    for key, sub in subspaces:
        found = _unrecordable(f"{path}[{key!r}]", sub)
        if found is not None:
            return found
    return None


#: Memory one env and the sampler's state for it take beyond the step buffers (measured with
#: CartPole: about 7 KiB on the ``local`` backend, 12 KiB over a host process and this one).
PER_ENV_BYTES = 12 << 10
#: What a step row adds besides the observations and actions: a reward and two flags.
_ROW_EXTRA_BYTES = 10


#: The items a ``Sequence`` value is sized at for the memory check without
#: ``max_sequence_length``.
SEQUENCE_ITEMS = 1024
#: What a Python ``str`` or array object takes beyond its characters or items (a row of a
#: ``Text`` or ``Sequence`` leaf is one).
_OBJECT_BYTES = 112


def _leaf_bytes(
    space: gym.Space[Any],
    max_items: int | None = None,
    path: str = "",
    sized: list[str] | None = None,
) -> tuple[int, int]:
    """Bytes one value of a recordable ``space`` takes in a step buffer (nested spaces summed):
    ``(fixed, variable)``, ``variable`` the rows of ``Text`` and ``Sequence`` leaves (in the
    process's own memory, never in shared memory), sized from ``Text.max_length`` (4 bytes a
    character, utf-8's most) and ``max_items`` (:data:`SEQUENCE_ITEMS` if ``None``); ``sized``
    collects how each variable leaf was sized, for the error message."""
    subspaces = _subspaces(space)
    if subspaces is not None:
        parts = [_leaf_bytes(s, max_items, f"{path}[{k!r}]", sized) for k, s in subspaces]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)
    if isinstance(space, gym.spaces.Text):
        if sized is not None:
            sized.append(f"{path or 'the value'} from Text max_length={space.max_length}")
        return 0, _OBJECT_BYTES + 4 * int(space.max_length)
    if isinstance(space, gym.spaces.Sequence):
        feature = space.feature_space
        items = SEQUENCE_ITEMS if max_items is None else max_items
        item = int(math.prod(feature.shape or ())) * np.dtype(feature.dtype or np.float64).itemsize
        if sized is not None:
            how = "the default" if max_items is None else "given"
            sized.append(f"{path or 'the value'} from max_sequence_length={items} ({how})")
        return 0, _OBJECT_BYTES + items * item
    dtype = np.dtype(space.dtype if space.dtype is not None else np.float64)
    return int(math.prod(space.shape or ())) * dtype.itemsize, 0


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def memory_fits(
    observation_space: gym.Space[Any],
    action_space: gym.Space[Any],
    *,
    n_workers: int,
    envs_per_worker: int,
    chunk_steps: int,
    shared: bool,
    max_sequence_length: int | None = None,
) -> None:
    """Refuse a sampler whose envs (``PER_ENV_BYTES`` each), step buffers and, in host mode,
    chunk buffers (``chunk_steps`` rows per env) cannot fit: in /dev/shm when the buffers are
    ``shared`` (and there is one), else in the available memory. ``Text`` leaves are sized from
    their ``max_length``, ``Sequence`` leaves from ``max_sequence_length`` items (default
    :data:`SEQUENCE_ITEMS`); their rows count in ordinary memory, never in /dev/shm."""
    shm_free: int | None = None
    if shared:
        try:
            shm_free = shutil.disk_usage("/dev/shm").free
        except OSError:  # no /dev/shm (macOS): shared memory comes from ordinary memory
            shared = False
    available = psutil.virtual_memory().available
    envs = n_workers * envs_per_worker
    sized: list[str] = []
    obs_fixed, obs_var = _leaf_bytes(observation_space, max_sequence_length, "observations", sized)
    act_fixed, act_var = _leaf_bytes(action_space, max_sequence_length, "actions", sized)
    fixed_row = 2 * obs_fixed + act_fixed + _ROW_EXTRA_BYTES
    # Text/Sequence rows live in each process's own memory: the host's buffers and the caller's
    # copy, beside the fixed rows' shared ones.
    variable_row = 2 * obs_var + act_var
    row = fixed_row + variable_row
    buffers = envs * row * (1 + chunk_steps)
    ram = envs * (PER_ENV_BYTES + 2 * row)  # envs, their state, this process's copy of a row
    shm = envs * fixed_row * (1 + chunk_steps) if shared else 0
    ram += envs * variable_row * (1 + chunk_steps) if shared else buffers
    what = (
        f"n_workers={n_workers} x envs_per_worker={envs_per_worker} = {envs:,} envs "
        f"(about {_size(PER_ENV_BYTES + 2 * row)} of memory each, step"
        + (" and chunk" if chunk_steps else "")
        + f" buffers of {_size(buffers)}"
        + (f"; text and sequences sized: {', '.join(sized)}" if sized else "")
        + ")"
    )
    advice = "use fewer envs per worker or fewer workers, or free some memory"
    if sized:
        advice += " (or bound the text and sequences tighter: Text max_length, max_sequence_length)"
    if ram > available:
        raise ValueError(
            f"{what} need about {_size(ram)} of memory, but only {_size(available)} is "
            f"available: {advice}"
        )
    if shm_free is not None and shm > shm_free:
        raise ValueError(
            f"{what} need about {_size(shm)} of shared memory in /dev/shm, but only "
            f"{_size(shm_free)} is free: {advice}, or enlarge /dev/shm (docker run --shm-size)"
        )


def reset_arguments(
    n_envs: int, seeds: Any, options: Any
) -> tuple[list[int | None] | None, list[dict[str, Any] | None] | None]:
    """Check the ``seeds`` (``None`` or ``n_envs`` ints >= 0 or ``None``) and ``options`` (``None``,
    one dict, or ``n_envs`` dicts or ``None``) of a reset; one entry per env, or ``None``.

    Raises:
        TypeError, ValueError: naming the argument, what was expected and what was given.
    """
    seeds_ = seed_list("seeds", seeds, n_envs)
    option_list: list[dict[str, Any] | None] | None = None
    if options is not None:
        if isinstance(options, dict):
            option_list = [options] * n_envs
        elif isinstance(options, Sequence) and not isinstance(options, (str, bytes)):
            if len(options) != n_envs:
                raise ValueError(
                    f"options must be a dict or hold one per env ({n_envs}), got {len(options)}"
                )
            for k, item in enumerate(options):
                if item is not None and not isinstance(item, dict):
                    raise TypeError(f"options[{k}] must be a dict or None, got {item!r}")
            option_list = list(options)
        else:
            raise TypeError(
                f"options must be None, a dict or a sequence of {n_envs} dicts, got "
                f"{type(options).__name__}"
            )
    return seeds_, option_list


def call_targets(name: Any, n_envs: int, envs: Any) -> list[int]:
    """Check the arguments of a host's ``call``; the env indices (``envs=None``: every env)."""
    attr_name("name", name)
    return env_indices("envs", envs, n_envs)


def set_attr_targets(name: Any, values: Sequence[Any], n_envs: int, envs: Any) -> list[int]:
    """Check the arguments of a host's ``set_attr`` (one value per env); the indices."""
    indices = call_targets(name, n_envs, envs)
    if len(values) != len(indices):
        raise ValueError(
            f"set_attr needs one value per env ({len(indices)}), got {len(values)} values"
        )
    return indices
