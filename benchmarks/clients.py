"""The vector env inside the training loops users run: CleanRL-shaped PPO and SB3's PPO.learn.

Two clients, their code as they write it, only the line that builds the vector env changes:

* **CleanRL-shaped PPO** (``ppo.py`` on CartPole-v1 with 4 and 8 envs, ``ppo_continuous_action.py``
  on HalfCheetah-v5 with 1 and 4 envs, each env wrapped as that script wraps it): an iteration is
  128 lockstep steps of a torch actor-critic through the vector env (``torch.no_grad``, the
  observations to a tensor, the sampled action back to numpy, as CleanRL writes it), then
  CleanRL's update (GAE, its epochs and minibatches: 4 epochs of 4 minibatches for ``ppo.py``;
  10 epochs of 64-sample minibatches for the continuous script, whose 2048 steps in 32
  minibatches make minibatches of 64). Steps per second over the timed iterations, the update
  included.
* **SB3's own** ``PPO("MlpPolicy", venv).learn(...)`` over ``make_vec_env("CartPole-v1",
  n_envs=8, vec_env_cls=...)``, SB3's defaults (2048 steps per env and rollout, 10 epochs of
  64-sample minibatches); steps per second of ``learn``.

Every cell runs ``SyncVectorEnv`` and ``AsyncVectorEnv`` (SB3: ``DummyVecEnv`` and
``SubprocVecEnv``) and ours in its default placement (``ours``: decided by the face, see
docs/vector.md) and forced: ``ours-inproc`` (``n_processes=0``), ``ours-hosts`` (the default
hosts, one process per CPU), ``ours-mixed`` (``caller_envs`` = half of the envs, the rest on
the other CPUs; where the caller and its hosts have a CPU each, they wait for each other
polling, see docs/vector.md). ``--contenders ... ours-mixed-asleep`` adds the same mixed
placement with hosts and caller asleep between steps (no polling), to see what the polling is
worth; ``--cells cleanrl:HalfCheetah-v5:4`` runs one cell. Each run is a fresh process; cells
are run in rounds (every contender once per round, interleaved) and the median of the rounds is
reported, with its ratio to the best of the gymnasium (SB3) classes in the same cell. The
machine's ceiling does not apply here: the policy and the update run in the caller, in lockstep,
whatever the vector env.

Torch runs with ``torch.set_num_threads(1)``, as CleanRL users on a small machine set it (its
scripts leave torch's default; on 2 cores torch's threads then compete with the env hosts).

Run it as ``asyncsample bench clients`` (or ``python -m benchmarks.clients``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.report import write_own_results

__all__ = ["main", "run_one"]

#: The results page's section (``docs/vector.md`` and ``docs/performance.md`` copy it).
HEADING = "The vector env inside training loops"

CLEANRL_CELLS = [
    ("CartPole-v1", 4),
    ("CartPole-v1", 8),
    ("HalfCheetah-v5", 1),
    ("HalfCheetah-v5", 4),
]
SB3_CELLS = [("CartPole-v1", 8)]
GYM_PEERS = ["sync", "async"]
#: The placements the faces built in this process chose (``describe``), in order.
_CHOSEN: list[str] = []
SB3_PEERS = ["dummy", "subproc"]
OURS = ["ours", "ours-inproc", "ours-hosts", "ours-mixed"]
#: Run only when named in ``--contenders``: the mixed placement with hosts that sleep between
#: steps (no spin, see ``placement.spins``), to see what the spin is worth in a cell.
ABLATIONS = ["ours-mixed-asleep"]
NAMES = {
    "sync": "SyncVectorEnv",
    "async": "AsyncVectorEnv",
    "dummy": "DummyVecEnv",
    "subproc": "SubprocVecEnv",
    "ours": "ours (default)",
    "ours-inproc": "ours, n_processes=0",
    "ours-hosts": "ours, hosts",
    "ours-mixed": "ours, mixed",
    "ours-mixed-asleep": "ours, mixed, hosts asleep",
}


def _cpus() -> int:
    getaffinity = getattr(os, "sched_getaffinity", None)
    return len(getaffinity(0)) if getaffinity is not None else os.cpu_count() or 1


def _ours_kwargs(contender: str, n: int) -> dict[str, Any] | None:
    """The face's placement arguments of contender ``contender`` (None: not applicable)."""
    if contender == "ours":
        return {}
    if contender == "ours-inproc":
        return {"n_processes": 0}
    if contender == "ours-hosts":
        return {"n_processes": min(_cpus(), n)}
    if contender in ("ours-mixed", "ours-mixed-asleep"):
        if n < 2 or _cpus() < 2:
            return None
        return {"caller_envs": n // 2}
    raise ValueError(contender)


def _ablate(contender: str) -> None:
    """Set this run's process up for an ablation of :data:`ABLATIONS` (a fresh process each)."""
    if contender == "ours-mixed-asleep":
        import asyncsample.vector.hosted as hosted

        hosted.spins = lambda *args, **kwargs: False  # hosts and caller sleep, as before


# -- CleanRL-shaped PPO ---------------------------------------------------------------------------


def _cleanrl_env(env_id: str) -> Any:
    """CleanRL's ``make_env`` for ``env_id`` (its wrappers, per env)."""
    import gymnasium as gym
    import numpy as np

    def thunk() -> Any:
        env = gym.make(env_id)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        if env_id.startswith("CartPole"):
            return env
        env = gym.wrappers.FlattenObservation(env)
        env = gym.wrappers.ClipAction(env)
        env = gym.wrappers.NormalizeObservation(env)
        env = gym.wrappers.TransformObservation(
            env, lambda obs: np.clip(obs, -10, 10), env.observation_space
        )
        env = gym.wrappers.NormalizeReward(env, gamma=0.99)
        return gym.wrappers.TransformReward(env, lambda r: float(np.clip(r, -10, 10)))

    return thunk


def _cleanrl_vector(contender: str, env_id: str, n: int) -> Any:
    import gymnasium as gym

    fns = [_cleanrl_env(env_id) for _ in range(n)]
    if contender == "sync":
        return gym.vector.SyncVectorEnv(fns)
    if contender == "async":
        return gym.vector.AsyncVectorEnv(fns)
    import asyncsample

    kwargs = _ours_kwargs(contender, n)
    assert kwargs is not None
    envs = asyncsample.VectorEnv(fns, **kwargs)
    _CHOSEN.append(envs.placement.describe(n))
    return envs


def _agent(envs: Any, continuous: bool) -> Any:
    """CleanRL's ``Agent`` (orthogonal init, 64-64 tanh MLPs; a state-independent log std for
    continuous actions)."""
    import numpy as np
    import torch
    from torch import nn
    from torch.distributions.categorical import Categorical
    from torch.distributions.normal import Normal

    def layer_init(layer: nn.Linear, std: float = float(np.sqrt(2)), bias: float = 0.0) -> Any:
        torch.nn.init.orthogonal_(layer.weight, std)
        torch.nn.init.constant_(layer.bias, bias)
        return layer

    obs_dim = int(np.array(envs.single_observation_space.shape).prod())

    class Agent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.critic = nn.Sequential(
                layer_init(nn.Linear(obs_dim, 64)),
                nn.Tanh(),
                layer_init(nn.Linear(64, 64)),
                nn.Tanh(),
                layer_init(nn.Linear(64, 1), std=1.0),
            )
            out = (
                int(np.prod(envs.single_action_space.shape))
                if continuous
                else int(envs.single_action_space.n)
            )
            self.actor = nn.Sequential(
                layer_init(nn.Linear(obs_dim, 64)),
                nn.Tanh(),
                layer_init(nn.Linear(64, 64)),
                nn.Tanh(),
                layer_init(nn.Linear(64, out), std=0.01),
            )
            if continuous:
                self.actor_logstd = nn.Parameter(torch.zeros(1, out))

        def get_value(self, x: Any) -> Any:
            return self.critic(x)

        def get_action_and_value(self, x: Any, action: Any = None) -> Any:
            if continuous:
                mean = self.actor(x)
                std = torch.exp(self.actor_logstd.expand_as(mean))
                dist: Any = Normal(mean, std)
                if action is None:
                    action = dist.sample()
                return (
                    action,
                    dist.log_prob(action).sum(1),
                    dist.entropy().sum(1),
                    self.critic(x),
                )
            dist = Categorical(logits=self.actor(x))
            if action is None:
                action = dist.sample()
            return action, dist.log_prob(action), dist.entropy(), self.critic(x)

    return Agent()


def run_cleanrl(contender: str, env_id: str, n: int, iterations: int, seed: int = 1) -> float:
    """Steps per second of ``iterations`` CleanRL PPO iterations (after one warm-up)."""
    import numpy as np
    import torch
    from torch import nn, optim

    torch.set_num_threads(1)
    continuous = not env_id.startswith("CartPole")
    num_steps = 128
    # CleanRL's update: ppo.py's 4 epochs of 4 minibatches (its 128 steps are ours); the
    # continuous script's 10 epochs of 64-sample minibatches (its 2048 steps / 32 minibatches),
    # so that the update weighs against 128 steps what it weighs against its 2048.
    epochs = 10 if continuous else 4
    lr = 3e-4 if continuous else 2.5e-4
    gamma, gae_lambda, clip_coef, ent_coef, vf_coef = (
        0.99,
        0.95,
        0.2,
        0.0 if continuous else 0.01,
        0.5,
    )
    torch.manual_seed(seed)
    np.random.seed(seed)
    envs = _cleanrl_vector(contender, env_id, n)
    try:
        agent = _agent(envs, continuous)
        optimizer = optim.Adam(agent.parameters(), lr=lr, eps=1e-5)
        obs_shape = envs.single_observation_space.shape
        act_shape = envs.single_action_space.shape
        obs = torch.zeros((num_steps, n, *obs_shape))
        actions = torch.zeros((num_steps, n, *act_shape))
        logprobs = torch.zeros((num_steps, n))
        rewards = torch.zeros((num_steps, n))
        dones = torch.zeros((num_steps, n))
        values = torch.zeros((num_steps, n))
        batch_size = num_steps * n
        minibatch_size = 64 if continuous else batch_size // 4
        next_obs_np, _ = envs.reset(seed=seed)
        next_obs = torch.Tensor(next_obs_np)
        next_done = torch.zeros(n)
        start = 0.0
        for iteration in range(iterations + 1):
            if iteration == 1:
                start = time.perf_counter()  # the first iteration is the warm-up
            for step in range(num_steps):
                obs[step] = next_obs
                dones[step] = next_done
                with torch.no_grad():
                    action, logprob, _, value = agent.get_action_and_value(next_obs)
                    values[step] = value.flatten()
                actions[step] = action
                logprobs[step] = logprob
                next_obs_np, reward, terminations, truncations, _infos = envs.step(
                    action.cpu().numpy()
                )
                next_done_np = np.logical_or(terminations, truncations)
                rewards[step] = torch.tensor(reward).view(-1)
                next_obs, next_done = torch.Tensor(next_obs_np), torch.Tensor(next_done_np)
            with torch.no_grad():
                next_value = agent.get_value(next_obs).reshape(1, -1)
                advantages = torch.zeros_like(rewards)
                lastgaelam = 0.0
                for t in reversed(range(num_steps)):
                    if t == num_steps - 1:
                        nextnonterminal = 1.0 - next_done
                        nextvalues = next_value
                    else:
                        nextnonterminal = 1.0 - dones[t + 1]
                        nextvalues = values[t + 1]
                    delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
                    lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
                    advantages[t] = lastgaelam
                returns = advantages + values
            b_obs = obs.reshape((-1, *obs_shape))
            b_logprobs = logprobs.reshape(-1)
            b_actions = actions.reshape((-1, *act_shape))
            b_advantages = advantages.reshape(-1)
            b_returns = returns.reshape(-1)
            b_inds = np.arange(batch_size)
            for _ in range(epochs):
                np.random.shuffle(b_inds)
                for begin in range(0, batch_size, minibatch_size):
                    mb = b_inds[begin : begin + minibatch_size]
                    mb_actions = b_actions[mb] if continuous else b_actions.long()[mb]
                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(
                        b_obs[mb], mb_actions
                    )
                    ratio = (newlogprob - b_logprobs[mb]).exp()
                    mb_adv = b_advantages[mb]
                    mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                    pg_loss = torch.max(
                        -mb_adv * ratio, -mb_adv * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
                    ).mean()
                    v_loss = 0.5 * ((newvalue.view(-1) - b_returns[mb]) ** 2).mean()
                    loss = pg_loss - ent_coef * entropy.mean() + v_loss * vf_coef
                    optimizer.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
                    optimizer.step()
        return iterations * num_steps * n / (time.perf_counter() - start)
    finally:
        envs.close()


# -- SB3's PPO.learn -------------------------------------------------------------------------------


def run_sb3(contender: str, env_id: str, n: int, rollouts: int, n_steps: int = 2048) -> float:
    """Steps per second of SB3's ``PPO.learn`` over ``rollouts`` rollouts (after one)."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    torch.set_num_threads(1)
    kwargs: dict[str, Any] = {}
    if contender == "dummy":
        cls: Any = DummyVecEnv
    elif contender == "subproc":
        cls = SubprocVecEnv
    else:
        from asyncsample.sb3 import AsyncSampleVecEnv

        cls = AsyncSampleVecEnv
        placed = _ours_kwargs(contender, n)
        assert placed is not None
        kwargs = placed
    venv = make_vec_env(env_id, n_envs=n, seed=0, vec_env_cls=cls, vec_env_kwargs=kwargs)
    placement = getattr(venv, "placement", None)
    if placement is not None:
        _CHOSEN.append(placement.describe(n))
    try:
        model = PPO("MlpPolicy", venv, n_steps=n_steps, batch_size=64, seed=0, device="cpu")
        model.learn(total_timesteps=n_steps * n)  # warm-up rollout and update
        start = time.perf_counter()
        model.learn(total_timesteps=rollouts * n_steps * n, reset_num_timesteps=False)
        return rollouts * n_steps * n / (time.perf_counter() - start)
    finally:
        venv.close()


# -- the runner ------------------------------------------------------------------------------------


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One run (in this process): ``spec`` names the client, env, envs, contender, budget."""
    _ablate(spec["contender"])
    if spec["client"] == "cleanrl":
        sps = run_cleanrl(spec["contender"], spec["env"], spec["n"], spec["iterations"])
    else:
        sps = run_sb3(spec["contender"], spec["env"], spec["n"], spec["rollouts"], spec["n_steps"])
    out: dict[str, Any] = {"sps": sps}
    if _CHOSEN:  # what the face of this very run chose (a decision measures the machine)
        out["placement"] = _CHOSEN[-1]
    return out


def _fresh(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """``run_one(spec)`` in a fresh interpreter; its result or ``{"error": ...}``."""
    code = (
        "import json,sys; from benchmarks.clients import run_one; "
        "print('RESULT ' + json.dumps(run_one(json.loads(sys.argv[1]))))"
    )
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=root,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[7:])
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def _cells(quick: bool, only: Sequence[str] = ()) -> list[tuple[str, str, int, list[str]]]:
    cells = [("cleanrl", e, n, GYM_PEERS + OURS + ABLATIONS) for e, n in CLEANRL_CELLS]
    cells += [("sb3", e, n, SB3_PEERS + OURS + ABLATIONS) for e, n in SB3_CELLS]
    if only:
        cells = [c for c in cells if f"{c[0]}:{c[1]}:{c[2]}" in only]
    if quick:
        cells = [
            ("cleanrl", "CartPole-v1", 4, GYM_PEERS + OURS),
            ("sb3", "CartPole-v1", 8, [*SB3_PEERS, "ours"]),
        ]
    return cells


def table(result: dict[str, Any]) -> str:
    """The results as a markdown page."""
    lines = [
        "# asyncsample benchmarks: clients",
        "",
        f"{result['date']} · Python {result['python']} · torch {result['torch']} · "
        f"{result['cpus']} CPUs · median of {result['repeats']} fresh processes per contender",
        "",
        f"## {HEADING}",
        "",
        "Steps per second of a CleanRL-shaped PPO iteration (128 lockstep steps of a torch "
        "actor-critic, then CleanRL's update) and of SB3's `PPO.learn` over `make_vec_env`; "
        "`torch.set_num_threads(1)`. Ratio: to the best of `SyncVectorEnv`/`AsyncVectorEnv` "
        "(SB3: `DummyVecEnv`/`SubprocVecEnv`) in the same cell. Ours in its default placement "
        "(what it chose is under the table) and forced in each.",
        "",
        "| loop | env | envs | `SyncVectorEnv` (SB3: `DummyVecEnv`) | `AsyncVectorEnv` "
        "(SB3: `SubprocVecEnv`) | " + " | ".join(NAMES[c] for c in OURS) + " |",
        "|---|---|---:|---:|---:|" + "---:|" * len(OURS),
    ]
    chosen = []
    ours = OURS + [a for a in ABLATIONS if any(a in c["sps"] for c in result["cells"])]
    if ours != OURS:
        lines[-2] += " " + " | ".join(NAMES[c] for c in ours[len(OURS) :]) + " |"
        lines[-1] += "---:|" * (len(ours) - len(OURS))
    for cell in result["cells"]:
        peers = GYM_PEERS if cell["client"] == "cleanrl" else SB3_PEERS
        best = cell.get("best_peer_sps")

        def cellf(
            c: str, cell: dict[str, Any] = cell, best: Any = best, peers: list[str] = peers
        ) -> str:
            sps = cell["sps"].get(c)
            if sps is None:
                return (
                    cell.get("errors", {}).get(c, "-")[:40] if c in cell.get("errors", {}) else "-"
                )
            if c in peers or not best:
                return f"{sps:,.0f}"
            return f"{sps:,.0f} ({sps / best:.2f}x)"

        loop = "CleanRL PPO" if cell["client"] == "cleanrl" else "SB3 `PPO.learn`"
        peer_cols = " | ".join(cellf(p) for p in peers)
        lines.append(
            f"| {loop} | {cell['env']} | {cell['n']} | {peer_cols} | "
            + " | ".join(cellf(c) for c in ours)
            + " |"
        )
        runs = cell.get("placements") or ([cell["placement"]] if cell.get("placement") else [])
        # One line, or one per run where they differ (each decision measures the machine).
        runs = runs[-1:] if len(set(runs)) == 1 else runs
        for k, where in enumerate(runs, 1):
            which = f" (run {k} of {len(runs)})" if len(runs) > 1 else ""
            chosen.append(f"- {loop}, {cell['env']}, {cell['n']} envs{which}: {where}")
    lines += ["", "The default placement chose:", "", *chosen]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.clients", description=__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per contender")
    parser.add_argument("--iterations", type=int, default=6, help="timed CleanRL iterations")
    parser.add_argument("--rollouts", type=int, default=2, help="timed SB3 rollouts")
    parser.add_argument(
        "--contenders", nargs="+", default=None, help=f"a subset to run (or add {ABLATIONS})"
    )
    parser.add_argument(
        "--cells",
        nargs="+",
        default=(),
        help="the cells to run, as CLIENT:ENV:N (e.g. cleanrl:HalfCheetah-v5:4; default: all)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny budgets")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "clients")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    iterations = 1 if args.quick else args.iterations
    rollouts, n_steps = (1, 32) if args.quick else (args.rollouts, 2048)
    cells = []
    for client, env_id, n, contenders in _cells(args.quick, args.cells):
        if args.contenders:
            contenders = [c for c in contenders if c in args.contenders]
        else:
            contenders = [c for c in contenders if c not in ABLATIONS]
        runs: dict[str, list[float]] = {c: [] for c in contenders}
        errors: dict[str, str] = {}
        chosen: list[str] = []
        for _ in range(repeats):
            for c in contenders:
                if c.startswith("ours") and _ours_kwargs(c, n) is None:
                    errors[c] = "n/a"
                    continue
                spec = {
                    "client": client,
                    "env": env_id,
                    "n": n,
                    "contender": c,
                    "iterations": iterations,
                    "rollouts": rollouts,
                    "n_steps": n_steps,
                }
                got = _fresh(spec, timeout=600)
                if "error" in got:
                    errors[c] = got["error"]
                    print(f"{client} {env_id} {n} {c}: {got['error']}", flush=True)
                    continue
                runs[c].append(got["sps"])
                if c == "ours" and got.get("placement"):
                    chosen.append(got["placement"])
                print(f"{client} {env_id} {n} {c}: {got['sps']:,.0f} SPS", flush=True)
        sps = {c: statistics.median(v) for c, v in runs.items() if v}
        peers = GYM_PEERS if client == "cleanrl" else SB3_PEERS
        peer_sps = [sps[p] for p in peers if p in sps]
        best = max(peer_sps) if peer_sps else None
        cells.append(
            {
                "client": client,
                "env": env_id,
                "n": n,
                "runs": runs,
                "sps": sps,
                "errors": errors,
                "best_peer_sps": best,
                "ratios": {c: sps[c] / best for c in OURS + ABLATIONS if c in sps and best},
                "placement": chosen[-1] if chosen else "",
                "placements": chosen,
            }
        )
    import torch

    result = {
        "study": "clients",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": _cpus(),
        "settings": {"quick": args.quick, "iterations": iterations, "rollouts": rollouts},
        "repeats": repeats,
        "cells": cells,
    }
    write_own_results(args.out, result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
