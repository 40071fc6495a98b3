"""asyncsample: collect reinforcement-learning experience with asyncio.

Worker coroutines await env steps hosted in a pool of env-host processes (or in the main process,
or in Ray actors) and gather complete episodes or fragments until a quota is met. The API follows
garage's sampler package.
"""

from asyncsample._tree import Tree
from asyncsample.agent import Agent, AgentOutput, AgentParams, AgentUpdate, RandomAgent
from asyncsample.batch import EnvSpec, EpisodeBatch, StepType
from asyncsample.env_update import EnvChoice, EnvSource, EnvUpdate, NewEnvUpdate, SetTaskUpdate
from asyncsample.errors import (
    AsyncSampleError,
    SamplerClosedError,
    StepTimeoutError,
    WorkerCrashedError,
    WorkerError,
)
from asyncsample.evaluation import Evaluation
from asyncsample.sampler import AgentUpdateArg, EnvUpdateArg, Sampler
from asyncsample.stats import SampleStats
from asyncsample.worker import FragmentWorker, Transition, VecWorker, Worker, WorkerFactory

__version__ = "0.1.0"

__all__ = [
    "Agent",
    "AgentOutput",
    "AgentParams",
    "AgentUpdate",
    "AgentUpdateArg",
    "AsyncSampleError",
    "EnvChoice",
    "EnvSource",
    "EnvSpec",
    "EnvUpdate",
    "EnvUpdateArg",
    "EpisodeBatch",
    "Evaluation",
    "FragmentWorker",
    "NewEnvUpdate",
    "RandomAgent",
    "SampleStats",
    "Sampler",
    "SamplerClosedError",
    "SetTaskUpdate",
    "StepTimeoutError",
    "StepType",
    "Transition",
    "Tree",
    "VecWorker",
    "Worker",
    "WorkerCrashedError",
    "WorkerError",
    "WorkerFactory",
]
