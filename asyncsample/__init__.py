"""asyncsample: collect reinforcement-learning experience with asyncio.

Worker coroutines await env steps (in processes, Ray actors, the main process, the event loop or
threads) and gather episodes or fragments until a quota is met; the API follows garage's sampler.
"""

from typing import Any

from asyncsample._tree import Tree
from asyncsample.agent import Agent, AgentOutput, AgentParams, AgentUpdate, RandomAgent
from asyncsample.async_env import (
    AsyncEnv,
    AsyncRecordEpisodeStatistics,
    AsyncTimeLimit,
    AsyncWrapper,
    is_async_env,
)
from asyncsample.batch import EnvSpec, EpisodeBatch, StepType
from asyncsample.checkpoint import Replayable, ResumeReport, SamplerState, SnapshotEnv
from asyncsample.columns import RaggedArray
from asyncsample.env_update import EnvChoice, EnvSource, EnvUpdate, NewEnvUpdate, SetTaskUpdate
from asyncsample.errors import (
    AgentRowsError,
    AsyncSampleError,
    ChatRequestError,
    ChatTimeoutError,
    CheckpointError,
    LoopBlockedError,
    SamplerBusyError,
    SamplerClosedError,
    StepTimeoutError,
    WorkerCrashedError,
    WorkerError,
)
from asyncsample.evaluation import Evaluation
from asyncsample.inference import Batched, Host, InferenceChoice
from asyncsample.metrics import SamplerMetrics
from asyncsample.multiagent import MultiAgentBatch, PolicyAgents
from asyncsample.sampler import AgentUpdateArg, EnvUpdateArg, Sampler
from asyncsample.stats import SampleStats
from asyncsample.vector import SubEnvAttributeError, SubEnvError, VectorEnv
from asyncsample.worker import FragmentWorker, Transition, VecWorker, Worker, WorkerFactory

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``TorchAgent``, imported on first use (and not in ``__all__``): no torch needed."""
    if name == "TorchAgent":
        from asyncsample.torch_agent import TorchAgent

        return TorchAgent
    raise AttributeError(f"module 'asyncsample' has no attribute {name!r}")


__all__ = [
    "Agent",
    "AgentOutput",
    "AgentParams",
    "AgentRowsError",
    "AgentUpdate",
    "AgentUpdateArg",
    "AsyncEnv",
    "AsyncRecordEpisodeStatistics",
    "AsyncSampleError",
    "AsyncTimeLimit",
    "AsyncWrapper",
    "Batched",
    "ChatRequestError",
    "ChatTimeoutError",
    "CheckpointError",
    "EnvChoice",
    "EnvSource",
    "EnvSpec",
    "EnvUpdate",
    "EnvUpdateArg",
    "EpisodeBatch",
    "Evaluation",
    "FragmentWorker",
    "Host",
    "InferenceChoice",
    "LoopBlockedError",
    "MultiAgentBatch",
    "NewEnvUpdate",
    "PolicyAgents",
    "RaggedArray",
    "RandomAgent",
    "Replayable",
    "ResumeReport",
    "SampleStats",
    "Sampler",
    "SamplerBusyError",
    "SamplerClosedError",
    "SamplerMetrics",
    "SamplerState",
    "SetTaskUpdate",
    "SnapshotEnv",
    "StepTimeoutError",
    "StepType",
    "SubEnvAttributeError",
    "SubEnvError",
    "Transition",
    "Tree",
    "VecWorker",
    "VectorEnv",
    "Worker",
    "WorkerCrashedError",
    "WorkerError",
    "WorkerFactory",
    "is_async_env",
]
