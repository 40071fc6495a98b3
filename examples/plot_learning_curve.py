"""Plot the learning curve of examples/async_trainer.py: mean return against env steps.

Trains once per seed (or reads curves that ``async_trainer.py --curve`` wrote) and writes a PNG::

    python examples/plot_learning_curve.py                      # seeds 0 1 2 -> learning_curve.png
    python examples/plot_learning_curve.py --curve a.json b.json --out curve.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run_trainer(seeds: list[int], steps: int, backend: str) -> list[dict[str, Any]]:
    import uvloop

    sys.path.insert(0, str(HERE))
    from async_trainer import train

    async def all_seeds() -> list[dict[str, Any]]:
        results = []
        for seed in seeds:
            print(f"training seed {seed}...", flush=True)
            result = await train(total_steps=steps, seed=seed, backend=backend, log=None)
            print(
                f"  seed {seed}: 475 after {result['steps_to_target']} env steps, "
                f"{result['seconds_to_target']:.1f} s"
                if result["reached"]
                else f"  seed {seed}: not reached in {result['total_env_steps']} env steps",
                flush=True,
            )
            results.append(result)
        return results

    return uvloop.run(all_seeds())


def plot(results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    for i, result in enumerate(results):
        curve = result["curve"]
        color = f"C{i}"
        steps = [s / 1000 for s in curve["env_steps"]]
        batch = [r if r is not None else float("nan") for r in curve["mean_return"]]
        label = f"seed {result['seed']}"
        if result["reached"]:
            label += f": 475 after {result['steps_to_target'] / 1000:.0f}k steps"
            label += f", {result['seconds_to_target']:.0f} s"
        ax.plot(steps, batch, color=color, alpha=0.3, linewidth=1)
        ax.plot(steps, curve["window_return"], color=color, linewidth=2, label=label)
    target, window = results[0]["target"], results[0]["window"]
    ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("env steps (thousands)")
    ax.set_ylabel(f"mean return (last {window} episodes; faint: per batch)")
    ax.set_title(
        f"CartPole-v1: numpy actor-critic with Sampler.stream ({results[0]['backend']} backend)"
    )
    ax.set_ylim(0, 520)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--curve", nargs="+", type=Path, help="curve JSON files to plot")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1_000_000, help="env-step budget per seed")
    parser.add_argument("--backend", default="process", choices=["process", "local", "ray"])
    parser.add_argument("--out", type=Path, default=HERE / "learning_curve.png")
    args = parser.parse_args(argv)
    if args.curve:
        results = [json.loads(path.read_text()) for path in args.curve]
    else:
        results = run_trainer(args.seeds, args.steps, args.backend)
    plot(results, args.out)


if __name__ == "__main__":  # run when executed, not when imported (the tests import it)
    main()
