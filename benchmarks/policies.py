"""The policy workload: one small torch network that drives every contender alike.

``"mlp"``: an MLP 64x64 with tanh, one torch thread per process, stochastic actions:
``Categorical`` over logits for a ``Discrete`` action space, a diagonal ``Normal``
(state-independent log-std) for a ``Box``, clipped to the box. It is what a user of an
on-policy algorithm brings; its cost is a fixed ~200 us per call whatever the batch size, so it
rewards samplers that make few calls. ``"cnn"``: the Nature-CNN (conv 32x8x8/4, 64x4x4/2,
64x3x3/1, dense 512) on uint8 frames scaled by 1/255, for the Atari games; its cost grows with
the rows.

torch is imported when a policy is built, never at module import.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["MLPAgent", "make_policy"]


class MLPAgent:
    """An asyncsample agent (and a plain ``act(obs)`` callable) around a torch MLP.

    Args:
        observation_space: a ``Box`` (flattened to one vector per row).
        action_space: ``Discrete`` or ``Box``.
        seed: seeds the weights and the sampling generator.
        hidden: widths of the hidden layers.
        cnn: a Nature-CNN trunk (``(4, 84, 84)`` uint8 frames) instead of the MLP.
    """

    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        seed: int = 0,
        hidden: tuple[int, ...] = (64, 64),
        cnn: bool = False,
    ) -> None:
        import torch
        from torch import nn

        torch.set_num_threads(1)
        self._torch = torch
        self._gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        n_in = int(np.prod(observation_space.shape))
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        if self.discrete:
            n_out = int(action_space.n)  # type: ignore[attr-defined]
        else:
            assert isinstance(action_space, gym.spaces.Box)
            n_out = int(np.prod(action_space.shape))
            self._low = action_space.low.astype(np.float32)
            self._high = action_space.high.astype(np.float32)
            self._shape = action_space.shape
        layers: list[nn.Module] = []
        width = n_in
        if cnn:
            layers += [
                nn.Unflatten(1, tuple(observation_space.shape or ())),
                nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(),
                nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
                nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(),
                nn.Flatten(),
            ]  # fmt: skip
            width, hidden = 64 * 7 * 7, (512,)
        self._scale = 1.0 / 255.0 if cnn else 1.0
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU() if cnn else nn.Tanh()]
            width = h
        layers.append(nn.Linear(width, n_out))
        self.net = nn.Sequential(*layers)
        self.log_std = nn.Parameter(torch.full((n_out,), -0.5))
        self.net.eval()

    def act(self, observations: np.ndarray) -> np.ndarray:
        """One stochastic action per row of ``observations``."""
        torch = self._torch
        with torch.no_grad():
            x = torch.as_tensor(np.asarray(observations, dtype=np.float32))
            out = self.net(x.reshape(len(x), -1) * self._scale)
            if self.discrete:
                dist = torch.distributions.Categorical(logits=out)
                return dist.sample().numpy()  # type: ignore[no-any-return]
            dist = torch.distributions.Normal(out, self.log_std.exp())
            actions = dist.sample().numpy().reshape(len(x), *self._shape)
            return np.clip(actions, self._low, self._high)

    def get_actions(self, observations: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The asyncsample Agent interface: actions and no agent infos."""
        return self.act(observations), {}

    def get_param_values(self) -> dict[str, Any]:
        """The network's parameters (a state dict)."""
        return {k: v.clone() for k, v in self.net.state_dict().items()}

    def set_param_values(self, params: dict[str, Any]) -> None:
        """Load parameters from :meth:`get_param_values`."""
        self.net.load_state_dict(params)


def make_policy(name: str, env_id: str, seed: int = 0) -> MLPAgent:
    """The policy ``name`` (``"mlp"`` or ``"cnn"``) for the spaces of ``env_id``."""
    if name not in ("mlp", "cnn"):
        raise ValueError(f"policy must be 'mlp' or 'cnn', got {name!r}")
    env = gym.make(env_id)
    try:
        return MLPAgent(env.observation_space, env.action_space, seed=seed, cnn=name == "cnn")
    finally:
        env.close()
