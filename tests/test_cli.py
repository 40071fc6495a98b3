"""The ``asyncsample`` command line, run as a user runs it: in a child process, checking its exit
status, that errors are one line on stderr without a traceback, and that Ctrl-C prints what was
sampled so far and leaves no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import gymnasium as gym
import numpy as np
import psutil
import pytest
from helpers import default_sigint, new_shm_entries, python_env, shm_entries, wait_gone

from asyncsample.cli import CALLS, MAX_CALL_BYTES, MAX_CHUNK, RUN_STEPS, call_size, main

pytestmark = pytest.mark.timeout(120)

CLI = [sys.executable, "-m", "asyncsample.cli"]


def start_run(args: list[str]) -> subprocess.Popen[bytes]:
    """``asyncsample ARGS`` in a child process with pipes, as a user's shell would start it
    (SIGINT at its default action, so Ctrl-C reaches it)."""
    return subprocess.Popen(
        CLI + args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=python_env(),
        preexec_fn=default_sigint,
    )


def read_until_sampling(proc: subprocess.Popen[bytes]) -> bytes:
    """The child's stderr up to its progress bar's first count of completed episodes (the
    hosts run and steps count); fails if the command ends before."""
    assert proc.stderr is not None
    seen = b""
    while b"episodes=" not in seen:
        chunk = os.read(proc.stderr.fileno(), 4096)
        assert chunk, f"the command ended before sampling: {seen.decode(errors='replace')}"
        seen += chunk
    return seen


REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """``asyncsample *args`` in a fresh interpreter; ``prelude`` runs first (to simulate a
    missing package or register an env)."""
    command = CLI + list(args)
    if prelude:
        code = f"{prelude}\nimport sys\nfrom asyncsample.cli import main\nsys.exit(main())"
        command = [sys.executable, "-c", code, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=100, env=python_env())


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``asyncsample *args`` in this process (a fresh interpreter costs a second or more): what
    it printed and its exit status, as :func:`run_cli` gives them."""
    try:
        status = main(list(args))
    except SystemExit as exited:
        status = exited.code if isinstance(exited.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), status, out, err)


def error_lines(stderr: str) -> list[str]:
    """The lines of ``stderr`` that are not the start-up note or progress-bar updates."""
    lines = re.split(r"[\r\n]+", stderr)
    return [ln for ln in lines if ln.strip() and "step/s" not in ln and "it/s" not in ln
            and not ln.startswith("sampling ") and "?step" not in ln]  # fmt: skip


