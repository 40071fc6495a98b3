"""PPO with a torch actor-critic on ``Sampler.stream(fragments=True)``: CartPole-v1 to 475.

The sampler's agent is a :class:`~asyncsample.torch_agent.TorchAgent` wrapping a copy of the
actor-critic (its output ``(logits, value)`` gives the categorical head and a ``"value"`` info).
The stream yields fixed-size batches of *fragments*: every env keeps running across batches, so a
batch holds pieces of episodes. Generalised advantage estimation must therefore bootstrap at the
end of every piece whose episode did not really end:

* last step ``TERMINAL``: the episode ended in a terminal state, the value after it is 0;
* last step ``TIMEOUT``: the episode was cut by a time limit, bootstrap from ``V(last_obs)``;
* last step ``FIRST``/``MID``: the batch ended mid-episode, bootstrap from ``V(last_obs)``
  (``last_observations`` is the current observation of that env).

Two ways to run it:

* default (``--backend process``): envs in env-host processes, the gradient steps in a worker
  thread (``asyncio.to_thread``) while the stream keeps sampling the next batch, and the new
  parameters go to the agent with ``await sampler.update_agent(params)``. Fast; the batch an
  update lands in depends on timing, so runs differ slightly.
* ``--reproducible``: the ``local`` backend and the gradient steps on the event loop's thread,
  so sampling pauses while the learner works and a fixed ``--seed`` gives the same run every time
  (under a given event loop implementation).

Run it::

    python examples/ppo_torch.py                       # stops at a mean return of 475
    python examples/ppo_torch.py --seed 3 --reproducible --plot docs/images/ppo_torch_curve.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from asyncsample import EpisodeBatch, Sampler, StepType
from asyncsample.torch_agent import TorchAgent

ENV_ID = "CartPole-v1"

# Hyperparameters (see the README for the runs they gave).
HIDDEN = 64
GAMMA = 0.99
GAE_LAMBDA = 0.95
CLIP = 0.2
EPOCHS = 10
MINIBATCH = 256
LR = 1e-3
VALUE_COEF = 0.5
ENTROPY_COEF = 0.0
MAX_GRAD_NORM = 0.5
BATCH_STEPS = 2048  # transitions per streamed batch (one PPO update per batch)
WINDOW = 50  # completed training episodes averaged for the stopping test

_DONE = (StepType.TERMINAL, StepType.TIMEOUT)


# -- the model ----------------------------------------------------------------------------------


class ActorCritic(nn.Module):
    """Separate tanh MLPs for the policy logits and the state value; ``forward`` gives both."""

    def __init__(self, obs_dim: int, n_actions: int) -> None:
        super().__init__()
        self.actor = _mlp(obs_dim, n_actions, last_gain=0.01)
        self.critic = _mlp(obs_dim, 1, last_gain=1.0)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor(obs), self.critic(obs)[:, 0]


def _mlp(n_in: int, n_out: int, last_gain: float) -> nn.Sequential:
    layers = [nn.Linear(n_in, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh()]
    last = nn.Linear(HIDDEN, n_out)
    for layer in [*layers[::2], last]:
        assert isinstance(layer, nn.Linear)
        nn.init.orthogonal_(layer.weight, gain=last_gain if layer is last else np.sqrt(2))
        nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers, last)


# -- advantages across fragments ----------------------------------------------------------------


def gae(
    batch: EpisodeBatch,
    values: np.ndarray,
    last_values: np.ndarray,
    gamma: float = GAMMA,
    lam: float = GAE_LAMBDA,
) -> tuple[np.ndarray, np.ndarray]:
    """GAE(gamma, lambda) advantages and value targets for a batch of episode fragments.

    Args:
        batch: episodes or fragments laid end to end (``lengths``, ``step_types``, ``rewards``).
        values: ``V(observations[t])`` for every transition.
        last_values: ``V(last_observations[i])`` for every fragment ``i``.
        gamma: discount.
        lam: GAE's lambda.

    Returns:
        ``(advantages, returns)``, one per transition, ``returns = advantages + values``.
        A fragment ending in ``TERMINAL`` bootstraps from 0; one ending in ``TIMEOUT`` (time
        limit) or cut mid-episode (``FIRST``/``MID``) bootstraps from its ``last_values`` entry.
    """
    rewards = np.asarray(batch.rewards, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    advantages = np.zeros_like(rewards)
    for i, steps in enumerate(batch.episode_slices):
        ended = StepType(batch.step_types[steps.stop - 1]) == StepType.TERMINAL
        next_value = 0.0 if ended else float(last_values[i])
        running = 0.0
        for t in range(steps.stop - 1, steps.start - 1, -1):
            delta = rewards[t] + gamma * next_value - values[t]
            running = delta + gamma * lam * running
            advantages[t] = running
            next_value = values[t]
    return advantages, advantages + values


class EpisodeReturns:
    """Adds fragment rewards up per (worker, env) into the returns of completed episodes."""

    def __init__(self) -> None:
        self._running: dict[tuple[int, int], float] = {}

    def add(self, batch: EpisodeBatch) -> list[float]:
        """The returns of the episodes that ``batch`` completes (whose start was seen)."""
        done: list[float] = []
        workers = batch.episode_infos["worker"]
        envs = batch.episode_infos["env"]
        for i, steps in enumerate(batch.episode_slices):
            key = (int(workers[i]), int(envs[i]))
            first = StepType(batch.step_types[steps.start])
            # A fragment starts a new episode with FIRST, or is a whole one-step episode.
            if first == StepType.FIRST or (key not in self._running and first in _DONE):
                self._running[key] = 0.0
            total = self._running.get(key)
            if total is None:
                continue  # its start was never seen
            total += float(batch.rewards[steps].sum())
            if StepType(batch.step_types[steps.stop - 1]) in _DONE:
                del self._running[key]
                done.append(total)
            else:
                self._running[key] = total
        return done


# -- the learner --------------------------------------------------------------------------------


class Learner:
    """Its own copy of the actor-critic and an Adam optimiser; ``update`` is one PPO update."""

    def __init__(self, model: ActorCritic, seed: int) -> None:
        self.model = model
        self.optimizer = torch.optim.Adam(model.parameters(), lr=LR, eps=1e-5)
        self.generator = torch.Generator().manual_seed(seed)

    def params(self) -> dict[str, np.ndarray]:
        return {k: v.detach().numpy().copy() for k, v in self.model.state_dict().items()}

    def update(self, batch: EpisodeBatch) -> dict[str, np.ndarray]:
        """Advantages with the current critic, then clipped-PPO epochs; the new parameters."""
        obs = torch.as_tensor(np.asarray(batch.observations, dtype=np.float32))
        with torch.no_grad():
            _, values = self.model(obs)
            last = torch.as_tensor(np.asarray(batch.last_observations, dtype=np.float32))
            _, last_values = self.model(last)
        adv_np, ret_np = gae(batch, values.numpy(), last_values.numpy())
        adv = torch.as_tensor(adv_np, dtype=torch.float32)
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        returns = torch.as_tensor(ret_np, dtype=torch.float32)
        actions = torch.as_tensor(np.asarray(batch.actions, dtype=np.int64))
        old_logp = torch.as_tensor(np.asarray(batch.agent_infos["logp"], dtype=np.float32))
        n = len(obs)
        for _ in range(EPOCHS):
            order = torch.randperm(n, generator=self.generator)
            for start in range(0, n, MINIBATCH):
                idx = order[start : start + MINIBATCH]
                logits, value = self.model(obs[idx])
                logp_all = torch.log_softmax(logits, dim=-1)
                logp = logp_all.gather(1, actions[idx, None])[:, 0]
                ratio = torch.exp(logp - old_logp[idx])
                surrogate = torch.min(
                    ratio * adv[idx], torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * adv[idx]
                )
                entropy = -(logp_all.exp() * logp_all).sum(-1)
                loss = (
                    -surrogate.mean()
                    + VALUE_COEF * ((value - returns[idx]) ** 2).mean()
                    - ENTROPY_COEF * entropy.mean()
                )
                self.optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)
                self.optimizer.step()
        return self.params()


# -- the training loop --------------------------------------------------------------------------


async def train(
    *,
    total_steps: int,
    seed: int,
    target: float = 475.0,
    n_workers: int = 2,
    envs_per_worker: int = 8,
    reproducible: bool = False,
    backend: str = "process",
    batch_steps: int = BATCH_STEPS,
    eval_episodes: int = 20,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Train until the mean return of the last ``WINDOW`` completed training episodes reaches
    ``target`` or ``total_steps`` env steps were sampled; then evaluate the greedy policy.

    Returns the learning curve (per update: env steps, the window's mean return, wall time) and
    the final evaluation.
    """
    torch.set_num_threads(1)
    say = log or (lambda _msg: None)
    if reproducible:
        backend = "local"
    start = time.perf_counter()
    probe = gym.make(ENV_ID)
    assert isinstance(probe.action_space, gym.spaces.Discrete)
    obs_dim = int(np.prod(probe.observation_space.shape or ()))
    action_space = probe.action_space
    probe.close()

    torch.manual_seed(seed)
    model = ActorCritic(obs_dim, int(action_space.n))
    learner = Learner(model, seed)
    agent = TorchAgent(copy.deepcopy(model), action_space, seed=seed)

    curve: dict[str, list[Any]] = {"env_steps": [], "window_return": [], "seconds": []}
    returns = EpisodeReturns()
    recent: deque[float] = deque(maxlen=WINDOW)
    reached_at: tuple[int, float] | None = None
    learn_seconds = 0.0

    async with Sampler(
        ENV_ID,
        agent,
        n_workers=n_workers,
        envs_per_worker=envs_per_worker,
        seed=seed,
        backend=backend,
        n_processes=n_workers if backend == "process" else None,
    ) as sampler:
        # buffer_size=1: sample at most one batch ahead of the learner, so a batch was collected
        # at most one or two policy versions back (buffer_size=2 took ~10% more env steps).
        stream = sampler.stream(batch_steps, fragments=True, buffer_size=1)
        async with contextlib.aclosing(stream) as batches:
            async for batch in batches:
                recent.extend(returns.add(batch))
                window = float(np.mean(recent)) if recent else 0.0
                steps = sampler.total_env_steps
                curve["env_steps"].append(steps)
                curve["window_return"].append(window)
                curve["seconds"].append(time.perf_counter() - start)
                say(
                    f"steps {steps:>7}  episodes {len(recent):>3}  last-{WINDOW} return "
                    f"{window:6.1f}  {time.perf_counter() - start:6.1f} s"
                )
                if len(recent) == WINDOW and window >= target:
                    reached_at = (steps, time.perf_counter() - start)
                    break
                if steps >= total_steps:
                    break
                t0 = time.perf_counter()
                if reproducible:  # blocks the loop: sampling waits for the new parameters
                    params = learner.update(batch)
                else:  # the stream keeps sampling meanwhile
                    params = await asyncio.to_thread(learner.update, batch)
                learn_seconds += time.perf_counter() - t0
                await sampler.update_agent(params)

        evaluation = await sampler.evaluate(eval_episodes)
        total_env_steps = sampler.total_env_steps

    seconds = time.perf_counter() - start
    if reached_at is not None:
        say(f"reached {target:g} after {reached_at[0]} env steps in {reached_at[1]:.1f} s")
    else:
        say(f"stopped at {total_env_steps} env steps without reaching {target:g}")
    say(f"greedy policy on {eval_episodes} test episodes: mean return {evaluation.mean_return:.1f}")
    return {
        "env": ENV_ID,
        "seed": seed,
        "target": target,
        "window": WINDOW,
        "backend": backend,
        "reproducible": reproducible,
        "reached": reached_at is not None,
        "steps_to_target": reached_at[0] if reached_at else None,
        "seconds_to_target": reached_at[1] if reached_at else None,
        "total_env_steps": total_env_steps,
        "seconds": seconds,
        "learn_seconds": learn_seconds,
        "curve": curve,
        "final_evaluation": {
            "mean_return": evaluation.mean_return,
            "returns": evaluation.returns.tolist(),
        },
    }


