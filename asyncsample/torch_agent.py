"""A torch ``nn.Module`` policy as an asyncsample agent (imported lazily: no torch needed)."""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal, cast

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from asyncsample import _validate
from asyncsample._tree import Tree, tree_leaves, tree_map

__all__ = ["TorchAgent"]

Head = Literal["categorical", "gaussian"]
SampleFn = Callable[..., tuple[Any, Mapping[str, Any]]]

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


class TorchAgent:
    """An ``nn.Module`` policy as an agent: numpy in, numpy out, no autograd graph.

    What the module returns for each head, and the agent infos, are on the *Torch policies*
    docs page. Sampling draws only from the agent's own seeded ``torch.Generator``.

    Args:
        module: the policy network, used as it is (train/eval mode is the caller's choice).
        action_space: the action space of one env; chooses the default head, the number of
            logits expected, the Discrete ``start`` offset and the bounds for clipping.
        head: ``"categorical"`` or ``"gaussian"``, overriding the default from ``action_space``.
        sample_fn: ``sample_fn(output)`` returns ``(actions, infos)`` instead of a head; it
            also gets ``generator=`` and ``deterministic=`` when it names those keywords.
        device: where to move and run the module; default: where its parameters are (or CPU).
        seed: seed of the sampling generator; ``None`` seeds it from the OS.
        clip_actions: clip Gaussian actions to a bounded ``Box`` action space.
        inference_mode: run under ``torch.inference_mode()``; ``False``: ``torch.no_grad()``,
            for a module that keeps tensors made in ``forward`` for later use with autograd.

    Raises:
        ValueError: if no head can be chosen, or ``head`` is not a known head.
        TypeError: if ``module`` is not an ``nn.Module``.
    """

    def __init__(
        self,
        module: nn.Module,
        action_space: gym.Space[Any] | None = None,
        *,
        head: Head | None = None,
        sample_fn: SampleFn | None = None,
        device: torch.device | str | None = None,
        seed: int | None = None,
        clip_actions: bool = True,
        inference_mode: bool = True,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if device is not None:
            module.to(device)
        self.module = module
        self.action_space = action_space
        self.device = torch.device(device) if device is not None else _module_device(module)
        self._float_dtype = _module_float_dtype(module)
        self._grad_off: Callable[[], Any] = (
            torch.inference_mode if inference_mode else torch.no_grad
        )
        self.sample_fn = sample_fn
        self._fn_kwargs: set[str] = set()
        if sample_fn is not None:
            self._fn_kwargs = _keywords(sample_fn, ("generator", "deterministic"))
            self.head: Head | None = None
        else:
            self.head = _choose_head(head, action_space)
        self._n_actions: int | None = None
        self._start = 0
        if isinstance(action_space, gym.spaces.Discrete):
            self._n_actions, self._start = int(action_space.n), int(action_space.start)
        self._bounds: tuple[np.ndarray, np.ndarray] | None = None
        self._action_dtype: np.dtype[Any] | None = None
        if isinstance(action_space, gym.spaces.Box):
            self._action_dtype = action_space.dtype
            if clip_actions and action_space.is_bounded("both"):
                self._bounds = (action_space.low, action_space.high)
        self.generator = torch.Generator(device=self.device)
        self.seed(seed)

    def get_actions(
        self, observations: Tree, deterministic: bool = False
    ) -> tuple[Tree, dict[str, np.ndarray]]:
        """Actions and agent infos for stacked observations (leading axis: the batch).

        Args:
            observations: a numpy array, or a dict/tuple tree of them, one row per env.
            deterministic: the most likely action (argmax, or the Gaussian's mean), not a sample.

        Raises:
            ValueError: the module's or ``sample_fn``'s output is not what the head expects.
        """
        leaves = tree_leaves(observations)
        n = len(leaves[0]) if leaves else 0
        with self._grad_off():
            output = self.module(tree_map(self._as_tensor, observations))
            if self.sample_fn is not None:
                return self._custom(output, n, deterministic)
            if self.head == "categorical":
                return self._categorical(output, n, deterministic)
            return self._gaussian(output, n, deterministic)

    def get_deterministic_actions(self, observations: Tree) -> tuple[Tree, dict[str, np.ndarray]]:
        """``get_actions(observations, deterministic=True)``."""
        return self.get_actions(observations, deterministic=True)

    def get_param_values(self) -> dict[str, np.ndarray]:
        """The module's ``state_dict`` as numpy copies on the CPU (bfloat16 as float32)."""
        return {key: _numpy(value, copy=True) for key, value in self.module.state_dict().items()}

    def set_param_values(self, params: Mapping[str, Any]) -> None:
        """Copy parameters, numpy arrays or tensors keyed like the ``state_dict``, into the module.

        Raises:
            TypeError: if ``params`` is not a mapping.
            ValueError: if keys are missing or unexpected, or a shape differs.
        """
        if not isinstance(params, Mapping):
            raise TypeError(
                "params must be a dict mapping the module's state_dict keys to numpy arrays or "
                f"tensors, got {type(params).__name__}"
            )
        own = self.module.state_dict()
        missing = [k for k in own if k not in params]
        unexpected = [k for k in params if k not in own]
        if missing or unexpected:
            raise ValueError(
                f"params must have exactly the module's state_dict keys; missing {missing}, "
                f"unexpected {unexpected}"
            )
        state: dict[str, torch.Tensor] = {}
        for key, value in params.items():
            tensor = torch.as_tensor(value)
            if tuple(tensor.shape) != tuple(own[key].shape):
                raise ValueError(
                    f"params[{key!r}] has shape {tuple(tensor.shape)}, but the module's "
                    f"{key!r} has shape {tuple(own[key].shape)}"
                )
            state[key] = tensor
        self.module.load_state_dict(state)

    def seed(self, seed: int | None = None) -> None:
        """Reseed the sampling generator (``None``: from the OS)."""
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(int(seed))

    def __repr__(self) -> str:
        how = f"sample_fn={self.sample_fn!r}" if self.sample_fn is not None else self.head
        return f"TorchAgent({type(self.module).__name__}, {how}, device={self.device})"

    def _as_tensor(self, array: Any) -> torch.Tensor:
        """One observation leaf on the device, floats in the module's dtype; shared if it can be."""
        if not isinstance(array, np.ndarray):
            tensor = torch.as_tensor(array, device=self.device)
            return tensor.to(self._float_dtype) if tensor.is_floating_point() else tensor
        if array.dtype.kind == "f":
            np_dtype = _NUMPY_DTYPES.get(self._float_dtype)
            if np_dtype is None:  # e.g. bfloat16, which numpy lacks: let torch convert
                return torch.as_tensor(array).to(self.device, self._float_dtype)
            if array.dtype != np_dtype:
                return torch.as_tensor(array.astype(np_dtype), device=self.device)
        if not array.flags.writeable and self.device.type == "cpu":
            array = array.copy()
        return torch.as_tensor(array, device=self.device)

    def _categorical(
        self, output: Any, n: int, deterministic: bool
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        logits, value = _unpack(output, ("logits", "value"), "categorical")
        logits = _check_tensor(logits, "logits", "categorical")
        if logits.ndim != 2 or logits.shape[0] != n:
            raise ValueError(
                f"the categorical head expects logits of shape (batch={n}, n_actions), got "
                f"shape {tuple(logits.shape)}"
            )
        if self._n_actions is not None and logits.shape[1] != self._n_actions:
            raise ValueError(
                f"the categorical head expects {self._n_actions} logits per row (the Discrete "
                f"action space), got shape {tuple(logits.shape)}"
            )
        logp_all = torch.log_softmax(logits, dim=-1)
        if deterministic:
            actions = logp_all.argmax(dim=-1)
        else:
            actions = torch.multinomial(logp_all.exp(), 1, generator=self.generator)[:, 0]
        infos = {"logp": _numpy(logp_all.gather(1, actions[:, None])[:, 0])}
        _add_value(infos, value, n)
        out = _numpy(actions)
        return (out + self._start if self._start else out), infos

    def _gaussian(
        self, output: Any, n: int, deterministic: bool
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        mean, log_std, value = _unpack(output, ("mean", "log_std", "value"), "gaussian")
        mean = _check_tensor(mean, "mean", "gaussian")
        if mean.ndim < 2 or mean.shape[0] != n:
            raise ValueError(
                f"the gaussian head expects a mean of shape (batch={n}, *action_shape), got "
                f"shape {tuple(mean.shape)}"
            )
        shape = getattr(self.action_space, "shape", None)
        if shape is not None and tuple(mean.shape[1:]) != tuple(shape):
            raise ValueError(
                f"the gaussian head expects a mean of shape (batch={n}, *{tuple(shape)}) (the "
                f"action space), got shape {tuple(mean.shape)}"
            )
        if log_std is None:
            log_std = getattr(self.module, "log_std", None)
            if log_std is None:
                raise ValueError(
                    "the gaussian head needs a log-std: return (mean, log_std), a dict with "
                    "'log_std', or give the module a log_std parameter"
                )
        log_std = _check_tensor(log_std, "log_std", "gaussian")
        try:
            log_std = log_std.expand_as(mean)
        except RuntimeError:
            raise ValueError(
                f"the gaussian head expects a log_std broadcastable to the mean's shape "
                f"{tuple(mean.shape)}, got shape {tuple(log_std.shape)}"
            ) from None
        dims = tuple(range(1, mean.ndim))
        if deterministic:
            actions = mean
            logp = (-log_std - _LOG_SQRT_2PI).sum(dim=dims)
        else:
            noise = torch.randn(
                mean.shape, generator=self.generator, device=mean.device, dtype=mean.dtype
            )
            actions = mean + log_std.exp() * noise
            logp = (-0.5 * noise * noise - log_std - _LOG_SQRT_2PI).sum(dim=dims)
        infos = {"logp": _numpy(logp), "mean": _numpy(mean), "log_std": _numpy(log_std)}
        _add_value(infos, value, n)
        out = _numpy(actions)
        if self._action_dtype is not None and out.dtype != self._action_dtype:
            out = out.astype(self._action_dtype)
        if self._bounds is not None:
            out = np.clip(out, *self._bounds, out=out if out.flags.writeable else None)
        return out, infos

    def _custom(
        self, output: Any, n: int, deterministic: bool
    ) -> tuple[Tree, dict[str, np.ndarray]]:
        assert self.sample_fn is not None
        if deterministic and "deterministic" not in self._fn_kwargs:
            raise ValueError(
                "deterministic actions need a sample_fn that takes a 'deterministic' keyword; "
                f"{self.sample_fn!r} does not (evaluate with deterministic=False instead)"
            )
        given = {"generator": self.generator, "deterministic": deterministic}
        result = self.sample_fn(output, **{k: v for k, v in given.items() if k in self._fn_kwargs})
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping)):
            raise ValueError(
                "sample_fn must return a pair (actions, infos) with infos a dict, got "
                f"{type(result).__name__}"
            )
        actions = tree_map(_numpy_leaf, result[0])
        for leaf in tree_leaves(actions):
            if np.ndim(leaf) == 0 or len(leaf) != n:
                raise ValueError(
                    f"sample_fn must return one action per observation ({n}), got an action "
                    f"leaf of shape {np.shape(leaf)}"
                )
        infos: dict[str, np.ndarray] = {}
        for key, value in result[1].items():
            info = _numpy_leaf(value)
            if info.ndim == 0 or len(info) != n:
                raise ValueError(
                    f"sample_fn must return infos with one row per observation ({n}); "
                    f"infos[{key!r}] has shape {info.shape}"
                )
            infos[key] = info
        return actions, infos


_NUMPY_DTYPES: dict[torch.dtype, Any] = {
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
}


def _module_device(module: nn.Module) -> torch.device:
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return torch.device("cpu") if first is None else first.device


def _module_float_dtype(module: nn.Module) -> torch.dtype:
    return next((t.dtype for t in module.parameters() if t.is_floating_point()), torch.float32)


def _keywords(fn: Callable[..., Any], names: tuple[str, ...]) -> set[str]:
    """Which of ``names`` ``fn`` accepts as keywords."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return set(names)
    return {
        name
        for name in names
        if name in params and params[name].kind is not inspect.Parameter.POSITIONAL_ONLY
    }


def _choose_head(head: str | None, action_space: gym.Space[Any] | None) -> Head:
    if head is not None:
        return cast(Head, _validate.choice("head", head, ("categorical", "gaussian")))
    if isinstance(action_space, gym.spaces.Discrete):
        return "categorical"
    if isinstance(action_space, gym.spaces.Box):
        return "gaussian"
    raise ValueError(
        "TorchAgent needs a head: give a Discrete or Box action_space, head='categorical' or "
        f"'gaussian', or a sample_fn; got action_space {action_space!r}"
    )


def _unpack(output: Any, names: tuple[str, ...], head: str) -> list[Any]:
    """The head's fields from a tensor (the first field), a tuple or a dict."""
    if isinstance(output, torch.Tensor):
        return [output] + [None] * (len(names) - 1)
    if isinstance(output, Mapping):
        if names[0] not in output:
            raise ValueError(
                f"the {head} head expects a dict output with key {names[0]!r}, got keys "
                f"{sorted(output)}"
            )
        return [output.get(name) for name in names]
    if isinstance(output, (tuple, list)):
        if not 1 <= len(output) <= len(names):
            raise ValueError(
                f"the {head} head expects the module to return a tensor or a tuple "
                f"({', '.join(names)}) of 1 to {len(names)} items, got {len(output)} items"
            )
        return list(output) + [None] * (len(names) - len(output))
    raise ValueError(
        f"the {head} head expects the module to return a tensor, a tuple or a dict, got "
        f"{type(output).__name__}"
    )


def _check_tensor(value: Any, name: str, head: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        got = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"the {head} head expects {name} as a floating-point tensor, got {got}")
    return value


def _add_value(infos: dict[str, np.ndarray], value: Any, n: int) -> None:
    """Put the module's value estimate, shape ``(n,)`` or ``(n, 1)``, into ``infos``."""
    if value is None:
        return
    if not isinstance(value, torch.Tensor) or not (value.shape == (n,) or value.shape == (n, 1)):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"the module's value must be a tensor of shape ({n},) or ({n}, 1), got {got}"
        )
    infos["value"] = _numpy(value.reshape(n))


def _numpy(tensor: torch.Tensor, copy: bool = False) -> np.ndarray:
    """A CPU numpy view (or copy) of ``tensor``; dtypes numpy lacks (bfloat16) become float32."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()
    return tensor.detach().to("cpu", copy=copy).numpy()


def _numpy_leaf(value: Any) -> np.ndarray:
    return _numpy(value) if isinstance(value, torch.Tensor) else np.asarray(value)
