"""Throughput of ``backend="ray"`` against ``backend="process"`` on this machine.

Run from the repository root::

    python -m benchmarks.ray_vs_process            # about 8 minutes on 2 cores
    python -m benchmarks.ray_vs_process --quick    # about 1 minute

Every run uses the same sampler layout on both backends (``n_workers`` worker coroutines of
``envs_per_worker`` envs, ``n_processes`` env-host processes or actors), the built-in seeded
random agent, and ``obtain_fragments`` in a loop (off-policy sampling: no episode is thrown
away, so steps/s is the sampler's throughput). Envs:

- ``CartPole-v1``: a step costs a few microseconds, so this measures the per-step overhead.
- ``Image-v0``: 84x84x4 uint8 observations (an Atari frame stack; ``benchmarks.envs``), cheap
  steps. Its frames are flat with a few changing rows, so they compress very well, as Atari
  screens do.
- ``NoiseImage-v0``: the same shape filled with random noise: it does not compress (the worst
  case for compression).

On a cluster, run it on the head node with ``--address auto`` and a layout that uses the
cluster, e.g. ``--layouts 64x32x32 --backends ray`` (``n_processes`` is the number of actors).

Ray runs connect to one local Ray instance started before them (its start-up time is reported
apart); the process runs come first, before Ray starts, so that Ray's idle daemons do not slow
them. Results: a markdown table on stdout and ``benchmarks/results/ray/results.json`` (and ``.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import statistics
import time
import traceback
from pathlib import Path
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

RESULTS = Path(__file__).resolve().parent / "results" / "ray" / "results.json"


class NoiseImageEnv(gym.Env[np.ndarray, np.int64]):
    """84x84x4 uint8 frames of random noise (one row redrawn per step): they do not compress."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(0, 255, shape=(84, 84, 4), dtype=np.uint8)
        self.action_space = gym.spaces.Discrete(4)
        self._frame = np.zeros((84, 84, 4), dtype=np.uint8)
        self._t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Fill the frame with noise."""
        super().reset(seed=seed)
        self._t = 0
        self._frame[:] = self.np_random.integers(0, 256, size=self._frame.shape, dtype=np.uint8)
        return self._frame.copy(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Redraw one row."""
        self._t += 1
        row = self._frame[self._t % 84]
        row[:] = self.np_random.integers(0, 256, size=row.shape, dtype=np.uint8)
        return self._frame.copy(), float(action == self._t % 4), False, False, {}


def _image_env_class() -> tuple[type[gym.Env[Any, Any]], str]:
    from benchmarks.envs import ImageEnv

    return ImageEnv, "benchmarks.envs.ImageEnv"


def _time_limited(cls: type[gym.Env[Any, Any]], limit: int) -> gym.Env[Any, Any]:
    return gym.wrappers.TimeLimit(cls(), limit)


def env_factories() -> dict[str, Any]:
    """Env name -> picklable zero-argument factory (shipped by value to hosts and actors)."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(__import__(__name__))  # actors cannot import this file
    image, _ = _image_env_class()
    if image.__module__ != __name__:
        cloudpickle.register_pickle_by_value(__import__(image.__module__, fromlist=["_"]))
    return {
        "CartPole-v1": "CartPole-v1",
        "Image-v0": functools.partial(_time_limited, image, 100),
        "NoiseImage-v0": functools.partial(_time_limited, NoiseImageEnv, 100),
    }


async def measure(
    env: Any,
    backend: str,
    *,
    n_workers: int,
    envs_per_worker: int,
    n_processes: int,
    seconds: float,
    backend_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Steps/s of ``obtain_fragments`` over ``seconds`` (after a warm-up), and start-up time."""
    from asyncsample import Sampler

    chunk = n_workers * envs_per_worker * 16  # 16 steps of every env per call
    t0 = time.perf_counter()
    sampler = Sampler(
        env,
        n_workers=n_workers,
        envs_per_worker=envs_per_worker,
        n_processes=n_processes,
        seed=0,
        backend=backend,
        backend_options=backend_options,
    )
    async with sampler:
        started = time.perf_counter() - t0
        for _ in range(2):
            await sampler.obtain_fragments(chunk)
        steps = calls = 0
        load = os.getloadavg()[0]
        begin = time.perf_counter()
        while time.perf_counter() - begin < seconds:
            steps += (await sampler.obtain_fragments(chunk)).n_transitions
            calls += 1
        elapsed = time.perf_counter() - begin
    return {
        "steps_per_s": steps / elapsed,
        "worker_steps_per_s": steps / envs_per_worker / elapsed,
        "transitions": steps,
        "seconds": elapsed,
        "start_s": started,
        "load_avg_1min_before": load,
    }


