"""TorchAgent: an nn.Module policy as an agent (heads, tensors, params, determinism, seeding)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

# Slow as a whole: torch's import (about 3 s) would be paid by every pytest-xdist worker of the
# default run, for tests that take 0.3 s (tests/conftest.py, WHOLLY_SLOW_MODULES).
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from asyncsample import Agent, Sampler  # noqa: E402
from asyncsample.torch_agent import TorchAgent  # noqa: E402

DISCRETE = gym.spaces.Discrete(3)
BOX = gym.spaces.Box(-1.0, 1.0, (2,), dtype=np.float32)


class Categorical(nn.Module):
    """Logits (and optionally a value) from a linear layer."""

    def __init__(self, n_in: int = 4, n_actions: int = 3, value: bool = False) -> None:
        super().__init__()
        self.pi = nn.Linear(n_in, n_actions)
        self.v = nn.Linear(n_in, 1) if value else None

    def forward(self, x: Any) -> Any:
        if self.v is None:
            return self.pi(x)
        return self.pi(x), self.v(x)


class Gaussian(nn.Module):
    """A mean from a linear layer; the log-std is a parameter or part of the output."""

    def __init__(self, n_in: int = 4, n_act: int = 2, std_output: bool = False) -> None:
        super().__init__()
        self.mu = nn.Linear(n_in, n_act)
        self.std_output = std_output
        if std_output:
            self.ls = nn.Linear(n_in, n_act)
        else:
            self.log_std = nn.Parameter(torch.full((n_act,), -0.5))

    def forward(self, x: Any) -> Any:
        if self.std_output:
            return {"mean": self.mu(x), "log_std": self.ls(x), "value": x.sum(-1)}
        return self.mu(x)


class Biased(nn.Module):
    """Logits that ignore the observation: only the bias matters (CartPole: 2 actions)."""

    def __init__(self, bias: tuple[float, float]) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.tensor(bias))

    def forward(self, x: Any) -> Any:
        return self.bias.expand(len(x), 2) + 0.0 * x[:, :1]


class DictObs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(1, 2)

    def forward(self, obs: dict[str, Any]) -> Any:
        return self.a(obs["pos"]) + self.b(obs["vel"][0])


def obs(n: int = 5, d: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)


def test_categorical_shapes_dtypes_and_log_probs() -> None:
    agent = TorchAgent(Categorical(value=True), DISCRETE, seed=0)
    actions, infos = agent.get_actions(obs())
    assert actions.shape == (5,) and actions.dtype == np.int64
    assert set(actions.tolist()) <= {0, 1, 2}
    assert set(infos) == {"logp", "value"}
    assert infos["logp"].shape == (5,) and infos["value"].shape == (5,)
    with torch.no_grad():
        logits, value = agent.module(torch.as_tensor(obs()))
        expected = torch.distributions.Categorical(logits=logits).log_prob(torch.as_tensor(actions))
    np.testing.assert_allclose(infos["logp"], expected.numpy(), rtol=1e-5)
    np.testing.assert_allclose(infos["value"], value[:, 0].numpy(), rtol=1e-6)


def test_categorical_samples_follow_the_probabilities() -> None:
    module = Biased((0.0, float(np.log(3.0))))  # P(action 1) = 0.75
    agent = TorchAgent(module, gym.spaces.Discrete(2), seed=1)
    actions, _ = agent.get_actions(np.zeros((20000, 4), np.float32))
    assert abs(actions.mean() - 0.75) < 0.02


def test_discrete_start_offsets_the_actions() -> None:
    agent = TorchAgent(Categorical(), gym.spaces.Discrete(3, start=5), seed=0)
    actions, _ = agent.get_actions(obs(50))
    assert set(actions.tolist()) <= {5, 6, 7} and len(set(actions.tolist())) > 1


def test_gaussian_with_log_std_parameter() -> None:
    space = gym.spaces.Box(-np.inf, np.inf, (2,), dtype=np.float32)
    agent = TorchAgent(Gaussian(), space, seed=0)
    actions, infos = agent.get_actions(obs())
    assert actions.shape == (5, 2) and actions.dtype == np.float32
    assert set(infos) == {"logp", "mean", "log_std"}
    assert infos["mean"].shape == (5, 2) and infos["log_std"].shape == (5, 2)
    np.testing.assert_allclose(infos["log_std"], -0.5)
    normal = torch.distributions.Normal(
        torch.as_tensor(infos["mean"]), torch.as_tensor(infos["log_std"]).exp()
    )
    expected = normal.log_prob(torch.as_tensor(actions)).sum(-1)
    np.testing.assert_allclose(infos["logp"], expected.numpy(), rtol=1e-5)


def test_gaussian_log_std_from_the_output_and_value() -> None:
    agent = TorchAgent(Gaussian(std_output=True), BOX, seed=0)
    actions, infos = agent.get_actions(obs())
    assert set(infos) == {"logp", "mean", "log_std", "value"}
    np.testing.assert_allclose(infos["value"], obs().sum(-1), rtol=1e-5)
    assert actions.shape == (5, 2)


def test_gaussian_actions_are_clipped_to_the_box() -> None:
    module = Gaussian()
    with torch.no_grad():
        module.mu.bias.fill_(5.0)  # far outside [-1, 1]
    clipped = TorchAgent(module, BOX, seed=0).get_actions(obs())[0]
    assert clipped.min() >= -1.0 and clipped.max() <= 1.0
    np.testing.assert_array_equal(clipped, 1.0)
    raw = TorchAgent(module, BOX, seed=0, clip_actions=False).get_actions(obs())[0]
    assert raw.max() > 1.0


def test_deterministic_actions() -> None:
    agent = TorchAgent(Categorical(), DISCRETE, seed=0)
    actions, _ = agent.get_actions(obs(), deterministic=True)
    with torch.no_grad():
        np.testing.assert_array_equal(
            actions, agent.module(torch.as_tensor(obs())).argmax(-1).numpy()
        )
    same, _ = agent.get_deterministic_actions(obs())
    np.testing.assert_array_equal(actions, same)

    space = gym.spaces.Box(-10.0, 10.0, (2,), dtype=np.float32)
    gauss = TorchAgent(Gaussian(), space, seed=0)
    mean_actions, g_infos = gauss.get_actions(obs(), deterministic=True)
    np.testing.assert_allclose(mean_actions, g_infos["mean"])


def test_custom_sample_function_gets_generator_and_deterministic() -> None:
    seen: dict[str, Any] = {}

    def sample(output: Any, *, generator: Any, deterministic: bool) -> Any:
        seen["generator"], seen["deterministic"] = generator, deterministic
        noise = torch.rand(output.shape, generator=generator)
        scores = output if deterministic else output + noise
        return {"a": scores.argmax(-1), "b": scores[:, :1]}, {"score": scores.max(-1).values}

    agent = TorchAgent(Categorical(), sample_fn=sample, seed=3)
    actions, infos = agent.get_actions(obs())
    assert seen == {"generator": agent.generator, "deterministic": False}
    assert set(actions) == {"a", "b"}
    assert actions["a"].shape == (5,) and actions["b"].shape == (5, 1)
    assert isinstance(infos["score"], np.ndarray) and infos["score"].shape == (5,)
    agent.get_actions(obs(), deterministic=True)
    assert seen["deterministic"] is True


def test_custom_sample_function_with_only_the_output() -> None:
    agent = TorchAgent(Categorical(), sample_fn=lambda out: (out.argmax(-1), {}))
    actions, infos = agent.get_actions(obs())
    assert actions.shape == (5,) and infos == {}
    with pytest.raises(ValueError, match="deterministic"):
        agent.get_actions(obs(), deterministic=True)


def test_dict_observations_become_dicts_of_tensors() -> None:
    agent = TorchAgent(DictObs(), gym.spaces.Discrete(2), seed=0)
    tree = {"pos": obs(4, 3), "vel": (np.ones((4, 1)),)}  # float64 leaf: cast to float32
    actions, infos = agent.get_actions(tree)
    assert actions.shape == (4,) and infos["logp"].shape == (4,)


def test_no_autograd_graph_is_built() -> None:
    for inference_mode in (True, False):
        module = Categorical(value=True)
        seen: list[Any] = []

        def hook(_m: Any, _i: Any, out: Any, seen: list[Any] = seen) -> None:
            seen.append((torch.is_grad_enabled(), out))

        module.register_forward_hook(hook)
        agent = TorchAgent(module, DISCRETE, seed=0, inference_mode=inference_mode)
        agent.get_actions(obs())
        grad_enabled, (logits, _) = seen[0]
        assert grad_enabled is False
        assert logits.grad_fn is None and not logits.requires_grad
        assert logits.is_inference() is inference_mode
        assert all(p.grad is None for p in module.parameters())


def test_device_and_zero_copy_inputs() -> None:
    module = Categorical()
    inputs: list[Any] = []
    module.register_forward_pre_hook(lambda _m, args: inputs.append(args[0]))
    agent = TorchAgent(module, DISCRETE, device="cpu", seed=0)
    assert agent.device == torch.device("cpu")
    assert agent.generator.device == torch.device("cpu")
    x = obs()
    agent.get_actions(x)
    assert inputs[-1].dtype == torch.float32
    assert inputs[-1].data_ptr() == x.ctypes.data  # shared, not copied
    agent.get_actions(x.astype(np.float64))
    assert inputs[-1].dtype == torch.float32  # cast to the module's dtype
    read_only = obs()
    read_only.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on a tensor over a read-only buffer
        agent.get_actions(read_only)
    assert inputs[-1].data_ptr() != read_only.ctypes.data


def test_param_round_trip_numpy_and_tensors() -> None:
    ma, mb = Gaussian(), Gaussian()
    a, b = TorchAgent(ma, BOX, seed=0), TorchAgent(mb, BOX, seed=0)
    params = a.get_param_values()
    assert set(params) == {"mu.weight", "mu.bias", "log_std"}
    assert all(isinstance(v, np.ndarray) for v in params.values())
    b.set_param_values(params)
    for key, value in b.get_param_values().items():
        np.testing.assert_array_equal(value, params[key])
    params["mu.bias"][:] = 7.0  # get_param_values returned copies
    assert not torch.equal(ma.mu.bias, torch.full((2,), 7.0))
    b.set_param_values(params)  # numpy in
    assert torch.equal(mb.mu.bias, torch.full((2,), 7.0))
    a.set_param_values(mb.state_dict())  # tensors in
    assert torch.equal(ma.mu.bias, torch.full((2,), 7.0))
    assert len(pickle.dumps(params)) < 2000  # plain arrays pickle cheaply


def test_bad_params_are_rejected() -> None:
    agent = TorchAgent(Gaussian(), BOX, seed=0)
    params = agent.get_param_values()
    with pytest.raises(TypeError, match="params must be a dict"):
        agent.set_param_values(list(params.values()))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"missing \['log_std'\]"):
        agent.set_param_values({k: v for k, v in params.items() if k != "log_std"})
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        agent.set_param_values({**params, "extra": np.zeros(1)})
    with pytest.raises(ValueError, match=r"params\['mu.bias'\] has shape \(3,\)"):
        agent.set_param_values({**params, "mu.bias": np.zeros(3)})


def test_bad_module_outputs_name_what_was_expected() -> None:
    class Flat(nn.Module):
        def forward(self, x: Any) -> Any:
            return x.sum(-1)

    with pytest.raises(ValueError, match=r"logits of shape \(batch=5, n_actions\), got shape"):
        TorchAgent(Flat(), DISCRETE).get_actions(obs())
    with pytest.raises(ValueError, match="expects 3 logits per row"):
        TorchAgent(Categorical(n_actions=4), DISCRETE).get_actions(obs())
    with pytest.raises(ValueError, match="dict output with key 'logits'"):
        TorchAgent(Gaussian(std_output=True), DISCRETE).get_actions(obs())

    class NoStd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mu = nn.Linear(4, 2)

        def forward(self, x: Any) -> Any:
            return self.mu(x)

    with pytest.raises(ValueError, match="needs a log-std"):
        TorchAgent(NoStd(), BOX).get_actions(obs())

    class Strings(nn.Module):
        def forward(self, x: Any) -> Any:
            return "logits"

    with pytest.raises(ValueError, match="return a tensor, a tuple or a dict, got str"):
        TorchAgent(Strings(), DISCRETE).get_actions(obs())
    with pytest.raises(ValueError, match="one action per observation"):
        TorchAgent(Categorical(), sample_fn=lambda out: (out[:2].argmax(-1), {})).get_actions(obs())
    with pytest.raises(ValueError, match="needs a head"):
        TorchAgent(Categorical(), gym.spaces.MultiBinary(3))
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        TorchAgent(lambda x: x, DISCRETE)  # type: ignore[arg-type]


def test_seed_makes_sampling_reproducible_and_pickles() -> None:
    space = gym.spaces.Box(-np.inf, np.inf, (2,), dtype=np.float32)
    agent = TorchAgent(Gaussian(), space, seed=11)
    first = [agent.get_actions(obs())[0] for _ in range(3)]
    agent.seed(11)
    again = [agent.get_actions(obs())[0] for _ in range(3)]
    np.testing.assert_array_equal(np.stack(first), np.stack(again))
    other = TorchAgent(Gaussian(), space, seed=12)
    other.set_param_values(agent.get_param_values())
    assert not np.array_equal(other.get_actions(obs())[0], first[0])
    # A pickled agent (e.g. a copy sent to an env host) continues the same random stream.
    agent.seed(11)
    copy = pickle.loads(pickle.dumps(agent))
    np.testing.assert_array_equal(copy.get_actions(obs())[0], agent.get_actions(obs())[0])


@pytest.mark.parametrize("backend", ["local", "process"])
async def test_update_agent_sets_params_through_the_sampler(backend: str) -> None:
    agent = TorchAgent(Biased((20.0, 0.0)), gym.spaces.Discrete(2), seed=0)  # always action 0
    target = TorchAgent(Biased((0.0, 20.0)), gym.spaces.Discrete(2), seed=0)  # always action 1
    async with Sampler(
        "CartPole-v1", agent, n_workers=2, envs_per_worker=2, seed=1, backend=backend, n_processes=1
    ) as s:
        before = await s.obtain_samples(40)
        assert np.all(before.actions == 0)
        await s.update_agent(target.get_param_values())
        after = await s.obtain_samples(40)
    assert np.all(after.actions == 1)
    assert np.all(after.episode_infos["agent_version"] == 1)
    np.testing.assert_array_equal(agent.get_param_values()["bias"], [0.0, 20.0])
    assert after.agent_infos["logp"].shape == (after.n_transitions,)


async def test_evaluate_uses_the_deterministic_mode() -> None:
    agent = TorchAgent(Biased((0.0, 0.1)), gym.spaces.Discrete(2), seed=0)  # argmax: action 1
    async with Sampler("CartPole-v1", agent, n_workers=1, seed=0, backend="local") as s:
        greedy = await s.evaluate(4)
        assert np.all(greedy.batch.actions == 1)
        sampled = await s.evaluate(4, deterministic=False)
        assert set(np.unique(sampled.batch.actions).tolist()) == {0, 1}


@pytest.mark.slow  # a fresh interpreter or a deliberate wait: CI runs it with -m slow
async def test_one_seeded_agent_per_worker_gives_reproducible_batches() -> None:
    async def run(agent_seed: int) -> Any:
        agents: list[Agent] = [
            TorchAgent(_seeded_module(), gym.spaces.Discrete(2), seed=agent_seed + w)
            for w in range(2)
        ]
        async with Sampler(
            "CartPole-v1", agents, n_workers=2, envs_per_worker=3, seed=5, n_processes=2
        ) as s:
            return await s.obtain_samples(300)

    first, second, other = await run(0), await run(0), await run(100)
    assert first.equals(second)
    assert not np.array_equal(first.agent_infos["logp"][:50], other.agent_infos["logp"][:50])


def _seeded_module() -> nn.Module:
    torch.manual_seed(0)
    return Categorical(n_in=4, n_actions=2, value=True)


@pytest.mark.slow  # a fresh interpreter or a deliberate wait: CI runs it with -m slow
def test_import_asyncsample_does_not_import_torch() -> None:
    code = (
        "import sys, asyncsample\n"
        "from asyncsample import Sampler\n"
        "assert 'torch' not in sys.modules, 'import asyncsample imported torch'\n"
        "import asyncsample.torch_agent\n"
        "assert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_bfloat16_module_takes_numpy_and_gives_float32() -> None:
    module = Categorical(value=True).to(torch.bfloat16)
    agent = TorchAgent(module, DISCRETE, seed=0)
    actions, infos = agent.get_actions(obs())  # float32 observations, cast to bfloat16
    assert actions.shape == (5,) and infos["logp"].dtype == np.float32
    params = agent.get_param_values()
    assert all(v.dtype == np.float32 for v in params.values())
    params["pi.bias"][:] = 0.5
    agent.set_param_values(params)
    assert module.pi.bias.dtype == torch.bfloat16 and torch.all(module.pi.bias == 0.5)
