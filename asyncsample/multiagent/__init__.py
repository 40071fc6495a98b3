"""Multi-agent envs as rows: PettingZoo ``ParallelEnv`` and its async twin (work in progress).

What is here is the input layer and the reference of multi-agent sampling, not yet the
sampler's support (``docs/multiagent.md`` is the design):

* :mod:`~asyncsample.multiagent.protocols`: the shapes of a ParallelEnv and its async twin;
* :mod:`~asyncsample.multiagent.checks`: telling them apart, checking an env or factory;
* :mod:`~asyncsample.multiagent.adapters`: a blocking env as the async twin, and back;
* :mod:`~asyncsample.multiagent.policies`: the agent -> policy mapping;
* :mod:`~asyncsample.multiagent.rows` and :mod:`~asyncsample.multiagent.tracker`: joint steps
  into per-agent rows, grouped by policy, with each agent's segment;
* :mod:`~asyncsample.multiagent.reference`: the plain loop every backend is to equal;
* :mod:`~asyncsample.multiagent.testing`: envs whose agents die and join at known steps.

PettingZoo itself is optional (``pip install 'asyncsample[multiagent]'``): nothing here imports
it.
"""

from asyncsample.multiagent.adapters import (
    AsyncParallelAdapter,
    BlockingParallelAdapter,
    as_async_parallel_env,
)
from asyncsample.multiagent.checks import (
    ParallelEnvSpec,
    check_parallel_env,
    check_parallel_env_factory,
    is_async_parallel_env,
    is_parallel_env,
)
from asyncsample.multiagent.joint import MultiAgentBatch, split_joint
from asyncsample.multiagent.policies import (
    DEFAULT_POLICY,
    PolicyGroups,
    PolicyMapping,
    group_policies,
)
from asyncsample.multiagent.protocols import (
    AgentID,
    AsyncParallelEnv,
    JointReset,
    JointStep,
    ParallelEnvLike,
    PolicyID,
)
from asyncsample.multiagent.reference import (
    RandomActions,
    Rollout,
    Turn,
    areference_rollout,
    reference_rollout,
)
from asyncsample.multiagent.routing import PolicyAgents
from asyncsample.multiagent.rows import AgentRows, RowKey
from asyncsample.multiagent.slots import AsyncSlotEnv, SlotEnv, SlotSpace, as_slot_env
from asyncsample.multiagent.tracker import (
    ActRequest,
    JointTransition,
    RowTracker,
    StepOutcome,
    action_mask_of,
)

__all__ = [
    "ActRequest",
    "AgentID",
    "AgentRows",
    "AsyncParallelAdapter",
    "AsyncParallelEnv",
    "AsyncSlotEnv",
    "BlockingParallelAdapter",
    "DEFAULT_POLICY",
    "JointReset",
    "JointStep",
    "JointTransition",
    "MultiAgentBatch",
    "ParallelEnvLike",
    "ParallelEnvSpec",
    "PolicyAgents",
    "PolicyGroups",
    "PolicyID",
    "PolicyMapping",
    "RandomActions",
    "Rollout",
    "RowKey",
    "RowTracker",
    "SlotEnv",
    "SlotSpace",
    "StepOutcome",
    "Turn",
    "action_mask_of",
    "areference_rollout",
    "as_async_parallel_env",
    "as_slot_env",
    "check_parallel_env",
    "check_parallel_env_factory",
    "group_policies",
    "is_async_parallel_env",
    "is_parallel_env",
    "reference_rollout",
    "split_joint",
]
