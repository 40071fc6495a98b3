"""The ``asyncsample`` command line: ``run`` samples an env with a random agent; ``bench`` runs the
benchmark studies of a source checkout (``asyncsample bench --list``, ``asyncsample bench STUDY``).

Exit status: 0 done, 1 a failure while sampling, 2 a usage error (a bad argument or env id, an
option whose optional package is not installed, a metrics port or address that cannot be used,
no subcommand), 130 interrupted.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import uvloop
from tqdm import tqdm

from asyncsample.backends import BACKENDS, traits
from asyncsample.batch import EpisodeBatch, StepType
from asyncsample.sampler import Sampler

__all__ = ["EXIT_INTERRUPTED", "EXIT_RUNTIME", "EXIT_USAGE", "RUN_STEPS", "call_size", "main"]

EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a Ctrl-C

#: The transitions ``run`` samples unless ``--steps`` says otherwise.
RUN_STEPS = 200_000
#: The most transitions ``run`` asks for in one call.
MAX_CHUNK = 50_000
#: ``run`` samples its steps in about this many calls: few enough that the hosts of cheap envs
#: seldom wait between two calls (docs/performance.md, tuning checklist), enough that the bar moves.
CALLS = 16
#: The most bytes of observations ``run`` asks for in one call (raw Atari frames: 665 steps).
MAX_CALL_BYTES = 64 * 2**20

#: The backends ``run`` offers: those that step a gymnasium id's (blocking) envs; ``asyncio``
#: takes only async envs, which no gymnasium id makes.
RUN_BACKENDS = tuple(name for name in BACKENDS if not traits(name).async_envs)

#: Where ``run``'s random agent runs: the sampler's choice (the summary names it, and why).
INFERENCE = "auto"

#: The description of ``asyncsample --help`` (plain text: no reST markup).
DESCRIPTION = (
    "The asyncsample command line: 'asyncsample run' samples an env with a random agent; "
    "'asyncsample bench' runs the benchmark studies of a source checkout "
    "('asyncsample bench --list' lists them)."
)
EPILOG = (
    "exit status: 0 done, 1 runtime error, 2 usage error, 130 interrupted (Ctrl-C prints the "
    "summary so far)"
)


class UsageError(Exception):
    """A bad argument found after parsing (exit status 2)."""


@dataclass
class RunSummary:
    """What ``asyncsample run`` reports."""

    steps: int = 0
    seconds: float = 0.0
    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    restarts: int = 0
    layout: str = ""
    bottleneck: str | None = None
    shares: dict[str, float] = field(default_factory=dict)
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
        if self.layout:
            lines.insert(0, f"ran:          {self.layout}")
        if self.returns:
            lines.append(
                f"mean return:  {np.mean(self.returns):.2f} "
                f"(min {np.min(self.returns):.2f}, max {np.max(self.returns):.2f})"
            )
            lines.append(f"mean length:  {np.mean(self.lengths):.1f}")
        if self.restarts:
            lines.append(f"restarts:     {self.restarts} env-host restarts (see --verbose)")
        if self.bottleneck is not None:
            held = {"env": "the envs", "agent": "the agent", "caller": "the caller"}
            shares = self.shares
            lines.append(
                f"bottleneck:   {self.bottleneck} (last call held by {held[self.bottleneck]}: "
                f"envs busy {shares.get('env', 0.0):.0%}, agent busy "
                f"{shares.get('agent', 0.0):.0%}, caller idle {shares.get('caller', 0.0):.0%})"
            )
        return "\n".join(lines)


def make_sampler(args: argparse.Namespace, metrics: Any = None) -> Sampler:
    """The sampler ``args`` describe; a bad argument or env id is a :class:`UsageError`."""
    try:
        return Sampler(
            args.env_id,
            n_workers=args.workers,
            envs_per_worker=args.envs_per_worker,
            n_processes=args.processes,
            backend=args.backend,
            seed=args.seed,
            max_episode_length=args.max_episode_length,
            inference=INFERENCE,
            metrics=metrics,
        )
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc


async def run(args: argparse.Namespace, summary: RunSummary) -> None:
    """Sample ``args.steps`` transitions with a random agent into ``summary`` (filled as batches
    arrive, so an interrupted run still has them), with a progress bar."""
    server = None
    if args.metrics_port is None:
        sampler = make_sampler(args)
    else:
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()
        sampler = make_sampler(args, registry)
        try:
            server, _ = start_http_server(args.metrics_port, args.metrics_addr, registry)
        except (OSError, ValueError, OverflowError) as exc:
            await sampler.aclose()
            raise UsageError(_serve_error(args.metrics_port, args.metrics_addr, exc)) from exc
        port = server.server_address[1]
        print(f"metrics on http://{args.metrics_addr}:{port}/metrics", file=sys.stderr, flush=True)
    try:
        await sampler.start()  # in a running loop the env is built off the loop, read here
    except (ValueError, TypeError) as exc:
        await sampler.aclose()
        if server is not None:
            server.shutdown()
            server.server_close()
        raise UsageError(str(exc)) from exc
    chunk = call_size(
        args.steps, args.workers * args.envs_per_worker, sampler.env_spec.observation_space
    )
    start = time.perf_counter()
    try:
        async with sampler:
            summary.layout = layout(sampler)
            print(
                f"sampling {args.env_id}: {summary.layout} (seed {sampler.seed})",
                file=sys.stderr,
                flush=True,
            )
            with tqdm(total=args.steps, unit="step", unit_scale=True, file=sys.stderr) as bar:
                start = time.perf_counter()
                while summary.steps < args.steps:
                    batch = await sampler.obtain_fragments(min(chunk, args.steps - summary.steps))
                    assert isinstance(batch, EpisodeBatch)  # a gymnasium id: one agent
                    summary.add(batch)
                    bar.update(batch.n_transitions)
                    if summary.returns:
                        bar.set_postfix(
                            episodes=len(summary.returns),
                            mean_return=f"{np.mean(summary.returns):.1f}",
                        )
    finally:
        summary.seconds = time.perf_counter() - start
        summary.restarts = sampler.restarts
        if sampler.metrics is not None:
            summary.bottleneck = sampler.metrics.verdict
            summary.shares = dict(sampler.metrics.shares)
        if server is not None:
            server.shutdown()
            server.server_close()


def call_size(steps: int, n_envs: int, observation_space: Any) -> int:
    """The transitions each of ``run``'s calls asks for, to sample ``steps`` with ``n_envs`` envs:
    about :data:`CALLS` calls, at most :data:`MAX_CHUNK` transitions and :data:`MAX_CALL_BYTES`
    of observations (where the space has a fixed shape and dtype), and one step of every env."""
    size = min(steps // CALLS, MAX_CHUNK)
    shape, dtype = (
        getattr(observation_space, "shape", None),
        getattr(observation_space, "dtype", None),
    )
    if shape is not None and dtype is not None:
        size = min(size, MAX_CALL_BYTES // max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize))
    return max(size, n_envs)


def layout(sampler: Sampler) -> str:
    """What ran, in one line: the backend, the inference mode and the placement."""
    in_process = traits(sampler.backend_name).in_process
    where = "in this process" if in_process else f"on {sampler.n_processes} env hosts"
    return (
        f"backend {sampler.backend_name}, inference {sampler.inference.describe()}, "
        f"{sampler.n_workers} workers x "
        f"{sampler.envs_per_worker} envs {where}"
    )


def _serve_error(port: int, addr: str, exc: BaseException) -> str:
    """The usage error of a metrics server that could not start, naming the argument at fault."""
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return f"--metrics-port {port}: the port is already in use on {addr}"
    if isinstance(exc, socket.gaierror | UnicodeError) or (
        isinstance(exc, OSError) and exc.errno == errno.EADDRNOTAVAIL
    ):
        return f"--metrics-addr {addr!r}: expected an address of this machine to listen on ({exc})"
    return f"--metrics-port {port} --metrics-addr {addr!r}: cannot listen there ({exc})"


def _usage_error(prog: str, message: str) -> NoReturn:
    """Print a usage error as one line on stderr and exit with status 2."""
    sys.stderr.write(f"{prog}: error: {message} (see {prog} --help)\n")
    raise SystemExit(EXIT_USAGE)


def _run_command(args: argparse.Namespace) -> int:
    needs = []  # (option, package, extra) of the optional dependencies asked for
    backend_needs = traits(args.backend).needs
    if backend_needs is not None:
        needs.append((f"--backend {args.backend}", backend_needs, backend_needs))
    if args.metrics_port is not None:
        needs.append(("--metrics-port", "prometheus_client", "metrics"))
    for option, package, extra in needs:
        try:
            importlib.import_module(package)
        except ImportError:
            _usage_error(
                "asyncsample run",
                f"{option} needs the {package} package, which is not installed: "
                f"pip install 'asyncsample[{extra}]'",
            )
    _configure_logging(args.verbose)
    summary = RunSummary()
    try:
        uvloop.run(run(args, summary))
    except UsageError as exc:
        _usage_error("asyncsample run", str(exc))
    except KeyboardInterrupt:
        # asyncio's runner cancelled the sampling task on SIGINT: the sampler is closed by now.
        print(summary.text(), flush=True)
        print("asyncsample run: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if args.debug:
            traceback.print_exc()
        lines = str(exc).strip().splitlines()
        what = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        print(f"asyncsample run: error: {what}", file=sys.stderr)
        return EXIT_RUNTIME
    print(summary.text())
    return 0


class _BarSafeHandler(logging.Handler):
    """Writes log lines above the progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stderr)