async def ray_floor(ray: Any, n: int = 300) -> dict[str, float]:
    """Round trip of an empty actor call awaited in the event loop: Ray's own floor."""

    @ray.remote(num_cpus=0)
    class Echo:
        def ping(self, x: bytes) -> bytes:
            return x

    echo = Echo.remote()  # type: ignore[attr-defined]
    await echo.ping.remote(b"")
    begin = time.perf_counter()
    for _ in range(n):
        await echo.ping.remote(b"x" * 64)
    sequential = (time.perf_counter() - begin) / n
    begin = time.perf_counter()
    await asyncio.gather(*(echo.ping.remote(b"x" * 64) for _ in range(n)))
    pipelined = (time.perf_counter() - begin) / n
    ray.kill(echo)
    return {"sequential_us": sequential * 1e6, "pipelined_us": pipelined * 1e6}


def compression_costs(factories: dict[str, Any], n_envs: int) -> dict[str, Any]:
    """Ratio and time to compress one reply's observations (``n_envs`` frames) per codec."""
    out: dict[str, Any] = {}
    codecs = ["zlib"]
    try:
        import lz4.frame  # noqa: F401

        codecs.append("lz4")
    except ImportError:
        pass
    from asyncsample.backends._ray_actor import _Packed

    for name in ("Image-v0", "NoiseImage-v0"):
        frames = []
        for i in range(n_envs):  # one frame from each of n_envs differently seeded envs
            env = factories[name]()
            env.reset(seed=i)
            for _ in range(20):
                frame = env.step(env.action_space.sample())[0]
            frames.append(frame)
        batch = np.stack(frames)
        for codec in codecs:
            times_c, times_d = [], []
            for _ in range(20):
                t = time.perf_counter()
                packed = _Packed.pack(batch, codec)
                times_c.append(time.perf_counter() - t)
                t = time.perf_counter()
                packed.unpack()
                times_d.append(time.perf_counter() - t)
            out[f"{name}/{codec}"] = {
                "raw_bytes": int(batch.nbytes),
                "ratio": batch.nbytes / len(packed.data),
                "compress_us": statistics.median(times_c) * 1e6,
                "decompress_us": statistics.median(times_d) * 1e6,
            }
    return out


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Every (env, layout, backend) run; process runs first, then Ray's."""
    factories = env_factories()
    layouts = args.layouts or ([(4, 8, 2)] if args.quick else [(4, 8, 2), (4, 32, 2)])
    envs = args.envs or (["CartPole-v1", "Image-v0"] if args.quick else list(factories))
    runs: list[dict[str, Any]] = []
    notes: list[str] = []

    async def one(
        env: str, backend: str, layout: tuple[int, int, int], codec: str | None = None
    ) -> None:
        w, e, p = layout
        options: dict[str, Any] = {}
        label = backend
        if codec is not None:
            # The backend compresses with lz4 when it is installed, else zlib: force the codec.
            ray_backend.best_codec = lambda: codec
            options["compress_threshold"] = 16 * 1024
            label += f" +{codec}"
        row: dict[str, Any] = {
            "env": env,
            "backend": label,
            "n_workers": w,
            "envs_per_worker": e,
            "n_processes": p,
        }
        try:
            row.update(
                await measure(
                    factories[env],
                    backend,
                    n_workers=w,
                    envs_per_worker=e,
                    n_processes=p,
                    seconds=args.seconds,
                    backend_options=options or None,
                )
            )
            row["status"] = "ok"
        except Exception as exc:
            row["status"] = "skipped"
            row["note"] = f"{type(exc).__name__}: {exc}"
            notes.append(f"{label} on {env}: skipped ({row['note']})")
            if args.verbose:
                traceback.print_exc()
        runs.append(row)
        shown = f"{row['steps_per_s']:,.0f} steps/s" if row["status"] == "ok" else row["note"]
        print(f"  {env:13s} {label:16s} W={w} E={e} P={p}: {shown}", flush=True)

    for _ in range(args.repeat if "process" in args.backends else 0):
        for layout in layouts:
            for env in envs:
                await one(env, "process", layout)

    import ray

    from asyncsample.backends import ray as ray_backend

    codecs = ["zlib"]
    if ray_backend.best_codec() == "lz4":
        codecs.append("lz4")
    else:
        notes.append("lz4 is not installed: compression measured with zlib only")
    began = time.perf_counter()
    started = not ray.is_initialized()  # a Ray already running in this process is reused
    if not started:
        notes.append("Ray was already initialised in this process: reused, not restarted")
    elif args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    ray_start = time.perf_counter() - began
    try:
        floor = await ray_floor(ray)
        for _ in range(args.repeat if "ray" in args.backends else 0):
            for layout in layouts:
                for env in envs:
                    await one(env, "ray", layout)
                    if env != "CartPole-v1":
                        for codec in codecs:
                            await one(env, "ray", layout, codec)
    finally:
        if started:
            ray.shutdown()
    return {
        "runs": runs,
        "summary": summarise(runs),
        "notes": notes,
        "ray_init_s": ray_start,
        "ray_floor": floor,
        "compression": compression_costs(factories, 8),
        "image_env": _image_env_class()[1],
    }


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (env, layout, backend): the median of its repeats, with the spread."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in runs:
        key = (r["env"], r["n_workers"], r["envs_per_worker"], r["n_processes"], r["backend"])
        groups.setdefault(key, []).append(r)
    rows = []
    for (env, w, e, p, backend), group in groups.items():
        ok = [r for r in group if r["status"] == "ok"]
        row: dict[str, Any] = {
            "env": env,
            "n_workers": w,
            "envs_per_worker": e,
            "n_processes": p,
            "backend": backend,
            "status": "ok" if ok else "skipped",
        }
        if ok:
            rates = [r["steps_per_s"] for r in ok]
            row.update(
                steps_per_s=statistics.median(rates),
                min_steps_per_s=min(rates),
                max_steps_per_s=max(rates),
                repeats=len(rates),
                start_s=statistics.median(r["start_s"] for r in ok),
            )
        else:
            row["note"] = group[0].get("note", "")
        rows.append(row)
    return rows


