"""The cost of the env hosts' lockstep step itself: ``EnvGroup.step`` over 8 CartPole-v1 envs.

Run from the repository root, one source tree per argument (each in a fresh interpreter, the
trees alternating)::

    python -m benchmarks.group_step /tmp/ab-base .

Prints the CPU microseconds per env step (the best of 5 rounds of 20,000 steps) of each tree:
what the per-env bookkeeping (:meth:`asyncsample.env_group.EnvGroup.finish` and the loop around
it) costs on top of the env's own ``step``, without processes, sockets or an event loop.
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
for _ in range(5):
    start = time.process_time()
    for k in range(20_000):
        buffers.actions[:] = k & 1
        group.step(mask)
    best = min(best, (time.process_time() - start) / 20_000 / n * 1e6)
print(f"{{best:.3f}}")
"""


def main(trees: list[str], rounds: int = 2) -> None:
    """Print each tree's best CPU microseconds per env step over ``rounds`` alternations."""
    best = dict.fromkeys(trees, float("inf"))
    for _ in range(rounds):
        for tree in trees:
            out = subprocess.run(
                [sys.executable, "-c", _RUN.format(tree=tree)],
                capture_output=True,
                text=True,
                check=True,
            )
            best[tree] = min(best[tree], float(out.stdout.strip()))
    for tree, us in best.items():
        print(f"{tree}: {us:.2f} us CPU per env step")


if __name__ == "__main__":
    main(sys.argv[1:] or ["."])
