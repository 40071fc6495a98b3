"""An async trainer in plain numpy that learns CartPole-v1 with asyncsample.

A small actor-critic (two tanh MLPs, a PPO-style clipped policy gradient with GAE advantages,
Adam) learns while the sampler keeps collecting: ``Sampler.stream`` samples the next batch in the
background, the gradient steps run in a worker thread (``asyncio.to_thread``) so the event loop
keeps stepping the envs meanwhile, and ``await sampler.update_agent(params)`` hands the new
parameters to the agent, which takes effect at the next env step.

Because sampling and learning overlap, a batch may have been collected (partly) by an older
policy. Every step records the log-probability of the action under the policy that chose it
(``agent_infos["logp"]``), so the clipped importance ratio corrects for that; episodes more than
``max_policy_lag`` versions old are dropped by the stream.

A fixed ``--seed`` fixes the initial parameters and the env seeds, not the learning curve: how
many env steps each policy version collects depends on how fast learning runs against sampling,
so two runs of one seed differ (seed 0 took 86k-98k env steps to reach 475 in five runs).

Run it::

    python examples/async_trainer.py                 # stops when the mean return reaches 475
    python examples/async_trainer.py --steps 300000 --seed 3 --curve curve.json

``train(...)`` is the same thing as a coroutine that returns the learning curve.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from asyncsample import EpisodeBatch, Sampler, StepType

Params = dict[str, np.ndarray]
ENV_ID = "CartPole-v1"

# Hyperparameters: with these, 14 runs of seeds 0-9 reached 475 in 81k-98k env steps (see the
# README; a run is not reproducible, as sampling overlaps learning).
HIDDEN = 64
GAMMA = 0.99
GAE_LAMBDA = 0.95
CLIP = 0.2
EPOCHS = 4
MINIBATCH = 512
ACTOR_LR = 3e-3
CRITIC_LR = 1e-2
MAX_GRAD_NORM = 1.0
BATCH_STEPS = 4096  # transitions per streamed batch (one update per batch)
WINDOW = 50  # training episodes averaged for the stopping test


# -- the policy ---------------------------------------------------------------------------------


def _mlp_init(rng: np.random.Generator, sizes: tuple[int, ...], last_scale: float) -> Params:
    """A tanh MLP: ``w0, b0, w1, b1``; the last layer starts small (a near-uniform policy)."""
    n_in, n_hidden, n_out = sizes
    return {
        "w0": rng.normal(0.0, np.sqrt(1.0 / n_in), (n_in, n_hidden)),
        "b0": np.zeros(n_hidden),
        "w1": rng.normal(0.0, last_scale, (n_hidden, n_out)),
        "b1": np.zeros(n_out),
    }


def _forward(p: Params, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The hidden activations and the outputs of a tanh MLP."""
    h = np.tanh(x @ p["w0"] + p["b0"])
    return h, h @ p["w1"] + p["b1"]


def _backward(p: Params, x: np.ndarray, h: np.ndarray, d_out: np.ndarray) -> Params:
    """Gradients of the MLP's parameters given the gradient of its outputs."""
    d_pre = (d_out @ p["w1"].T) * (1.0 - h * h)
    return {
        "w0": x.T @ d_pre,
        "b0": d_pre.sum(axis=0),
        "w1": h.T @ d_out,
        "b1": d_out.sum(axis=0),
    }


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


