"""TorchRL's collectors as peers of the policy study, driving the same MLP as a TensorDictModule.

The MLP of :mod:`benchmarks.policies` (64x64 tanh, stochastic head, one torch thread in the
process that builds it) is wrapped as a ``TensorDictModule`` reading ``"observation"`` and
writing ``"action"``; envs are ``GymEnv`` (integer actions for ``Discrete`` spaces). Each call
collects 128 steps per env (``frames_per_batch = n_envs * fragment_steps``), the layouts a
TorchRL user picks on a 2-core machine:

- ``torchrl-collector``: ``Collector`` over a ``SerialEnv(n_envs)``, all in the main process;
- ``torchrl-multisync`` / ``torchrl-multiasync``: ``MultiSyncCollector`` /
  ``MultiAsyncCollector`` with ``cores`` workers, each a ``SerialEnv(n_envs / cores)`` with its
  own copy of the policy;
- ``torchrl-asyncbatched``: ``AsyncBatchedCollector``, ``n_envs`` envs in an env pool of
  processes and an inference server in the main process (the nearest thing to our
  ``batched`` mode).

torchrl is optional (the ``bench`` extra): without it these contenders are skipped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.runs import RunResult, RunSpec

# benchmarks.contenders imports this module at its end: it is imported here only where it is
# used, so that a collector's worker process, which unpickles make_serial/make_module and so
# imports this module first, does not meet the cycle half-way.

__all__ = ["TORCHRL_CONTENDERS"]


def _require() -> None:
    from benchmarks.runs import Skipped

    try:
        import tensordict  # noqa: F401
        import torchrl  # noqa: F401
    except Exception as exc:
        raise Skipped(
            f"torchrl not importable ({type(exc).__name__}: {exc}); "
            "pip install 'asyncsample[bench]'"
        ) from exc


def make_env(env_id: str) -> Any:
    """A TorchRL ``GymEnv`` of ``env_id`` (integer actions for discrete spaces)."""
    from torchrl.envs import GymEnv

    return GymEnv(env_id, categorical_action_encoding=True)


def make_serial(env_id: str, n_envs: int) -> Any:
    """A ``SerialEnv`` of ``n_envs`` copies of ``env_id``."""
    from torchrl.envs import SerialEnv

    return SerialEnv(n_envs, functools.partial(make_env, env_id))


def make_module(policy: str, env_id: str, seed: int = 0) -> Any:
    """The policy workload's MLP as a ``TensorDictModule`` (``observation`` -> ``action``)."""
    import torch
    from tensordict.nn import TensorDictModule

    from benchmarks.policies import make_policy

    agent = make_policy(policy, env_id, seed=seed)  # sets one torch thread, as a user does

    class Actor(torch.nn.Module):
        """Samples an action from the MLP's distribution (the agent's own ``act``)."""

        def __init__(self) -> None:
            super().__init__()
            self.net = agent.net

        def forward(self, observation: torch.Tensor) -> torch.Tensor:
            batch = observation.shape[:-1]
            actions = agent.act(observation.reshape(-1, observation.shape[-1]).numpy())
            return torch.as_tensor(actions).reshape(*batch, *actions.shape[1:])

    return TensorDictModule(Actor(), in_keys=["observation"], out_keys=["action"])


def _collect(spec: RunSpec, collector: Any, label: str) -> RunResult:
    """Iterate ``collector``: warm-up batches untimed, then time at least ``n_transitions``."""
    from benchmarks.runs import TimedPhase

    try:
        batches = iter(collector)
        warm = 0
        while warm < spec.warmup:
            warm += next(batches).numel()
        done = 0
        with TimedPhase(spec) as phase:
            while phase.more(done):
                done += next(batches).numel()
        return phase.result(done, notes=[label])
    finally:
        collector.shutdown()


def _workers(spec: RunSpec) -> tuple[int, int]:
    """(workers, envs per worker): ``cores`` workers sharing ``n_envs``."""
    workers = max(1, min(spec.cores, spec.n_envs))
    return workers, max(1, spec.n_envs // workers)


def _policy_factory(spec: RunSpec) -> Callable[[], Any]:
    return functools.partial(make_module, spec.policy, spec.env_id, spec.seed)


def torchrl_collector(spec: RunSpec) -> RunResult:
    """``Collector`` over ``SerialEnv(n_envs)`` in this process."""
    _require()
    from torchrl.collectors import Collector

    collector = Collector(
        make_serial(spec.env_id, spec.n_envs),
        make_module(spec.policy, spec.env_id, spec.seed),
        frames_per_batch=spec.n_envs * spec.fragment_steps,
        total_frames=-1,
    )
    return _collect(spec, collector, f"Collector(SerialEnv({spec.n_envs}))")


def _multi(spec: RunSpec, cls_name: str) -> RunResult:
    _require()
    import torchrl.collectors

    cls = getattr(torchrl.collectors, cls_name)
    workers, per = _workers(spec)
    frames = per * spec.fragment_steps
    collector = cls(
        [functools.partial(make_serial, spec.env_id, per)] * workers,
        policy_factory=_policy_factory(spec),
        # MultiSync gathers one batch from all workers; MultiAsync hands one worker's batch.
        frames_per_batch=frames * workers if cls_name == "MultiSyncCollector" else frames,
        total_frames=-1,
    )
    return _collect(spec, collector, f"{cls_name}: {workers} workers x SerialEnv({per})")


def torchrl_multisync(spec: RunSpec) -> RunResult:
    """``MultiSyncCollector``: ``cores`` workers of ``SerialEnv(n_envs / cores)`` + the policy."""
    return _multi(spec, "MultiSyncCollector")


def torchrl_multiasync(spec: RunSpec) -> RunResult:
    """``MultiAsyncCollector``: ``cores`` workers of ``SerialEnv(n_envs / cores)`` + the policy."""
    return _multi(spec, "MultiAsyncCollector")


def torchrl_asyncbatched(spec: RunSpec) -> RunResult:
    """``AsyncBatchedCollector``: an env pool of processes and an inference server."""
    _require()
    from torchrl.collectors import AsyncBatchedCollector

    collector = AsyncBatchedCollector(
        [functools.partial(make_env, spec.env_id)] * spec.n_envs,
        policy_factory=_policy_factory(spec),
        frames_per_batch=spec.n_envs * spec.fragment_steps,
        total_frames=-1,
        env_backend="multiprocessing",
    )
    return _collect(spec, collector, f"AsyncBatchedCollector({spec.n_envs} envs, processes)")


#: Contender key -> (function, human label), merged into :data:`benchmarks.contenders.CONTENDERS`.
TORCHRL_CONTENDERS: dict[str, tuple[Callable[[RunSpec], RunResult], str]] = {
    "torchrl-collector": (torchrl_collector, "TorchRL Collector (SerialEnv)"),
    "torchrl-multisync": (torchrl_multisync, "TorchRL MultiSyncCollector"),
    "torchrl-multiasync": (torchrl_multiasync, "TorchRL MultiAsyncCollector"),
    "torchrl-asyncbatched": (torchrl_asyncbatched, "TorchRL AsyncBatchedCollector"),
}
