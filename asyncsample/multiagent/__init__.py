"""Multi-agent envs as rows: PettingZoo ``ParallelEnv`` and its async twin.

``Sampler`` takes a factory of either on every backend (``docs/multiagent.md``); this
subpackage is how:

* :mod:`~asyncsample.multiagent.protocols`: the shapes of a ParallelEnv and its async twin;
* :mod:`~asyncsample.multiagent.checks`: telling them apart, checking an env or factory;
* :mod:`~asyncsample.multiagent.adapters`: a blocking env as the async twin, and back;
* :mod:`~asyncsample.multiagent.slots`: a multi-agent env as one env of fixed agent slots,
  which is how every backend steps it;
* :mod:`~asyncsample.multiagent.joint` and :mod:`~asyncsample.multiagent.sampling`: the
  sampler's joint steps split into agent rows per policy, with quotas that count rows;
* :mod:`~asyncsample.multiagent.routing`: a policy's agent per group of agents;
* :mod:`~asyncsample.multiagent.blocks`: reused memory for the rows' big columns;
* :mod:`~asyncsample.multiagent.policies`: the agent -> policy mapping;
* :mod:`~asyncsample.multiagent.rows` and :mod:`~asyncsample.multiagent.tracker`: per-agent
  rows and the rules of agents as rows, step by step (the reference's form);
* :mod:`~asyncsample.multiagent.reference`: the plain loop every backend equals;
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
