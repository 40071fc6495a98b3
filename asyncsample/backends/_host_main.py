"""The env-host process: a plain blocking loop that serves one frame at a time.

Started by :mod:`asyncsample.backends.process` through a forkserver, with the host's end of a
socket pair, the specs of the worker slots it hosts and their shared step buffers. It reads a
request, runs the matching :class:`~asyncsample.env_group.EnvGroup` method for that slot, and
replies. Nothing here runs an event loop or a thread.

The loop ends on an ``exit`` request or at end of stream (the parent closed its end or died).
If the main process dies while an env hangs, the kernel kills the host (see
:func:`_die_with_parent`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import multiprocessing
import os
import pickle
import select
import signal
import socket
import sys
from typing import Any

import numpy as np

from asyncsample.backends._chunk import ChunkBuffers, ChunkRunner
from asyncsample.backends._transport import (
    HELLO_ID,
    OP_AGENT,
    OP_BUILD,
    OP_CALL,
    OP_CHUNK,
    OP_CLOSE,
    OP_EXIT,
    OP_PARAMS,
    OP_RESET,
    OP_RESET_ARGS,
    OP_SET_ATTR,
    OP_STEP,
    OP_UPDATE,
    SLOT,
    ST_FAIL,
    ST_OK,
    FrameReader,
    dump_failure,
    dumps,
    failure_from_exception,
    send_frame,
    view_buffers,
)
from asyncsample.env_group import EnvFailureError, EnvGroup

__all__ = ["main"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the main process dies, even if an env hangs.

    The host's parent is the forkserver, not the main process, and the forkserver outlives the
    main process for as long as any of its children run; so ``PR_SET_PDEATHSIG`` alone would not
    do. ``multiprocessing`` hands every child a "parent sentinel": the read end of a pipe whose
    write end only the main process holds, at end of file when it dies. With ``O_ASYNC`` and
    ``F_SETSIG`` the kernel turns that end of file into a SIGKILL, with no thread and nothing in
    the hot path. ``PR_SET_PDEATHSIG`` covers the death of the forkserver itself.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the forkserver died before prctl took effect
            os._exit(1)
    try:
        sentinel = multiprocessing.parent_process().sentinel  # type: ignore[union-attr]
        fcntl.fcntl(sentinel, fcntl.F_SETOWN, os.getpid())
        fcntl.fcntl(sentinel, fcntl.F_SETSIG, signal.SIGKILL)
        flags = fcntl.fcntl(sentinel, fcntl.F_GETFL)
        fcntl.fcntl(sentinel, fcntl.F_SETFL, flags | os.O_ASYNC)
    except (AttributeError, OSError, ValueError):
        return
    if select.select([sentinel], [], [], 0)[0]:  # the main process died before we got here
        os._exit(1)


def _isolate() -> None:
    """Own process group (so the whole tree can be killed at once, even orphans), no ^C."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _kill_descendants() -> None:
    """Kill whatever processes the envs started and left behind."""
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
    except Exception:  # best effort on the way out
        return
    for child in children:
        with contextlib.suppress(Exception):
            child.kill()


def main(
    sock: socket.socket,
    slots_blob: bytes,
    raw_buffers: list[list[Any]],
    raw_chunks: list[tuple[int, list[Any]] | None] | None = None,
) -> None:
    """Serve requests for the worker slots in ``slots_blob`` until told to exit or orphaned.

    Args:
        sock: the host's end of the control socket pair (blocking).
        slots_blob: pickled list of ``(worker, n_envs, observation_space, action_space,
            max_episode_length, autoreset)``, one per slot.
        raw_buffers: per slot, the shared blocks of its step buffers (see
            :func:`~asyncsample.backends._transport.shared_buffers`).
        raw_chunks: per slot, ``(capacity, blocks)`` of its chunk buffers when the slot runs
            its own agent (``inference="host"``), else ``None``.
    """
    _die_with_parent()
    _isolate()
    # What the forkserver imported is shared copy-on-write; keep the collector from touching
    # (and so copying) all of it at its first full collection.
    gc.freeze()
    sock.setblocking(True)
    slots = pickle.loads(slots_blob)
    groups: list[EnvGroup] = []
    runners: list[ChunkRunner | None] = []
    chunks = raw_chunks or [None] * len(slots)
    for (worker, n_envs, obs_space, act_space, max_len, autoreset), raw, raw_chunk in zip(
        slots, raw_buffers, chunks
    ):
        buffers = view_buffers(obs_space, act_space, n_envs, raw)
        group = EnvGroup(worker, buffers, obs_space, act_space, max_len, autoreset)
        groups.append(group)
        runner = None
        if raw_chunk is not None:
            capacity, blocks = raw_chunk
            flat = view_buffers(obs_space, act_space, capacity * n_envs, blocks)
            runner = ChunkRunner(group, ChunkBuffers.from_flat(flat, capacity, n_envs), act_space)
        runners.append(runner)
    reader = FrameReader(sock)
    try:
        send_frame(sock, HELLO_ID, ST_OK)
        _serve(sock, reader, groups, runners)
    except (BrokenPipeError, ConnectionError):
        pass  # the parent went away: nothing left to answer
    finally:
        for group in groups:
            group.close()
        reader.close()
        sock.close()
        _kill_descendants()


