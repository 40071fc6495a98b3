"""The ``asyncsample`` command line: ``run`` samples an env with a random agent; ``bench`` runs the
benchmark suite of a source checkout."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import uvloop
from tqdm import tqdm

from asyncsample.backends import BACKENDS
from asyncsample.batch import EpisodeBatch, StepType
from asyncsample.sampler import Sampler

__all__ = ["main"]


@dataclass
class RunSummary:
    """What ``asyncsample run`` reports."""

    steps: int = 0
    seconds: float = 0.0
    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    _open: dict[tuple[int, int], tuple[float, int]] = field(default_factory=dict)

    def add(self, batch: EpisodeBatch) -> None:
        """Count a batch of fragments, joining the pieces of episodes that span calls."""
        self.steps += batch.n_transitions
        workers = batch.episode_infos["worker"].tolist()
        envs = batch.episode_infos["env"].tolist()
        last_types = batch.step_types[np.cumsum(batch.lengths) - 1]
        for w, e, ret, n, last in zip(
            workers, envs, batch.returns.tolist(), batch.lengths.tolist(), last_types.tolist()
        ):
            prev_ret, prev_n = self._open.pop((w, e), (0.0, 0))
            if int(last) in (StepType.TERMINAL, StepType.TIMEOUT):
                self.returns.append(prev_ret + ret)
                self.lengths.append(prev_n + n)
            else:
                self._open[(w, e)] = (prev_ret + ret, prev_n + n)

    def text(self) -> str:
        """A few lines for the terminal."""
        rate = self.steps / self.seconds if self.seconds else 0.0
        lines = [
            f"steps:        {self.steps}",
            f"time:         {self.seconds:.2f} s",
            f"steps/s:      {rate:,.0f}",
            f"episodes:     {len(self.returns)} completed",
        ]
        if self.returns:
            lines.append(
                f"mean return:  {np.mean(self.returns):.2f} "
                f"(min {np.min(self.returns):.2f}, max {np.max(self.returns):.2f})"
            )
            lines.append(f"mean length:  {np.mean(self.lengths):.1f}")
        return "\n".join(lines)


async def run(args: argparse.Namespace) -> RunSummary:
    """Sample ``args.steps`` transitions with a random agent, showing a progress bar."""
    summary = RunSummary()
    sampler = Sampler(
        args.env_id,
        n_workers=args.workers,
        envs_per_worker=args.envs_per_worker,
        n_processes=args.processes,
        backend=args.backend,
        seed=args.seed,
        max_episode_length=args.max_episode_length,
    )
    chunk = max(args.steps // 50, args.workers * args.envs_per_worker)
    async with sampler:
        print(
            f"sampling {args.env_id} with {args.workers} workers x {args.envs_per_worker} envs "
            f"on the {args.backend!r} backend (seed {sampler.seed})",
            file=sys.stderr,
        )
        with tqdm(total=args.steps, unit="step", unit_scale=True, file=sys.stderr) as bar:
            start = time.perf_counter()
            while summary.steps < args.steps:
                batch = await sampler.obtain_fragments(min(chunk, args.steps - summary.steps))
                summary.add(batch)
                bar.update(batch.n_transitions)
                if summary.returns:
                    bar.set_postfix(
                        episodes=len(summary.returns), mean_return=f"{np.mean(summary.returns):.1f}"
                    )
            summary.seconds = time.perf_counter() - start
    return summary


def _run_command(args: argparse.Namespace) -> int:
    summary = uvloop.run(run(args))
    print(summary.text())
    return 0


def _bench_command(rest: Sequence[str]) -> int:
    """Run ``benchmarks`` from the source checkout this is run in (it is not installed)."""
    for folder in [Path.cwd(), *Path.cwd().parents, Path(__file__).resolve().parents[1]]:
        if (folder / "benchmarks" / "__main__.py").exists():
            sys.path.insert(0, str(folder))
            break
    try:
        from benchmarks.__main__ import main as bench_main  # type: ignore[import-not-found]
    except ImportError as exc:
        print(
            "asyncsample bench runs the benchmark suite of a source checkout: run it from the "
            f"repository (where benchmarks/ is). ({exc})",
            file=sys.stderr,
        )
        return 2
    return int(bench_main(list(rest)))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncsample", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="sample an env with a random agent and print a summary")
    run_p.add_argument("env_id", nargs="?", default="CartPole-v1", help="gymnasium env id")
    run_p.add_argument("--steps", type=int, default=200_000, help="transitions to sample")
    run_p.add_argument("--workers", type=int, default=4, help="worker coroutines")
    run_p.add_argument("--envs-per-worker", type=int, default=8, help="envs per worker")
    run_p.add_argument("--processes", type=int, default=None, help="env-host processes")
    run_p.add_argument("--backend", choices=BACKENDS, default="process")
    run_p.add_argument("--seed", type=int, default=0)
    run_p.add_argument("--max-episode-length", type=int, default=None)
    sub.add_parser(
        "bench", help="run the benchmark suite (arguments go to benchmarks)", add_help=False
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``asyncsample`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _bench_command(argv[1:])
    args = _parser().parse_args(argv)
    if args.steps < 1:
        _parser().error(f"--steps must be >= 1, got {args.steps}")
    return _run_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
