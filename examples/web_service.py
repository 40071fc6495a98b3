"""An aiohttp service that owns one asyncsample Sampler and runs sampling jobs in the background.

The sampler is created when the app starts and closed when it stops (``cleanup_ctx``); the envs
step in env-host processes while the event loop keeps serving requests. Jobs run one at a time:
each streams from the sampler, and the sampler queues the others behind it.

Endpoints::

    POST   /jobs                 {"env": "CartPole-v1", "steps": 100000}, both optional -> job id
    GET    /jobs                 every job
    GET    /jobs/{id}            status (queued, running, done, cancelled, failed) and stats
    GET    /jobs/{id}/progress   server-sent events, one per sampled batch, until the job ends
    DELETE /jobs/{id}            cancel the job
    GET    /stats                sampler totals: total_env_steps, last_stats, restarts
    GET    /health               {"status": "ok"}
    GET    /metrics              the sampler's Prometheus metrics (asyncsample_*, docs/metrics.md)

Run it::

    python examples/web_service.py --host 127.0.0.1 --port 8080
    curl -s -X POST localhost:8080/jobs -d '{"steps": 200000}'
    curl -sN localhost:8080/jobs/1/progress
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from asyncsample import EpisodeBatch, Sampler, SampleStats

DEFAULT_STEPS = 10_000
MAX_STEPS = 10**9
#: A job reports progress once per streamed batch of (at least) this many transitions.
PROGRESS_STEPS = 2_000
TERMINAL = ("done", "cancelled", "failed")


def _finite(value: Any) -> Any:
    """JSON has no NaN: missing figures (no episode finished yet) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class Job:
    """One sampling job: ``steps`` env steps of complete episodes, and what they gave."""

    def __init__(self, job_id: str, env: str, steps: int) -> None:
        self.id = job_id
        self.env = env
        self.steps = steps
        self.status = "queued"
        self.error: str | None = None
        self.created_at = time.time()
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.transitions = 0
        self.episodes = 0
        self.batches = 0
        self.restarts = 0
        self._return_sum = 0.0
        self._length_sum = 0
        self.max_return = -math.inf
        self.min_return = math.inf
        self.last_stats: SampleStats | None = None
        self.task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._t0 = time.perf_counter()

    def add(self, batch: EpisodeBatch, stats: SampleStats | None) -> None:
        returns = batch.returns
        self.transitions += batch.n_transitions
        self.episodes += batch.n_episodes
        self.batches += 1
        self._return_sum += float(returns.sum())
        self._length_sum += int(batch.lengths.sum())
        if len(returns):
            self.max_return = max(self.max_return, float(returns.max()))
            self.min_return = min(self.min_return, float(returns.min()))
        if stats is not None:
            self.restarts += stats.restarts
        self.last_stats = stats
        self.notify()

    def notify(self) -> None:
        """Wake every progress stream of this job."""
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def changed(self) -> asyncio.Event:
        """Set at the job's next change (progress or end)."""
        return self._changed

    def task_done(self, task: asyncio.Task[None]) -> None:
        """A job cancelled before its task ran never entered ``_run``: record it here."""
        if self.status not in TERMINAL:
            self.status = "cancelled" if task.cancelled() else "failed"
            self.finished_at = time.time()
            self.notify()

    def as_dict(self) -> dict[str, Any]:
        end = self.finished_at or time.time()
        seconds = end - self.started_at if self.started_at else 0.0
        stats = {
            "steps": self.transitions,
            "episodes": self.episodes,
            "batches": self.batches,
            "mean_return": self._return_sum / self.episodes if self.episodes else None,
            "max_return": _finite(self.max_return),
            "min_return": _finite(self.min_return),
            "mean_length": self._length_sum / self.episodes if self.episodes else None,
            "seconds": seconds,
            "steps_per_second": self.transitions / seconds if seconds > 0 else None,
            "restarts": self.restarts,
        }
        last = self.last_stats.as_dict() if self.last_stats is not None else None
        return {
            "id": self.id,
            "env": self.env,
            "requested_steps": self.steps,
            "status": self.status,
            "error": self.error,
            "progress": min(1.0, self.transitions / self.steps),
            "stats": stats,
            "last_batch": {k: _finite(v) for k, v in last.items()} if last else None,
        }