def table(results: dict[str, Any]) -> str:
    """The summary as a markdown table, with ray's speed relative to process."""
    rows = results["summary"]
    base = {
        (r["env"], r["n_workers"], r["envs_per_worker"]): r["steps_per_s"]
        for r in rows
        if r["backend"] == "process" and r["status"] == "ok"
    }
    lines = [
        "| env | W x E (P) | backend | steps/s (median) | min - max | vs process | start (s) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        layout = f"{r['n_workers']} x {r['envs_per_worker']} ({r['n_processes']})"
        if r["status"] != "ok":
            lines.append(f"| {r['env']} | {layout} | {r['backend']} | skipped | | | |")
            continue
        ref = base.get((r["env"], r["n_workers"], r["envs_per_worker"]))
        rel = f"{r['steps_per_s'] / ref:.2f}x" if ref else "n/a"
        lines.append(
            f"| {r['env']} | {layout} | {r['backend']} | {r['steps_per_s']:,.0f} | "
            f"{r['min_steps_per_s']:,.0f} - {r['max_steps_per_s']:,.0f} | {rel} | "
            f"{r['start_s']:.1f} |"
        )
    return "\n".join(lines)


def _layout(text: str) -> tuple[int, int, int]:
    try:
        w, e, p = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WxExP such as 4x8x2, got {text!r}") from None
    return w, e, p


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, print the table, write the JSON and the markdown beside it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="timed seconds per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each configuration")
    parser.add_argument(
        "--layouts",
        nargs="+",
        type=_layout,
        metavar="WxExP",
        help="n_workers x envs_per_worker x n_processes (actors), e.g. 64x32x32 on a cluster",
    )
    parser.add_argument("--envs", nargs="+", choices=["CartPole-v1", "Image-v0", "NoiseImage-v0"])
    parser.add_argument(
        "--backends", nargs="+", choices=["process", "ray"], default=["process", "ray"]
    )
    parser.add_argument(
        "--address", help="connect to this Ray cluster (e.g. auto) instead of starting one"
    )
    parser.add_argument("--quick", action="store_true", help="one layout, two envs, 3 s runs")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="tracebacks of skipped runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds = min(args.seconds, 3.0)
        args.repeat = 1
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    load_before = os.getloadavg()
    with runner:
        results = runner.run(run_all(args))
    import ray

    results["machine"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "ray": ray.__version__,
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
    }
    results["seconds_per_run"] = args.seconds
    print()
    print(table(results))
    floor = results["ray_floor"]
    print(
        f"\nRay: ray.init took {results['ray_init_s']:.1f} s; an empty actor call "
        f"awaited in the loop takes {floor['sequential_us']:.0f} us one at a time, "
        f"{floor['pipelined_us']:.0f} us each when {300} are in flight."
    )
    for key, c in results["compression"].items():
        print(
            f"compression {key}: {c['raw_bytes'] / 1024:.0f} KiB -> ratio {c['ratio']:.1f}, "
            f"{c['compress_us']:.0f} us to compress, {c['decompress_us']:.0f} us to decompress"
        )
    for note in results["notes"]:
        print(f"note: {note}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(table(results) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
