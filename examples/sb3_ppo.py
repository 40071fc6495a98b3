"""Stable-Baselines3 PPO on CartPole-v1, with its envs on asyncsample's process pool.

``AsyncSampleVecEnv`` stands where ``SubprocVecEnv`` would: 8 sub-envs packed 4 to an env-host
process (one round trip per process and step instead of one per env), each wrapped in SB3's
``Monitor`` so ``evaluate_policy`` and the episode statistics work as usual. The hyperparameters
are the RL Zoo's for CartPole-v1 (linear schedules for the learning rate and clip range).

Run it (needs ``pip install 'asyncsample[sb3]'``)::

    python examples/sb3_ppo.py                      # trains, then prints the evaluation
    python examples/sb3_ppo.py --steps 150000 --seed 1

``train(...)`` does the same and returns the mean and standard deviation of the evaluation
return (the maximum on CartPole-v1 is 500).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import gymnasium as gym
from stable_baselines3 import PPO
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.monitor import Monitor

from asyncsample.sb3 import AsyncSampleVecEnv


def make_env() -> gym.Env:  # type: ignore[type-arg]
    """One monitored CartPole-v1 (the factory travels to the env hosts by cloudpickle)."""
    return Monitor(gym.make("CartPole-v1"))


def linear(start: float) -> Callable[[float], float]:
    """A schedule from ``start`` down to 0 over training (SB3 passes the progress left)."""
    return lambda progress_remaining: progress_remaining * start


def train(
    steps: int = 100_000,
    seed: int = 0,
    n_envs: int = 8,
    n_processes: int = 2,
    eval_episodes: int = 20,
    verbose: int = 0,
) -> tuple[float, float]:
    """Train PPO on ``steps`` env steps and evaluate it deterministically.

    Returns:
        ``(mean, std)`` of the return over ``eval_episodes`` evaluation episodes.
    """
    train_env = AsyncSampleVecEnv([make_env] * n_envs, n_processes=n_processes)
    eval_env = AsyncSampleVecEnv([make_env] * 4, n_processes=1)
    try:
        model = PPO(
            "MlpPolicy",
            train_env,
            n_steps=32,
            batch_size=256,
            gae_lambda=0.8,
            gamma=0.98,
            n_epochs=20,
            ent_coef=0.0,
            learning_rate=linear(1e-3),
            clip_range=linear(0.2),
            seed=seed,
            device="cpu",
            verbose=verbose,
        )
        model.learn(total_timesteps=steps)
        eval_env.seed(seed + 1000)
        mean, std = evaluate_policy(
            model, eval_env, n_eval_episodes=eval_episodes, deterministic=True
        )
    finally:
        train_env.close()
        eval_env.close()
    return float(mean), float(std)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000, help="training env steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-envs", type=int, default=8)
    parser.add_argument("--n-processes", type=int, default=2)
    args = parser.parse_args()
    start = time.perf_counter()
    mean, std = train(args.steps, args.seed, args.n_envs, args.n_processes, verbose=0)
    print(
        f"PPO on CartPole-v1 with AsyncSampleVecEnv ({args.n_envs} envs, {args.n_processes} "
        f"processes), {args.steps} steps in {time.perf_counter() - start:.0f}s: "
        f"mean return {mean:.1f} +/- {std:.1f} over 20 deterministic episodes"
    )


if __name__ == "__main__":
    main()