def _serve(
    sock: socket.socket,
    reader: FrameReader,
    groups: list[EnvGroup],
    runners: list[ChunkRunner | None],
) -> None:
    unpack_slot = SLOT.unpack_from
    slot_size = SLOT.size
    while True:
        frame = reader.read()
        if frame is None:
            return
        rid, op, payload = frame
        if op == OP_EXIT:
            return
        try:
            slot = unpack_slot(payload)[0]
            group = groups[slot]
            if op == OP_CHUNK:
                reply = _runner(runners, slot).run(pickle.loads(payload[slot_size:]))
                send_frame(sock, rid, ST_OK, dumps(reply))
            elif op == OP_STEP:
                infos = group.step(np.frombuffer(payload, np.bool_, offset=slot_size))
                if infos.env_infos is None and not infos.reset_infos:
                    send_frame(sock, rid, ST_OK)
                else:
                    send_frame(sock, rid, ST_OK, dumps((infos.env_infos, infos.reset_infos)))
            elif op == OP_RESET:
                mask = np.frombuffer(payload, np.bool_, offset=slot_size)
                reset_infos = group.reset(mask)
                if runners[slot] is not None:
                    _runner(runners, slot).reset_agent(mask)
                send_frame(sock, rid, ST_OK, dumps(reset_infos) if reset_infos else b"")
            elif op == OP_BUILD:
                chains, seeds = _load_sources(payload[slot_size:])
                group.build(chains, seeds)
                send_frame(sock, rid, ST_OK)
            elif op == OP_UPDATE:
                updates, seeds = _load_sources(payload[slot_size:])
                group.update(updates, seeds)
                send_frame(sock, rid, ST_OK)
            elif op == OP_CALL:
                name, args, kwargs, envs = pickle.loads(payload[slot_size:])
                results = group.call(name, args, kwargs, envs)
                send_frame(sock, rid, ST_OK, dumps(results))
            elif op == OP_SET_ATTR:
                name, values, envs = pickle.loads(payload[slot_size:])
                group.set_attr(name, values, envs)
                send_frame(sock, rid, ST_OK)
            elif op == OP_RESET_ARGS:
                end = slot_size + group.n_envs
                seeds, options = pickle.loads(payload[end:])
                mask = np.frombuffer(payload[slot_size:end], np.bool_)
                reset_infos = group.reset(mask, seeds, options)
                if runners[slot] is not None:
                    _runner(runners, slot).reset_agent(mask)
                send_frame(sock, rid, ST_OK, dumps(reset_infos) if reset_infos else b"")
            elif op == OP_AGENT:
                _runner(runners, slot).install(payload[slot_size:])
                send_frame(sock, rid, ST_OK)
            elif op == OP_PARAMS:
                _runner(runners, slot).set_params(payload[slot_size:])
                send_frame(sock, rid, ST_OK)
            elif op == OP_CLOSE:
                group.close()
                send_frame(sock, rid, ST_OK)
            else:
                raise ValueError(f"unknown request opcode {op}")
        except EnvFailureError as exc:
            send_frame(sock, rid, ST_FAIL, dump_failure(exc.failure))
        except (BrokenPipeError, ConnectionError):
            raise
        except Exception as exc:
            # Env sources that cannot be unpickled here (a module missing in this process),
            # infos that cannot be pickled: deterministic, so not worth a restart.
            send_frame(sock, rid, ST_FAIL, failure_from_exception(exc, retry=False))


def _runner(runners: list[ChunkRunner | None], slot: int) -> ChunkRunner:
    runner = runners[slot]
    if runner is None:
        raise RuntimeError("this env host was not started for inference='host'")
    return runner


def _load_sources(blob: bytes) -> tuple[Any, Any]:
    sources, seeds = pickle.loads(blob)
    return sources, seeds