class SoftmaxAgent:
    """A categorical policy over a tanh MLP: what the sampler's workers ask for actions.

    One object is shared by all workers, in the main process; ``set_param_values`` (called by
    ``Sampler.update_agent``) swaps in new parameters between two env steps.
    """

    def __init__(self, obs_dim: int, n_actions: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.params = _mlp_init(rng, (obs_dim, HIDDEN, n_actions), last_scale=0.01)
        self._rng = np.random.default_rng(rng.integers(2**63))

    def get_actions(
        self, observations: np.ndarray, deterministic: bool = False
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One action per env, with the log-probability of each under this policy."""
        _, logits = _forward(self.params, np.asarray(observations, dtype=np.float64))
        logp_all = _log_softmax(logits)
        if deterministic:  # Sampler.evaluate asks for this
            actions = logp_all.argmax(axis=1)
        else:  # Gumbel-max: one categorical sample per row
            actions = (logp_all + self._rng.gumbel(size=logp_all.shape)).argmax(axis=1)
        logp = np.take_along_axis(logp_all, actions[:, None], axis=1)[:, 0]
        return actions, {"logp": logp}

    def get_param_values(self) -> Params:
        return {k: v.copy() for k, v in self.params.items()}

    def set_param_values(self, params: Params) -> None:
        self.params = {k: np.array(v, dtype=np.float64) for k, v in params.items()}


# -- the learner --------------------------------------------------------------------------------


class Adam:
    """Adam over a dict of arrays, with global-norm gradient clipping."""

    def __init__(self, params: Params, lr: float) -> None:
        self.lr = lr
        self.t = 0
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}

    def step(self, params: Params, grads: Params) -> None:
        norm = np.sqrt(sum(float((g * g).sum()) for g in grads.values()))
        scale = min(1.0, MAX_GRAD_NORM / (norm + 1e-8))
        self.t += 1
        b1, b2 = 0.9, 0.999
        for k, g in grads.items():
            g = g * scale
            self.m[k] = b1 * self.m[k] + (1 - b1) * g
            self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
            m_hat = self.m[k] / (1 - b1**self.t)
            v_hat = self.v[k] / (1 - b2**self.t)
            params[k] -= self.lr * m_hat / (np.sqrt(v_hat) + 1e-8)


class Learner:
    """Actor and critic parameters and their optimisers; ``update`` runs in a worker thread."""

    def __init__(self, actor: Params, obs_dim: int, seed: int) -> None:
        rng = np.random.default_rng([seed, 1])
        self.actor = {k: v.copy() for k, v in actor.items()}
        self.critic = _mlp_init(rng, (obs_dim, HIDDEN, 1), last_scale=0.1)
        self.actor_opt = Adam(self.actor, ACTOR_LR)
        self.critic_opt = Adam(self.critic, CRITIC_LR)
        self._rng = np.random.default_rng([seed, 2])

    def value(self, obs: np.ndarray) -> np.ndarray:
        return _forward(self.critic, obs)[1][:, 0]

    def advantages(self, batch: EpisodeBatch) -> tuple[np.ndarray, np.ndarray]:
        """GAE advantages and value targets; a TIMEOUT (truncated) episode bootstraps."""
        obs = np.asarray(batch.observations, dtype=np.float64)
        values = self.value(obs)
        last_values = self.value(np.asarray(batch.last_observations, dtype=np.float64))
        rewards = batch.rewards.astype(np.float64)
        adv = np.zeros_like(rewards)
        for i, steps in enumerate(batch.episode_slices):
            timeout = StepType(batch.step_types[steps.stop - 1]) == StepType.TIMEOUT
            next_value = last_values[i] if timeout else 0.0
            running = 0.0
            for t in range(steps.stop - 1, steps.start - 1, -1):
                delta = rewards[t] + GAMMA * next_value - values[t]
                running = delta + GAMMA * GAE_LAMBDA * running
                adv[t] = running
                next_value = values[t]
        return adv, adv + values

    def update(self, batch: EpisodeBatch) -> Params:
        """A few epochs of clipped policy-gradient and value steps; returns the new actor."""
        obs = np.asarray(batch.observations, dtype=np.float64)
        actions = np.asarray(batch.actions, dtype=np.int64)
        behaviour_logp = np.asarray(batch.agent_infos["logp"], dtype=np.float64)
        adv, targets = self.advantages(batch)
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        n = len(obs)
        for _ in range(EPOCHS):
            order = self._rng.permutation(n)
            for start in range(0, n, MINIBATCH):
                idx = order[start : start + MINIBATCH]
                self._actor_step(obs[idx], actions[idx], behaviour_logp[idx], adv[idx])
                self._critic_step(obs[idx], targets[idx])
        return {k: v.copy() for k, v in self.actor.items()}

    def _actor_step(
        self, obs: np.ndarray, actions: np.ndarray, old_logp: np.ndarray, adv: np.ndarray
    ) -> None:
        h, logits = _forward(self.actor, obs)
        logp_all = _log_softmax(logits)
        logp = logp_all[np.arange(len(actions)), actions]
        ratio = np.exp(logp - old_logp)
        # d/dlogp of -min(ratio * A, clip(ratio) * A): zero where the clipped term is chosen.
        clipped = ((adv > 0) & (ratio > 1 + CLIP)) | ((adv < 0) & (ratio < 1 - CLIP))
        d_logp = np.where(clipped, 0.0, -adv * ratio) / len(actions)
        onehot = np.zeros_like(logits)
        onehot[np.arange(len(actions)), actions] = 1.0
        d_logits = d_logp[:, None] * (onehot - np.exp(logp_all))
        self.actor_opt.step(self.actor, _backward(self.actor, obs, h, d_logits))

    def _critic_step(self, obs: np.ndarray, targets: np.ndarray) -> None:
        h, out = _forward(self.critic, obs)
        d_out = (out[:, 0] - targets)[:, None] / len(obs)
        self.critic_opt.step(self.critic, _backward(self.critic, obs, h, d_out))


# -- the training loop --------------------------------------------------------------------------


async def train(
    *,
    total_steps: int,
    seed: int,
    target: float = 475.0,
    n_workers: int = 2,
    envs_per_worker: int = 8,
    backend: str = "process",
    log: Callable[[str], None] | None = print,
    batch_steps: int = BATCH_STEPS,
    max_policy_lag: int = 1,
    eval_episodes: int = 20,
) -> dict[str, Any]:
    """Train on CartPole-v1 until the mean return of the last ``WINDOW`` training episodes
    reaches ``target`` or ``total_steps`` env steps have been sampled; then evaluate the
    deterministic (greedy) policy on separate test envs.

    Returns the learning curve: per update the env steps so far, the mean return of the batch's
    episodes and of the last ``WINDOW`` episodes, wall time and the agent version; and the
    final evaluation.
    """
    say = log or (lambda _msg: None)
    start = time.perf_counter()
    curve: dict[str, list[Any]] = {
        "env_steps": [],
        "mean_return": [],
        "window_return": [],
        "seconds": [],
        "agent_version": [],
    }
    recent: deque[float] = deque(maxlen=WINDOW)
    reached_at: tuple[int, float] | None = None
    learn_seconds = 0.0

    probe = gym.make(ENV_ID)  # read the spaces to size the policy
    assert isinstance(probe.action_space, gym.spaces.Discrete)
    obs_dim = int(np.prod(probe.observation_space.shape or ()))
    n_actions = int(probe.action_space.n)
    probe.close()
    agent = SoftmaxAgent(obs_dim, n_actions, seed=seed)
    learner = Learner(agent.get_param_values(), obs_dim, seed=seed)

    async with Sampler(
        ENV_ID,
        agent,  # one agent for every worker ("auto" runs its copies in the env hosts)
        n_workers=n_workers,
        envs_per_worker=envs_per_worker,
        seed=seed,
        backend=backend,
        # One env-host process per worker (the default is one per CPU).
        n_processes=n_workers if backend == "process" else None,
    ) as sampler:
        stream = sampler.stream(batch_steps, max_policy_lag=max_policy_lag)
        async with contextlib.aclosing(stream) as batches:
            async for batch in batches:
                returns = batch.returns
                recent.extend(returns.tolist())
                window = float(np.mean(recent))
                steps = sampler.total_env_steps
                curve["env_steps"].append(steps)
                curve["mean_return"].append(float(returns.mean()) if len(returns) else None)
                curve["window_return"].append(window)
                curve["seconds"].append(time.perf_counter() - start)
                curve["agent_version"].append(int(batch.episode_infos["agent_version"].max()))
                stats = sampler.last_stats
                sps = stats.steps_per_second if stats is not None else float("nan")
                say(
                    f"steps {steps:>8}  episodes {len(returns):>4}  batch return "
                    f"{returns.mean():6.1f}  last-{WINDOW} return {window:6.1f}  "
                    f"sampling {sps:7.0f} steps/s  {time.perf_counter() - start:6.1f} s"
                )
                if len(recent) == WINDOW and window >= target:
                    reached_at = (steps, time.perf_counter() - start)
                    break
                if steps >= total_steps:
                    break
                # Learn in a thread: the event loop keeps stepping the envs meanwhile.
                t0 = time.perf_counter()
                params = await asyncio.to_thread(learner.update, batch)
                learn_seconds += time.perf_counter() - t0
                await sampler.update_agent(params)

        evaluation = await sampler.evaluate(eval_episodes, agent=agent)
        total_env_steps = sampler.total_env_steps

    seconds = time.perf_counter() - start
    result: dict[str, Any] = {
        "env": ENV_ID,
        "seed": seed,
        "target": target,
        "window": WINDOW,
        "backend": backend,
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
    if reached_at is not None:
        say(f"reached {target:g} after {reached_at[0]} env steps in {reached_at[1]:.1f} s")
    else:
        say(f"stopped at {total_env_steps} env steps without reaching {target:g}")
    say(f"greedy policy on {eval_episodes} test episodes: mean return {evaluation.mean_return:.1f}")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1_000_000, help="env-step budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=475.0, help="stop at this mean return")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs-per-worker", type=int, default=8)
    parser.add_argument("--backend", default="process", choices=["process", "local", "ray"])
    parser.add_argument("--curve", metavar="PATH", help="write the learning curve as JSON here")
    args = parser.parse_args(argv)
    result = uvloop.run(
        train(
            total_steps=args.steps,
            seed=args.seed,
            target=args.target,
            n_workers=args.workers,
            envs_per_worker=args.envs_per_worker,
            backend=args.backend,
        )
    )
    if args.curve:
        with open(args.curve, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":  # run when executed, not when imported (the tests import it)
    main()