class JobRunner:
    """Starts jobs as tasks on the shared sampler and keeps their records."""

    def __init__(self, sampler: Sampler, env: str) -> None:
        self.sampler = sampler
        self.env = env
        self.jobs: dict[str, Job] = {}
        self._ids = itertools.count(1)

    def submit(self, steps: int) -> Job:
        job = Job(str(next(self._ids)), self.env, steps)
        self.jobs[job.id] = job
        job.task = asyncio.create_task(self._run(job), name=f"job-{job.id}")
        job.task.add_done_callback(job.task_done)
        return job

    async def _run(self, job: Job) -> None:
        try:
            # The stream holds the sampler until it is closed; other jobs' streams queue
            # behind it. A slow job never blocks the loop: the envs step in other processes.
            stream = self.sampler.stream(min(job.steps, PROGRESS_STEPS))
            async with contextlib.aclosing(stream) as batches:
                async for batch in batches:
                    if job.status == "queued":  # until the job's first batch arrives
                        job.status = "running"
                        job.started_at = time.time() - (
                            self.sampler.last_stats.seconds if self.sampler.last_stats else 0.0
                        )
                    job.add(batch, self.sampler.last_stats)
                    if job.transitions >= job.steps:
                        break
            job.status = "done"
        except asyncio.CancelledError:
            job.status = "cancelled"
            raise
        except Exception as exc:  # reported through the API; the service keeps running
            job.status = "failed"
            job.error = f"{type(exc).__name__}: {exc}"
        finally:
            job.finished_at = time.time()
            job.notify()

    def cancel(self, job: Job) -> None:
        if job.task is not None and not job.task.done():
            job.task.cancel()

    async def aclose(self) -> None:
        """Cancel every job that has not finished and wait for them."""
        tasks = [j.task for j in self.jobs.values() if j.task is not None and not j.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


SAMPLER = web.AppKey("sampler", Sampler)
JOBS = web.AppKey("jobs", JobRunner)
CONFIG: web.AppKey[dict[str, Any]] = web.AppKey("config", dict)
REGISTRY = web.AppKey("registry", CollectorRegistry)

routes = web.RouteTableDef()


def _job(request: web.Request) -> Job:
    job = request.app[JOBS].jobs.get(request.match_info["job_id"])
    if job is None:
        raise web.HTTPNotFound(
            text=json.dumps({"error": f"no job {request.match_info['job_id']!r}"}),
            content_type="application/json",
        )
    return job


def _bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps({"error": message}), content_type="application/json")


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    """The Prometheus text format, for a scraper (the sampler's registry only)."""
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


@routes.post("/jobs")
async def create_job(request: web.Request) -> web.Response:
    runner = request.app[JOBS]
    body: Any = {}
    if request.can_read_body:
        try:
            body = await request.json()
        except ValueError:
            raise _bad_request("the body must be JSON") from None
    if not isinstance(body, dict):
        raise _bad_request('the body must be a JSON object like {"steps": 10000}')
    env = body.get("env", runner.env)
    if env != runner.env:
        raise _bad_request(f"this service samples {runner.env!r}, not {env!r}")
    steps = body.get("steps", DEFAULT_STEPS)
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise _bad_request(f"steps must be an integer from 1 to {MAX_STEPS}, got {steps!r}")
    job = runner.submit(steps)
    return web.json_response(
        {"id": job.id, "status": job.status, "url": f"/jobs/{job.id}"}, status=202
    )


@routes.get("/jobs")
async def list_jobs(request: web.Request) -> web.Response:
    return web.json_response([j.as_dict() for j in request.app[JOBS].jobs.values()])


@routes.get("/jobs/{job_id}")
async def get_job(request: web.Request) -> web.Response:
    return web.json_response(_job(request).as_dict())


