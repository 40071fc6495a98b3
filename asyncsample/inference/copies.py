"""The env hosts' copies of your agent when ``inference="auto"`` puts them there.

:func:`host_fit` says whether copies in the hosts can stand for the agent in your process: it
must be synchronous, picklable, on the CPU, small enough to copy once per worker, and expose its
parameters (``get_param_values`` / ``set_param_values``, garage's policy protocol, which
:class:`~asyncsample.TorchAgent` follows). :class:`Follower` keeps the copies equal to it: a
trainer that changes the agent in place (``optimizer.step()``) and passes no ``agent_update``
gets the changed parameters in the hosts from the next call on, as it would with the agent in
its process.
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import cloudpickle
import numpy as np

from asyncsample.inference.host import check_host_agent

__all__ = ["COPIES_BUDGET", "Follower", "Unfit", "digest", "follows", "host_fit"]

#: The most memory (pickled bytes) the hosts' copies of one agent may take together for
#: ``inference="auto"`` to put them there: one copy per worker.
COPIES_BUDGET = 1 << 30


class Unfit(NamedTuple):
    """Why the agent stays in the caller, and whether one merged call (``"batched"``) suits it
    (an agent on an accelerator, or too big to copy per worker)."""

    reason: str
    merge: bool = False


def host_fit(agent: Any, copies: int) -> Unfit | None:
    """``None`` when ``copies`` copies of ``agent`` in the env hosts can stand for it, else why
    not (for :func:`~asyncsample.inference.choose_inference`)."""
    name = f"your agent ({type(agent).__name__})"
    try:
        check_host_agent(agent)
    except ValueError:
        return Unfit(f"{name} is async: the env hosts run no event loop")
    if not follows(agent):
        return Unfit(
            f"{name} has no get_param_values and set_param_values, by which copies in the env "
            "hosts would follow its changes"
        )
    device = _accelerator(agent)
    if device is not None:
        return Unfit(f"{name} is on {device}, which the env hosts do not share", merge=True)
    try:
        size = len(cloudpickle.dumps(agent, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as exc:
        return Unfit(f"{name} cannot be pickled for the env hosts ({type(exc).__name__}: {exc})")
    if size * copies > COPIES_BUDGET:
        mib = size / (1 << 20)
        return Unfit(f"{name} takes {mib:.0f} MiB: {copies} copies in the env hosts", merge=True)
    return None


def follows(agent: Any) -> bool:
    """Whether copies of ``agent`` can follow it: it has ``get_param_values`` and
    ``set_param_values``."""
    return all(callable(getattr(agent, m, None)) for m in ("get_param_values", "set_param_values"))


def _accelerator(agent: Any) -> str | None:
    """The device of ``agent`` (its ``device``, else its torch modules' first parameter), when
    it is not the CPU."""
    device = getattr(agent, "device", None)
    if device is not None and not str(device).startswith("cpu"):
        return str(device)
    torch = sys.modules.get("torch")
    if torch is None:  # no torch module can be loaded: importing it is not our call
        return None
    values = [agent, *getattr(agent, "__dict__", {}).values()]
    for module in (v for v in values if isinstance(v, torch.nn.Module)):
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if tensor.device.type != "cpu":
                return str(tensor.device)
            break
    return None


def digest(value: Any) -> bytes:
    """A fingerprint of a parameter set: equal for equal values. (Pickles of torch tensors are
    not: their storages get new keys each time.)"""
    h = hashlib.blake2b(digest_size=16)
    _feed(h, value)
    return h.digest()


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, dict):
        h.update(b"{%d" % len(value))
        for key in sorted(value, key=repr):
            h.update(repr(key).encode())
            _feed(h, value[key])
    elif isinstance(value, (list, tuple)):
        h.update(b"[%d" % len(value))
        for item in value:
            _feed(h, item)
    elif isinstance(value, np.ndarray):
        h.update(f"{value.dtype.str}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).view(np.uint8).data)
    elif hasattr(value, "detach") and hasattr(value, "untyped_storage"):  # a torch tensor
        torch = sys.modules["torch"]
        tensor = value.detach().cpu().contiguous()
        h.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        h.update(tensor.flatten().view(torch.uint8).numpy().data)
    else:
        h.update(cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


@dataclass
class Follower:
    """The fingerprints of the parameters last sent to the hosts, per agent (by ``id``).

    ``changed(agent)`` reads the agent's parameters: ``None`` when the hosts have them already,
    else the parameters to send (which it then takes as sent).
    """

    sent: dict[int, bytes] = field(default_factory=dict)

    def remember(self, agent: Any) -> None:
        """The hosts now hold ``agent`` as it is (it was installed or updated there)."""
        self.sent[id(agent)] = digest(agent.get_param_values())

    def changed(self, agent: Any) -> Any:
        params = agent.get_param_values()
        mark = digest(params)
        if self.sent.get(id(agent)) == mark:
            return None
        self.sent[id(agent)] = mark
        return params
