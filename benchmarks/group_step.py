"""The cost of the env hosts' lockstep step itself: ``EnvGroup.step`` over 8 CartPole-v1 envs.

Run from the repository root, one source tree per argument (each in a fresh interpreter, the
trees alternating)::

    python -m benchmarks.group_step /tmp/ab-base .
    python -m benchmarks.group_step --inproc /tmp/ab-base .   # one process, steady under load

Prints the CPU microseconds per env step (the best of 5 rounds of 20,000 steps) of each tree:
what the per-env bookkeeping of :meth:`asyncsample.env_group.EnvGroup.step` costs on top of the
env's own ``step``, without processes, sockets or an event loop. ``--inproc`` loads each tree's
``env_group.py`` side by side in one interpreter (its imports from this tree) and alternates
blocks of 1,000 steps, 60 each: the mean and best per tree, less moved by other load.
"""

from __future__ import annotations

import subprocess
import sys

_RUN = """
import sys, time
sys.path.insert(0, {tree!r})
import gymnasium as gym, numpy as np
from asyncsample.env_group import EnvGroup, StepBuffers
space, n = gym.make("CartPole-v1"), 8
buffers = StepBuffers.allocate(space.observation_space, space.action_space, n)
group = EnvGroup(0, buffers, space.observation_space, space.action_space, None)
group.build([["CartPole-v1"]] * n, list(range(n)))
group.reset(np.ones(n, dtype=bool))
mask, best = np.ones(n, dtype=bool), float("inf")
for _ in range({blocks}):
    start = time.process_time()
    for k in range({steps}):
        buffers.actions[:] = k & 1
        group.step(mask)
    best = min(best, (time.process_time() - start) / {steps} / n * 1e6)
print(f"{{best:.3f}}")
"""


def main(trees: list[str], rounds: int = 2, blocks: int = 5, steps: int = 20_000) -> None:
    """Print each tree's best CPU microseconds per env step over ``rounds`` alternations (each
    the best of ``blocks`` blocks of ``steps`` steps of the 8 envs; less for a smoke test)."""
    best = dict.fromkeys(trees, float("inf"))
    for _ in range(rounds):
        for tree in trees:
            out = subprocess.run(
                [sys.executable, "-c", _RUN.format(tree=tree, blocks=blocks, steps=steps)],
                capture_output=True,
                text=True,
                check=True,
            )
            best[tree] = min(best[tree], float(out.stdout.strip()))
    for tree, us in best.items():
        print(f"{tree}: {us:.2f} us CPU per env step")


_INPROC = """
import importlib.util, sys, time
import gymnasium as gym, numpy as np
trees, n, space = {trees!r}, 8, gym.make("CartPole-v1")
groups = []
for k, tree in enumerate(trees):
    spec = importlib.util.spec_from_file_location(f"eg{{k}}", tree + "/asyncsample/env_group.py")
    m = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    b = m.StepBuffers.allocate(space.observation_space, space.action_space, n)
    g = m.EnvGroup(0, b, space.observation_space, space.action_space, None)
    g.build([["CartPole-v1"]] * n, list(range(n)))
    g.reset(np.ones(n, dtype=bool))
    groups.append((g, b))
mask, best, total = np.ones(n, dtype=bool), [1e9] * len(trees), [0.0] * len(trees)
for _ in range(60):
    for k, (g, b) in enumerate(groups):
        start = time.process_time()
        for j in range(1000):
            b.actions[:] = j & 1
            g.step(mask)
        us = (time.process_time() - start) / 1000 / n * 1e6
        best[k], total[k] = min(best[k], us), total[k] + us
for tree, b, t in zip(trees, best, total):
    print(f"{{tree}}: mean {{t / 60:.2f}}, best {{b:.2f}} us CPU per env step")
"""


def main_inproc(trees: list[str]) -> None:
    """Print each tree's mean and best CPU microseconds per env step, alternated in-process."""
    subprocess.run([sys.executable, "-c", _INPROC.format(trees=trees)], check=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--inproc":
        main_inproc(args[1:] or ["."])
    else:
        main(args or ["."])