def plot(results: list[dict[str, Any]], path: str) -> None:
    """Env steps vs the mean return of the last ``WINDOW`` episodes, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        label = f"seed {r['seed']}"
        if r["reached"]:
            label += (
                f": 475 at {r['steps_to_target'] // 1000}k steps, {r['seconds_to_target']:.0f} s"
            )
        ax.plot(r["curve"]["env_steps"], r["curve"]["window_return"], label=label)
    ax.axhline(results[0]["target"], color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("env steps")
    ax.set_ylabel(f"mean return, last {WINDOW} episodes")
    ax.set_title(f"PPO (torch) on {ENV_ID} with asyncsample's fragment stream")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500_000, help="env-step budget per run")
    parser.add_argument("--seed", type=int, nargs="+", default=[0], help="one run per seed")
    parser.add_argument("--target", type=float, default=475.0, help="stop at this mean return")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs-per-worker", type=int, default=8)
    parser.add_argument("--backend", default="process", choices=["process", "local", "ray"])
    parser.add_argument(
        "--reproducible", action="store_true", help="local backend, learn on the loop's thread"
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    parser.add_argument("--plot", metavar="PNG", help="draw the learning curves here")
    args = parser.parse_args(argv)
    results = []
    for seed in args.seed:
        results.append(
            uvloop.run(
                train(
                    total_steps=args.steps,
                    seed=seed,
                    target=args.target,
                    n_workers=args.workers,
                    envs_per_worker=args.envs_per_worker,
                    reproducible=args.reproducible,
                    backend=args.backend,
                )
            )
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.plot)
    return results


if __name__ == "__main__":  # so that tests can import this file; env hosts never import it
    main()