@routes.delete("/jobs/{job_id}")
async def cancel_job(request: web.Request) -> web.Response:
    job = _job(request)
    request.app[JOBS].cancel(job)
    if job.task is not None:
        await asyncio.gather(job.task, return_exceptions=True)
    return web.json_response(job.as_dict())


@routes.get("/jobs/{job_id}/progress")
async def job_progress(request: web.Request) -> web.StreamResponse:
    """Server-sent events: a ``progress`` event per batch, then one ``end`` event."""
    job = _job(request)
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    try:
        while True:
            changed = job.changed  # taken before reading the state, so no change is missed
            state = job.as_dict()
            event = "end" if job.status in TERMINAL else "progress"
            await response.write(f"event: {event}\ndata: {json.dumps(state)}\n\n".encode())
            if event == "end":
                break
            await changed.wait()
        await response.write_eof()
    except ConnectionResetError:  # the client went away
        pass
    return response


@routes.get("/stats")
async def stats(request: web.Request) -> web.Response:
    sampler = request.app[SAMPLER]
    jobs = request.app[JOBS].jobs.values()
    last = sampler.last_stats.as_dict() if sampler.last_stats is not None else None
    totals = request.app[CONFIG].copy()
    totals["total_env_steps"] = sampler.total_env_steps
    totals["restarts"] = sampler.restarts
    totals["last_stats"] = {k: _finite(v) for k, v in last.items()} if last else None
    totals["jobs"] = {s: sum(j.status == s for j in jobs) for s in ("queued", "running", *TERMINAL)}
    return web.json_response(totals)


def create_app(
    *,
    env: str = "CartPole-v1",
    n_workers: int = 2,
    envs_per_worker: int = 8,
    n_processes: int | None = None,
    backend: str = "process",
    seed: int | None = None,
) -> web.Application:
    """The service: one sampler (a random agent) for the app's lifetime."""
    app = web.Application()
    app.add_routes(routes)
    app[CONFIG] = {
        "env": env,
        "backend": backend,
        "n_workers": n_workers,
        "envs_per_worker": envs_per_worker,
    }

    # The app's own registry: several apps in one process (tests) keep their figures apart.
    app[REGISTRY] = CollectorRegistry()

    async def sampler_ctx(app: web.Application) -> AsyncIterator[None]:
        sampler = Sampler(
            env,
            n_workers=n_workers,
            envs_per_worker=envs_per_worker,
            n_processes=n_processes,
            backend=backend,
            seed=seed,
            metrics=app[REGISTRY],
        )
        await sampler.start()  # env hosts up before the first request
        app[SAMPLER] = sampler
        app[JOBS] = JobRunner(sampler, env)
        try:
            yield
        finally:
            await app[JOBS].aclose()
            await sampler.aclose()  # no env-host process outlives the app

    async def cancel_jobs(app: web.Application) -> None:
        # on_shutdown runs before aiohttp waits for open requests: ending the jobs ends their
        # progress streams, so shutdown does not wait for a long job.
        if JOBS in app:
            await app[JOBS].aclose()

    app.cleanup_ctx.append(sampler_ctx)
    app.on_shutdown.append(cancel_jobs)
    return app


async def serve(app: web.Application, host: str, port: int) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then shut down cleanly."""
    runner = web.AppRunner(app, shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        for address in runner.addresses:
            print(f"serving on http://{address[0]}:{address[1]}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print("shutting down", flush=True)
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs-per-worker", type=int, default=8)
    parser.add_argument("--processes", type=int, default=None)
    parser.add_argument("--backend", default="process", choices=["process", "local", "ray"])
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    app = create_app(
        env=args.env,
        n_workers=args.workers,
        envs_per_worker=args.envs_per_worker,
        n_processes=args.processes,
        backend=args.backend,
        seed=args.seed,
    )
    uvloop.run(serve(app, args.host, args.port))


if __name__ == "__main__":  # run when executed, not when imported (the tests import it)
    main()