def assert_one_line_error(done: subprocess.CompletedProcess[str], status: int, *words: str) -> None:
    assert done.returncode == status, done.stderr
    assert "Traceback" not in done.stderr
    lines = error_lines(done.stderr)
    assert len(lines) == 1, lines
    assert re.match(r"asyncsample( run)?: error: ", lines[0]), lines
    for word in words:
        assert word in lines[0]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["No-Such-Env-v9"], ["No-Such-Env-v9"]),
        (["--workers", "0"], ["--workers", ">= 1", "0"]),
        (["--envs-per-worker", "-3"], ["--envs-per-worker", "-3"]),
        (["--steps", "abc"], ["--steps", "integer", "abc"]),
        (["--steps", "0"], ["--steps", "0"]),
        (["--seed", "-1"], ["--seed", ">= 0", "-1"]),
        (["--processes", "1.5"], ["--processes", "1.5"]),
        (["--backend", "gpu"], ["--backend", "gpu", "process"]),
        # asyncio steps async envs only, which no gymnasium id makes: not offered.
        (["--backend", "asyncio"], ["--backend", "asyncio", "thread"]),
        (["--no-such-option"], ["--no-such-option"]),
        (["--metrics-port", "70000"], ["--metrics-port", "0 to 65535", "70000"]),
        (["--metrics-port", "-1"], ["--metrics-port", "0 to 65535", "-1"]),
        # A TEST-NET-1 address (RFC 5737): never one of this machine's.
        (["--metrics-port", "0", "--metrics-addr", "192.0.2.1"], ["--metrics-addr", "192.0.2.1"]),
    ],
)
def test_usage_errors_are_one_line_and_status_2(
    args: list[str], words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # In this process (a fresh interpreter per case costs seconds); the next test checks the
    # exit status of the real command.
    local = [] if "--backend" in args else ["--backend", "local"]
    with pytest.raises(SystemExit) as exited:
        main(["run", *args, *local])
    out, err = capsys.readouterr()
    done = subprocess.CompletedProcess(args, exited.value.code, out, err)
    assert_one_line_error(done, 2, *words)
    assert out == ""


def test_a_metrics_port_in_use_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        with pytest.raises(SystemExit) as exited:
            main(["run", "--backend", "local", "--steps", "10", "--metrics-port", port])
    out, err = capsys.readouterr()
    done = subprocess.CompletedProcess([], exited.value.code, out, err)
    assert_one_line_error(done, 2, f"--metrics-port {port}", "already in use")


def test_no_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([])
    out, err = capsys.readouterr()
    done = subprocess.CompletedProcess([], exited.value.code, out, err)
    assert_one_line_error(done, 2, "expected a command", "run", "bench")


def test_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["run", "--help"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        out, _ = capsys.readouterr()
        assert exited.value.code == 0
        assert "exit status: 0 done, 1 runtime error, 2 usage error" in " ".join(out.split())
        assert "``" not in out and ":class:" not in out and ":meth:" not in out


def test_the_thread_backend_samples_a_gymnasium_id(capsys: pytest.CaptureFixture[str]) -> None:
    """thread, offered for a gymnasium id, steps its blocking envs in a pool of threads."""
    assert main(["run", "--backend", "thread", "--steps", "300", "--workers", "2"]) == 0
    out, _ = capsys.readouterr()
    assert (
        "ran:          backend thread, inference per_worker (auto: the envs live in this "
        "process, beside the agent), 2 workers x 8 envs in this process"
    ) in " ".join(out.split("\n"))
    assert int(re.search(r"steps:\s+(\d+)", out).group(1)) >= 300  # type: ignore[union-attr]


def test_usage_error_of_the_command_is_status_2() -> None:
    done = run_cli("run", "No-Such-Env-v9", "--backend", "local")
    assert_one_line_error(done, 2, "No-Such-Env-v9")
    assert done.stdout == ""


def test_missing_optional_dependency_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # sys.modules[name] = None makes `import ray` fail as if ray were not installed.
    monkeypatch.setitem(sys.modules, "ray", None)
    done = run_main(capsys, "run", "--backend", "ray", "--steps", "10")
    assert_one_line_error(done, 2, "--backend ray", "pip install 'asyncsample[ray]'")


def test_runtime_error_is_one_line_and_status_1() -> None:
    prelude = (
        "import gymnasium\n"
        "gymnasium.register('AlwaysFailing-v0', entry_point='envs:AlwaysFailingEnv')"
    )
    done = run_cli(
        "run", "AlwaysFailing-v0", "--backend", "local", "--steps", "100", prelude=prelude
    )
    assert_one_line_error(done, 1, "WorkerError", "this env always fails")
    assert "Remote traceback" not in done.stderr


@pytest.mark.slow  # a fresh interpreter; test_runtime_error_is_one_line_and_status_1 runs one
def test_verbose_prints_each_restart_before_the_error() -> None:
    prelude = (
        "import gymnasium\n"
        "gymnasium.register('AlwaysFailing-v0', entry_point='envs:AlwaysFailingEnv')"
    )
    done = run_cli(
        "run", "AlwaysFailing-v0", "--backend", "local", "--steps", "100", "--verbose",
        "--workers", "1", prelude=prelude,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    restarts = [ln for ln in error_lines(done.stderr) if "restarting its env host" in ln]
    # One warning per restart: the default budget is 3 restarts per worker and call.
    assert len(restarts) == 3, done.stderr
    assert all(ln.startswith("asyncsample: WARNING: worker 0") for ln in restarts)
    assert error_lines(done.stderr)[-1].startswith("asyncsample run: error: WorkerError")


@pytest.mark.slow  # a fresh interpreter; test_runtime_error_is_one_line_and_status_1 runs one
def test_debug_shows_the_traceback_of_a_runtime_error() -> None:
    prelude = (
        "import gymnasium\n"
        "gymnasium.register('AlwaysFailing-v0', entry_point='envs:AlwaysFailingEnv')"
    )
    done = run_cli(
        "run", "AlwaysFailing-v0", "--backend", "local", "--steps", "100", "--debug",
        prelude=prelude,
    )  # fmt: skip
    assert done.returncode == 1
    assert "Traceback" in done.stderr
    assert done.stderr.rstrip().splitlines()[-1].startswith("asyncsample run: error: WorkerError")


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    done = run_main(capsys, "run", "--help")
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())
    for default in [
        "(default: CartPole-v1)",
        "(default: 200000)",
        "(default: 4)",
        "(default: 8)",
        "(default: process)",
        "(default: 0)",
        "130 interrupted",
    ]:
        assert default in out, default


def test_a_short_run_prints_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    done = run_main(capsys, "run", "--backend", "local", "--steps", "500", "--workers", "2")
    assert done.returncode == 0, done.stderr
    steps = int(re.search(r"steps:\s+(\d+)", done.stdout).group(1))  # type: ignore[union-attr]
    assert steps >= 500
    assert re.search(r"episodes:\s+[1-9]\d* completed", done.stdout)
    # The backend, the inference mode and the placement that ran.
    ran = (
        "ran:          backend local, inference per_worker (auto: the envs live in this process, "
        "beside the agent), 2 workers x 8 envs in this process"
    )
    assert ran in " ".join(done.stdout.split("\n"))


@pytest.mark.slow  # a fresh interpreter or a deliberate wait: CI runs it with -m slow
def test_ctrl_c_prints_the_summary_so_far_and_leaves_nothing_running() -> None:
    before_shm = shm_entries()
    args = ["run", "--backend", "process", "--processes", "2", "--workers", "2",
            "--envs-per-worker", "2", "--steps", str(10**9)]  # fmt: skip
    proc = start_run(args)
    assert proc.stderr is not None
    try:
        seen = read_until_sampling(proc)  # the hosts run and steps count
        children = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert children  # env hosts (and multiprocessing's helpers)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = stdout.decode()
    assert proc.returncode == 130, (seen + stderr).decode(errors="replace")
    assert "Traceback" not in stderr.decode()
    steps = int(re.search(r"steps:\s+(\d+)", text).group(1))  # type: ignore[union-attr]
    assert steps > 0
    assert re.search(r"episodes:\s+[1-9]\d* completed", text)
    assert "interrupted" in stderr.decode()
    assert wait_gone(children) == [], "processes outlived the interrupted command"
    assert new_shm_entries(before_shm) == []


def test_a_run_with_metrics_prints_the_bottleneck() -> None:
    done = run_cli("run", "--backend", "local", "--steps", "2000", "--metrics-port", "0")
    assert done.returncode == 0, done.stderr
    assert re.search(r"metrics on http://127\.0\.0\.1:\d+/metrics", done.stderr)
    found = re.search(r"bottleneck:\s+(env|agent|caller) \(", done.stdout)
    assert found, done.stdout
    assert "envs busy" in done.stdout and "caller idle" in done.stdout


def test_metrics_port_without_the_extra_is_a_usage_error() -> None:
    done = run_cli(
        "run",
        "--steps",
        "10",
        "--metrics-port",
        "0",
        prelude="import sys; sys.modules['prometheus_client'] = None",
    )
    assert_one_line_error(done, 2, "prometheus_client", "asyncsample[metrics]")


@pytest.mark.slow  # a fresh interpreter and a deliberate wait: CI runs it with -m slow
def test_metrics_are_served_while_the_run_goes() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    args = ["run", "--backend", "process", "--processes", "2", "--workers", "2",
            "--envs-per-worker", "2", "--steps", str(10**9), "--metrics-port", "0"]  # fmt: skip
    proc = start_run(args)
    assert proc.stderr is not None

    def steps(url: str) -> float:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "asyncsample_env_steps_total"
        )

    try:
        seen = read_until_sampling(proc)
        found = re.search(rb"metrics on (http://\S+/metrics)", seen)
        assert found, seen
        url = found.group(1).decode()
        first = steps(url)
        second = first
        deadline = time.monotonic() + 60  # the run folds its counts once per call
        while second <= first and time.monotonic() < deadline:
            time.sleep(0.2)
            second = steps(url)
        assert second > first > 0  # the counter moves while the run goes
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr.decode(errors="replace")
    assert re.search(r"bottleneck:\s+(env|agent|caller) \(", stdout.decode()), stdout.decode()


# ------------------------------------------------------------------------------------------------
# asyncsample bench


def run_bench(
    *args: str, prelude: str = "", timeout: float = 100
) -> subprocess.CompletedProcess[str]:
    """``asyncsample bench *args`` from the repository root, in a fresh interpreter."""
    code = f"{prelude}\nimport sys\nfrom asyncsample.cli import main\nsys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=python_env(),
        cwd=REPO,
    )


