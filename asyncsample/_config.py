"""``Sampler(...)``'s arguments gathered for the core (documented in the public signature)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncsample.agent import Agent
from asyncsample.env_update import EnvSource
from asyncsample.inference import Batched, Host
from asyncsample.worker import Worker

__all__ = ["SamplerConfig"]


@dataclass(frozen=True)
class SamplerConfig:
    """``Sampler(...)``'s arguments as given (unchecked; see :class:`~asyncsample.Sampler`)."""

    env: EnvSource | list[Any]
    agent: Agent | list[Agent] | None
    n_workers: int
    envs_per_worker: int
    n_processes: int | None
    max_episode_length: int | None
    seed: int | None
    backend: str
    step_timeout: float | None
    max_restarts: int
    worker_class: type[Worker]
    worker_args: dict[str, Any] | None
    backend_options: dict[str, Any] | None
    test_env: EnvSource | None
    inference: str | Batched | Host
    host_threads: int | None
    max_concurrency: int | None
    max_sequence_length: int | None
    episode_timeout: float | None
    close_timeout: float
    metrics: Any
    resume: Any
    fixed_shares: bool
    policy_mapping: Any = None