def _configure_logging(verbose: bool) -> None:
    """Print the sampler's warnings (restarts, timeouts) only when asked."""
    logger = logging.getLogger("asyncsample")
    logger.setLevel(logging.WARNING if verbose else logging.ERROR)
    if verbose:
        handler = _BarSafeHandler()
        handler.setFormatter(logging.Formatter("asyncsample: %(levelname)s: %(message)s"))
        logger.addHandler(handler)
    logger.propagate = False


def _bench_command(rest: Sequence[str]) -> int:
    """Run a study of ``benchmarks`` from the source checkout this is run in (not installed)."""
    for folder in [Path.cwd(), *Path.cwd().parents, Path(__file__).resolve().parents[1]]:
        if (folder / "benchmarks" / "__main__.py").exists():
            sys.path.insert(0, str(folder))
            break
    try:
        from benchmarks.__main__ import main as bench_main
    except ImportError as exc:
        print(
            "asyncsample bench runs the benchmark studies of a source checkout: run it from the "
            f"repository (where benchmarks/ is). ({exc})",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return int(bench_main(list(rest)))


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit status 2), no usage block."""

    def error(self, message: str) -> NoReturn:
        _usage_error(self.prog, message)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every option's default (but ``None`` or ``False``: their help says it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum`` (and <= ``maximum``, if given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            expected = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
            raise argparse.ArgumentTypeError(f"expected an integer {expected}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}" if maximum is None else f"int {minimum}-{maximum}"
    return parse


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="asyncsample", description=DESCRIPTION, epilog=EPILOG, formatter_class=_HelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run_p = sub.add_parser(
        "run",
        help="sample an env with a random agent and print a summary",
        description="Sample an env with a random agent and print a summary.",
        epilog=EPILOG,
        formatter_class=_HelpFormatter,
    )
    positive = _int_at_least(1)
    run_p.add_argument("env_id", nargs="?", default="CartPole-v1", help="gymnasium env id")
    run_p.add_argument("--steps", type=positive, default=RUN_STEPS, help="transitions to sample")
    run_p.add_argument("--workers", type=positive, default=4, help="worker coroutines")
    run_p.add_argument("--envs-per-worker", type=positive, default=8, help="envs per worker")
    run_p.add_argument(
        "--processes", type=positive, default=None, help="env-host processes (default: one per CPU)"
    )
    run_p.add_argument(
        "--backend",
        choices=RUN_BACKENDS,
        default="process",
        help="where the envs run: process (env-host processes), local (this process, the event "
        "loop's thread), thread (a thread pool, for envs that wait outside the GIL), ray (Ray "
        "actors: pip install 'asyncsample[ray]')",
    )
    run_p.add_argument("--seed", type=_int_at_least(0), default=0, help="root seed")
    run_p.add_argument(
        "--max-episode-length",
        type=positive,
        default=None,
        help="cut episodes at this length (default: no limit)",
    )
    run_p.add_argument(
        "--metrics-port",
        type=_int_at_least(0, 65535),
        default=None,
        help="serve Prometheus metrics on this port while the run goes (0: a free port, printed "
        "on stderr) and print the bottleneck in the summary (default: no metrics)",
    )
    run_p.add_argument(
        "--metrics-addr", default="127.0.0.1", help="the address --metrics-port listens on"
    )
    run_p.add_argument("--debug", action="store_true", help="show the traceback of a runtime error")
    run_p.add_argument(
        "-v", "--verbose", action="store_true", help="print env-host restarts as they happen"
    )
    sub.add_parser(
        "bench",
        help="run a benchmark study of a checkout (bench --list lists them)",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``asyncsample`` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        _usage_error("asyncsample", "expected a command, run or bench, and got none")
    if argv[:1] == ["bench"]:
        return _bench_command(argv[1:])
    return _run_command(_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