def test_bench_list_names_every_study_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(REPO))
    from benchmarks.studies import STUDIES

    done = run_main(capsys, "bench", "--list")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert [ln.split()[0] for ln in lines] == [s.name for s in STUDIES]
    assert all("min" in ln for ln in lines)  # each with the length of its default budget


def test_bench_unknown_study_is_one_line_and_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    done = run_main(capsys, "bench", "no-such-study")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "no study 'no-such-study'" in done.stderr and "policy" in done.stderr


def test_bench_plan_prints_the_runs_and_the_estimated_length(
    capsys: pytest.CaptureFixture[str],
) -> None:
    done = run_main(capsys, "bench", "host", "--plan")
    assert done.returncode == 0, done.stderr
    assert re.search(r"host: groups ideal, host; \d+ configs x 3 repeats = \d+ runs", done.stderr)
    assert "about" in done.stderr and "min" in done.stderr
    assert "ceiling" in done.stderr and "host 4x2/P2" in done.stderr


@pytest.mark.slow  # a study's quick run in a fresh interpreter
@pytest.mark.timeout(300)
def test_bench_without_matplotlib_writes_its_results_and_says_the_charts_were_skipped(
    tmp_path: Path,
) -> None:
    """Issue 21: ``pip install .`` has no matplotlib; the run must not die after measuring."""
    done = run_bench(
        "overhead", "--quick", "--contenders", "sync", "--no-progress", "--out", str(tmp_path),
        prelude="import sys; sys.modules['matplotlib'] = None  # as if not installed",
        timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "charts skipped: matplotlib is not installed" in done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["study"] == "overhead"
    assert any(r.get("rate") for r in results["runs"])
    assert (tmp_path / "results.md").read_text().startswith("# asyncsample benchmarks")
    assert not list(tmp_path.glob("*.png"))


def test_the_default_run_shows_the_inference_mode_it_chose(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The README's run: process hosts and the built-in random agent, which runs in the hosts.
    done = run_main(capsys, "run", "--steps", "2000", "--workers", "2")
    assert done.returncode == 0, done.stderr
    ran = (
        "ran:          backend process, inference host (auto: the built-in RandomAgent runs in "
        "the env hosts, a chunk of steps per request), 2 workers x 8 envs on"
    )
    assert ran in done.stdout


def test_run_asks_for_its_steps_in_a_few_calls_of_bounded_bytes() -> None:
    cartpole = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    frames = gym.spaces.Box(0, 255, (210, 160, 3), np.uint8)
    # The README's run: 16 calls of 12,500 steps (4,000 before: its hosts waited between calls).
    assert call_size(RUN_STEPS, 32, cartpole) == RUN_STEPS // CALLS == 12_500
    assert call_size(10**9, 32, cartpole) == MAX_CHUNK
    # Raw frames: a call holds at most MAX_CALL_BYTES of observations.
    assert call_size(RUN_STEPS, 8, frames) == MAX_CALL_BYTES // (210 * 160 * 3) == 665
    # At least one step of every env; a space without a fixed shape has no byte cap.
    assert call_size(100, 32, cartpole) == 32
    assert call_size(RUN_STEPS, 32, gym.spaces.Text(10)) == 12_500
