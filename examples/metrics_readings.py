"""Three runs that the metrics should tell apart: env-bound, agent-bound, caller-bound.

Each run samples CartPole-v1 on the ``process`` backend (2 workers x 4 envs, 2 env hosts) with
``Sampler(metrics=registry)`` and prints what a dashboard would show, read from the registry
through ``prometheus_client``'s own text format and parser:

- **env-bound**: every env step sleeps 2 ms (a slow simulator); a random agent;
- **agent-bound**: a policy that takes 4 ms per call (a slow policy server); plain CartPole;
- **caller-bound**: plain CartPole streamed (``Sampler.stream``), the consumer holding each
  batch 0.5 s (a trainer busy with its update).

The tables of ``docs/metrics.md`` come from this script. Run it::

    python examples/metrics_readings.py            # ~15 s
    python examples/metrics_readings.py --quick    # a smoke run (the test's)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
from typing import Any

import gymnasium as gym
import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from asyncsample import Sampler


class SlowCartPole(gym.Wrapper[Any, Any, Any, Any]):
    """CartPole whose every step blocks ``delay`` seconds (a slow simulator)."""

    def __init__(self, delay: float) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.delay = delay

    def step(self, action: Any) -> Any:
        time.sleep(self.delay)
        return self.env.step(action)


class SlowPolicy:
    """Random CartPole actions after ``delay`` seconds per call (a slow policy server)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.rng = np.random.default_rng(0)

    def get_actions(self, observations: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        time.sleep(self.delay)
        return self.rng.integers(0, 2, len(observations)), {}


def read(registry: CollectorRegistry) -> dict[str, float]:
    """The registry's asyncsample samples as a scraper sees them: ``name{labels}`` -> value,
    plus each sample name's sum over its label sets."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "backend")
            out[f"{s.name}{{{labels}}}"] = s.value
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def quantile(m: dict[str, float], name: str, q: float) -> float:
    """The upper bound of the bucket holding quantile ``q`` of histogram ``name``."""
    total = m.get(f"{name}_count", 0.0)
    buckets = sorted(
        (float(key.split('le="')[1].rstrip('"}')), v)
        for key, v in m.items()
        if key.startswith(f"{name}_bucket{{") and 'le="+Inf"' not in key
    )
    for bound, cumulative in buckets:
        if cumulative >= q * total:
            return bound
    return float("inf")


def mean(m: dict[str, float], name: str) -> float:
    count = m.get(f"{name}_count", 0.0)
    return m.get(f"{name}_sum", 0.0) / count if count else float("nan")


async def run(kind: str, calls: int, steps: int) -> dict[str, Any]:
    registry = CollectorRegistry()
    env: Any = "CartPole-v1"
    agent: Any = None
    if kind == "env-bound":
        env = functools.partial(SlowCartPole, 0.002)
    elif kind == "agent-bound":
        agent = SlowPolicy(0.004)
    sampler = Sampler(
        env, agent, n_workers=2, envs_per_worker=4, n_processes=2, seed=0, metrics=registry
    )
    start = time.perf_counter()
    async with sampler:
        await sampler.start()
        start = time.perf_counter()
        if kind == "caller-bound":
            seen = 0
            async for _ in sampler.stream(steps, fragments=True, buffer_size=1):
                seen += 1
                if seen == calls:
                    break
                await asyncio.sleep(0.5)  # the trainer's update
        else:
            for _ in range(calls):
                await sampler.obtain_fragments(steps)
        seconds = time.perf_counter() - start
        assert sampler.metrics is not None
        verdict, shares = sampler.metrics.verdict, dict(sampler.metrics.shares)
        m = read(registry)
    return {"kind": kind, "seconds": seconds, "verdict": verdict, "shares": shares, "m": m}


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        ("`bottleneck` (side = 1)", lambda r: f"**{r['verdict']}**"),
        (
            "envs busy / agent busy / caller idle",
            lambda r: "{env:.0%} / {agent:.0%} / {caller:.0%}".format(**r["shares"]),
        ),
        (
            "`env_steps_total` per second",
            lambda r: f"{r['m']['asyncsample_env_steps_total'] / r['seconds']:,.0f}",
        ),
        (
            "`env_step_seconds` mean",
            lambda r: f"{mean(r['m'], 'asyncsample_env_step_seconds') * 1e6:,.0f} us",
        ),
        (
            "`env_step_seconds` p99 (bucket)",
            lambda r: f"<= {quantile(r['m'], 'asyncsample_env_step_seconds', 0.99) * 1e3:g} ms",
        ),
        ("`agent_calls_total`", lambda r: f"{r['m']['asyncsample_agent_calls_total']:,.0f}"),
        (
            "`agent_call_seconds` mean",
            lambda r: f"{mean(r['m'], 'asyncsample_agent_call_seconds') * 1e6:,.0f} us",
        ),
        ("`agent_call_rows` mean", lambda r: f"{mean(r['m'], 'asyncsample_agent_call_rows'):.1f}"),
        (
            "`call_wait_seconds` mean",
            lambda r: f"{mean(r['m'], 'asyncsample_call_wait_seconds') * 1e3:,.1f} ms",
        ),
        ("`episodes_total`", lambda r: f"{r['m']['asyncsample_episodes_total']:,.0f}"),
        (
            "`episode_seconds` mean",
            lambda r: f"{mean(r['m'], 'asyncsample_episode_seconds') * 1e3:,.1f} ms",
        ),
        ("`episodes_in_flight`", lambda r: f"{r['m']['asyncsample_episodes_in_flight']:.0f}"),
    ]
    head = "| metric | " + " | ".join(r["kind"] for r in results) + " |"
    lines = [head, "|" + "---|" * (len(results) + 1)]
    for label, cell in rows:
        lines.append(f"| {label} | " + " | ".join(cell(r) for r in results) + " |")
    return "\n".join(lines)


async def main(quick: bool) -> None:
    calls, steps = (3, 200) if quick else (8, 800)
    results = [
        await run(kind, calls, steps) for kind in ("env-bound", "agent-bound", "caller-bound")
    ]
    print(table(results))
    for r in results:
        print(f"{r['kind']}: bottleneck={r['verdict']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, smaller calls")
    asyncio.run(main(parser.parse_args().quick))
