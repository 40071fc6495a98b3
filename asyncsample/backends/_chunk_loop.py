"""The chunk loop of an env host (``inference="host"``): :class:`ChunkRunner` runs one slot's
chunks with its agent copy; :func:`run_joint` runs the chunks of several slots side by side, one
agent call a step for all.

With ``inference="host"`` every worker's slot holds a copy of the agent. Where several workers
share one agent and their copies act alike on any rows (:attr:`ChunkRunner.copy_key`, see
:func:`~asyncsample.backends._chunk.alike_key`), a host that has the chunk requests of several
such slots at hand runs them together: each step, every slot's rows go to one ``get_actions``
call, whose output is checked once (slots of one action space, an output without agent infos)
or per slot, and split back by rows. Per step that is one forward pass instead of one per
worker: what a policy costs in a host is mostly its per-call overhead (a torch MLP on 4 rows or
on 16 takes about the same time).

An agent whose actions depend only on its input gives the same actions either way, so the
batches do not change. A copy that cannot act alike (a seeded stochastic agent, a recurrent
one) keeps its own call. Each slot's chunk keeps its own rule, reply and faults: a slot whose
env fails leaves the others running; an error of the merged call fails the chunk of every slot
in it, and each row it failed (:class:`~asyncsample.AgentRowsError`) is its own slot's fault.
An output that is not a row per input row is not split: each slot then asks its own copy, so
that the error reads as it would alone.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Generator, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from asyncsample._action_check import (
    ARRAY_SPACES,
    AgentOutputCheck,
    Check,
    check_actions,
    make_action_check,
)
from asyncsample._engine import CallMode, StopRule
from asyncsample._infos import snapshot
from asyncsample._recorder import put_row, row_of
from asyncsample._tree import Tree, tree_concat, tree_leaves, tree_map
from asyncsample.agent import RandomAgent, trusted_actions
from asyncsample.backends._chunk import (
    ChunkBuffers,
    ChunkReply,
    ChunkRequest,
    NextChunk,
    agent_error,
    alike_key,
    install_agent,
    params_key,
    set_agent_params,
)
from asyncsample.env_group import EnvFailure, EnvFailureError, EnvGroup
from asyncsample.errors import AgentRowsError

__all__ = ["ChunkRunner", "ChunkSteps", "run_joint", "split_output"]


ChunkSteps = Generator[Tree, tuple[Tree, dict[str, np.ndarray]], ChunkReply]
"""A chunk's steps (:meth:`ChunkRunner.begin`): yields observations, is sent actions."""


class ChunkRunner:
    """One worker slot's agent copy and chunk loop over its ``group`` of envs, into its sets of
    ``chunks``; actions are checked against ``action_space``."""

    def __init__(
        self, group: EnvGroup, chunks: list[ChunkBuffers], action_space: gym.Space[Any]
    ) -> None:
        self.group = group
        self.chunks = chunks
        self.chunk = chunks[0]
        self.action_space = action_space
        # After a chunk that ran to its end: its rule, active and counts (see NextChunk).
        self._state: tuple[StopRule, np.ndarray, np.ndarray] | None = None
        self._next_row = -1  # the arena row of the next chunk's observations (NextChunk)
        self._ready_row = -1  # the arena row that holds the current observations, or -1
        self._own = group.buffers.obs  # the group's own observation buffer (see settle)
        self.agent: Any = None
        self._output_check = AgentOutputCheck(group.worker, group.n_envs)
        self._action_check = make_action_check(action_space)
        self._trusted = False
        self._agent_key: bytes | None = None
        self.copy_key: bytes | None = None
        """Equal for the slots whose agent copies act alike on any rows (see
        :func:`~asyncsample.backends._chunk.alike_key`): one call may serve them all
        (:func:`run_joint`). ``None``: a copy of its own."""

    @property
    def going(self) -> bool:
        """Whether the last chunk left its part going on (the worker asks for the next)."""
        state = self._state
        return state is not None and state[0].more(state[1])

    @property
    def value_check(self) -> Check | None:
        """The check of its agent's action values; ``None`` for trusted actions (the built-in
        random agent's)."""
        return None if self._trusted else self._action_check

    def install(self, blob: bytes) -> None:
        """Install the agent in ``blob`` (``pickle((cloudpickled agent, seed))``), seeded."""
        agent = install_agent(blob, self._guard)
        self.agent = agent
        self._output_check.forget()
        self._trusted = trusted_actions(agent, self.action_space)
        self._agent_key = self.copy_key = alike_key(blob, agent)

    def set_params(self, blob: bytes) -> None:
        """``agent.set_param_values(params)`` with the parameters pickled in ``blob``."""
        self.copy_key = None  # until they are in place
        set_agent_params(self.agent, blob, self.group.worker, self._guard)
        self.copy_key = params_key(self._agent_key, blob)

    def settle(self) -> None:
        """The group's observations back in its own buffer, from the arena row a chunk left
        them in (a copy): before any request but a chunk, an agent install or its parameters,
        which all read or write them there (the main process's view goes home alike)."""
        buffers = self.group.buffers
        if buffers.obs is not self._own:
            put_row(self._own, Ellipsis, buffers.obs)
            buffers.obs = self._own
        self._ready_row = -1

    def reset_agent(self, mask: np.ndarray) -> None:
        """``agent.reset(mask)``, where the agent has it (episodes start in ``mask``)."""
        self._ready_row = -1  # reset envs show new observations
        reset = getattr(self.agent, "reset", None)
        if reset is not None and mask.any():
            self._guard(reset, mask.copy())

    def _guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            raise self._failure(exc) from exc

    def _failure(self, exc: Exception) -> EnvFailureError:
        """What the agent's ``exc`` is reported as (in the ``except`` block: the traceback)."""
        if isinstance(exc, AgentRowsError):  # a failed row: that env's fault (host restarted)
            n = self.group.n_envs
            try:
                exc.check_rows(n, f"the {n} envs of worker {self.group.worker}")
            except ValueError as bad:
                return self._failure(bad)
            row = next(iter(exc.failures))
            fault = exc.row_fault(row, worker=self.group.worker, env=row)
            return EnvFailureError(EnvFailure(row, fault, traceback.format_exc(), retry=True))
        error = agent_error(exc, self.group.worker)
        return EnvFailureError(EnvFailure(None, error, traceback.format_exc(), retry=False))

    def agent_actions(self, observations: Tree) -> tuple[Tree, dict[str, np.ndarray]]:
        """The agent's checked ``(actions, agent_infos)`` for ``observations``."""
        return self.checked(self.agent.get_actions(observations))

    def checked(self, result: Any) -> tuple[Tree, dict[str, np.ndarray]]:
        """The agent's output ``result`` for this slot's rows, checked."""
        if self._trusted:  # the built-in random agent: rows of its own space, no infos
            return result  # type: ignore[no-any-return]
        actions, infos = self._output_check.output(result)
        actions = check_actions(
            actions,
            self.group.buffers.actions,
            worker=self.group.worker,
            action_space=self.action_space,
            values=self._action_check,
        )
        return actions, infos

    def run(self, request: ChunkRequest | NextChunk) -> ChunkReply:
        """Run up to ``request.steps`` worker steps, or until the request's rule stops."""
        steps = self.begin(request)
        if isinstance(steps, ChunkReply):
            return steps
        # agent_actions as it is now: metrics swap in a timed one for a chunk (HostTiming)
        actions_for, send = self.agent_actions, steps.send
        try:
            observations = next(steps)
            while True:
                try:
                    output = actions_for(observations)
                except Exception as exc:
                    steps.throw(self.failed(exc))  # the loop cleans up and raises it
                observations = send(output)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    def failed(self, exc: Exception) -> EnvFailureError:
        """What the agent's ``exc`` (raised for this slot's rows) fails the chunk with; called
        in the ``except`` block (the traceback)."""
        failure = self._failure(exc)
        failure.__cause__ = exc
        return failure

    def begin(self, request: ChunkRequest | NextChunk) -> ChunkReply | ChunkSteps:
        """Start ``request``: its reply when it runs nothing, else its steps (a generator that
        yields each step's observations, is sent the checked ``(actions, agent_infos)`` and
        returns the reply; thrown an exception, it cleans up and raises it)."""
        if self.agent is None:
            raise RuntimeError(f"worker {self.group.worker}: no agent installed in its env host")
        if isinstance(request, NextChunk):
            state = self._state
            if state is None or int(self.chunk.epoch[0]) != request.epoch:
                return ChunkReply(0)
            rule, active, counts = state
            row = self._next_row
        else:
            rule = request.rule.copy()
            active = request.active.copy()
            counts = request.counts.astype(np.int64, copy=True)
            row = self._next_row = request.obs_row
            if request.epoch is not None and int(self.chunk.epoch[0]) != request.epoch:
                self._state = (rule, active, counts)  # a run-ahead sent before an update
                return ChunkReply(0)
        self._state = None  # until this chunk has run to its end
        chunk = self.chunks[request.buffer]
        into = self._arena_rows(row, min(request.steps, chunk.capacity))
        if into is None:
            self.settle()
        # A chunk that follows one into the arena starts at the row that holds the current
        # observations (the last one's spare row): nothing to copy there.
        written = into is not None and row == self._ready_row
        return self._steps(request, row, chunk, rule, active, counts, into, written)

    def _steps(
        self,
        request: ChunkRequest | NextChunk,
        row: int,
        chunk: ChunkBuffers,
        rule: StopRule,
        active: np.ndarray,
        counts: np.ndarray,
        into: Tree,
        written: bool,
    ) -> ChunkSteps:
        try:
            reply = yield from self._run(chunk, request.steps, rule, active, counts, into, written)
        except BaseException:
            self.settle()
            raise
        self._state = (rule, active, counts)
        if into is None:
            self._next_row = -1
        else:
            reply.obs_row = row
            self._next_row = row + reply.steps
            if reply.steps > 0:  # (none: the current observations stay where they were)
                self._ready_row = self._next_row
        return reply

    def _agent_reset(self) -> Callable[..., Any] | None:
        """The agent's ``reset``, or ``None`` where there is nothing to call (none, or the
        built-in :class:`~asyncsample.agent.RandomAgent`'s, which does nothing)."""
        reset = getattr(self.agent, "reset", None)
        if getattr(reset, "__func__", None) is RandomAgent.reset:
            return None
        return reset

    def _restore_flags(self, own: tuple[np.ndarray, np.ndarray, np.ndarray], keep: bool) -> None:
        """Point the group's rewards and flags back at its own buffers ``own``; ``keep``: with
        the values of the rows they pointed at (the last step's)."""
        buf = self.group.buffers
        for name, mine in zip(("rewards", "terminated", "truncated"), own):
            row = getattr(buf, name)
            if row is not mine:
                if keep:
                    mine[...] = row
                setattr(buf, name, mine)

    def _arena_rows(self, row: int, steps: int) -> Tree:
        """Arena rows ``row...row + steps`` and the spare row, or ``None`` if there are none."""
        arena = self.chunk.arena
        end = row + steps + 1
        if arena is None or row < 0 or end > len(tree_leaves(arena)[0]):
            return None
        return self.chunk.arena_view(row, end)

    def _run(
        self,
        chunk: ChunkBuffers,
        max_steps: int,
        rule: StopRule,
        active: np.ndarray,
        counts: np.ndarray,
        into: Tree = None,
        written: bool = False,
    ) -> ChunkSteps:
        """The chunk loop: ``rule``, ``active`` and ``counts`` are consumed in place;
        observations go to ``into`` (arena rows) if given, else to the set's rows; ``written``:
        row 0 already holds the current observations. Written for the cost per step: one
        assignment per plain row, episode ends from the group's list."""
        group = self.group
        buf = group.buffers
        everyone = bool(active.all())
        progress: Any = chunk.progress.data  # item access through a memoryview: cheaper
        infos_per_step: list[dict[str, np.ndarray]] = []
        step_infos: dict[int, tuple[list[dict[str, Any]] | None, dict[int, dict[str, Any]]]] = {}
        obs_rows = chunk.obs if into is None else into
        act_rows, buf_act = chunk.actions, buf.actions
        flat_obs = type(obs_rows) is np.ndarray and type(buf.obs) is np.ndarray
        flat_act = type(act_rows) is np.ndarray and type(buf_act) is np.ndarray
        final_rows, buf_final = chunk.final_obs, buf.final_obs
        flat_final = type(final_rows) is np.ndarray and type(buf_final) is np.ndarray
        rewards, terminated, truncated = chunk.rewards, chunk.terminated, chunk.truncated
        own = buf.rewards, buf.terminated, buf.truncated
        more, took, step = rule.more, rule.took, group.step
        # Episode ends matter to the rule only for samples and episodes (see StopRule.ended).
        watch_ends = rule.mode is CallMode.SAMPLES or rule.episodes_left is not None
        agent_reset = self._agent_reset()
        n_envs = group.n_envs
        # Per env, the step its episode's count is 0 at (a list: cheaper than numpy's per end).
        origin = [-c for c in counts.tolist()]
        steps = 0
        # Into the arena, while every env is stepped, each step writes its observations straight
        # into the next row (the group's buffer points there): no copy of them in the host. The
        # last step's stay there until another request needs them home (settle).
        swap = into is not None
        home = self._own
        ready = written  # row j holds the current observations
        # While every env is stepped, the group writes each step's rewards and flags straight
        # into the chunk's rows (its buffers point there): no copy of them either.
        direct = everyone
        try:
            for j in range(min(max_steps, chunk.capacity)):
                if not more(active):
                    break
                if swap:
                    # The arena's rows lay a multi-agent env's slots end to end, as the group's
                    # own rows do (``_memory.carve``): a policy's rows need no copy.
                    observations = obs_rows[j] if flat_obs else row_of(obs_rows, j)
                    if not ready:
                        put_row(observations, Ellipsis, buf.obs)
                    if everyone:
                        buf.obs = obs_rows[j + 1] if flat_obs else row_of(obs_rows, j + 1)
                    elif buf.obs is not home:  # some envs stay put: the buffer holds every env's
                        put_row(home, Ellipsis, observations)
                        buf.obs = home
                    ready = everyone
                elif flat_obs:
                    if not ready:
                        obs_rows[j] = buf.obs
                    observations = obs_rows[j]
                    ready = False
                else:
                    if not ready:
                        put_row(obs_rows, j, buf.obs)
                    # The group's own rows (the same values): a multi-agent env's slots lie end
                    # to end there (``_memory.carve``), so a policy's rows need no copy.
                    observations = buf.obs
                    ready = False
                actions, infos = yield observations  # the agent's, checked (see begin)
                if flat_act:
                    act_rows[j] = actions
                    buf_act[...] = actions
                else:
                    put_row(act_rows, j, actions)
                    put_row(buf_act, Ellipsis, actions)
                infos_per_step.append(infos)
                if direct:
                    buf.rewards, buf.terminated, buf.truncated = (
                        rewards[j],
                        terminated[j],
                        truncated[j],
                    )
                result = step(active, None, everyone)
                progress[0] += 1  # a step ended: the main process judges the next from now
                if result.env_infos is not None or result.reset_infos:
                    # Copied now: the chunk's reply is pickled once, after an env may have
                    # changed an info dict it reuses (as a step's own reply would not see).
                    step_infos[j] = (snapshot(result.env_infos), snapshot(result.reset_infos))
                if not direct:
                    rewards[j] = buf.rewards
                    terminated[j] = buf.terminated
                    truncated[j] = buf.truncated
                steps = j + 1
                took(1)
                ended = group.last_ended
                if not ended:
                    continue
                if flat_final:  # a row per ended env: cheaper than fancy indexing for a few
                    final_row = final_rows[j]
                    for i in ended:
                        final_row[i] = buf_final[i]
                else:
                    _put_final(final_rows, buf_final, j, np.array(ended, dtype=np.intp))
                if watch_ends:
                    index = np.array(ended, dtype=np.intp)
                    if rule.ended(index, sum(steps - origin[i] for i in ended), active):
                        everyone = False
                        if direct:  # from the next step on, copied from the group's buffers
                            direct = False
                            self._restore_flags(own, True)
                for i in ended:
                    origin[i] = steps
                if agent_reset is not None:
                    done = np.zeros(n_envs, dtype=bool)
                    done[ended] = True
                    self._guard(agent_reset, done)
            counts[:] = [steps - o for o in origin]
            if steps and not ready and (into is not None or len(rewards) > chunk.capacity):
                put_row(obs_rows, steps, buf.obs)
        except BaseException:
            self._restore_flags(own, False)
            raise
        self._restore_flags(own, True)
        return ChunkReply(steps, _pack_infos(infos_per_step), step_infos)


def _put_final(dst: Tree, src: Tree, j: int, index: np.ndarray) -> None:
    """Row ``j`` of the chunk's final observations ``dst`` takes ``src``'s rows ``index``."""

    def put(d: np.ndarray, s: np.ndarray) -> None:
        d[j, index] = s[index]

    tree_map(put, dst, src)


def _pack_infos(
    per_step: list[dict[str, np.ndarray]],
) -> dict[str, np.ndarray] | list[tuple[int, dict[str, np.ndarray]]]:
    """Stack the agent infos when every step has the same keys and shapes; else list them."""
    first = per_step[0] if per_step else {}
    if first and all(
        infos.keys() == first.keys()
        and all(infos[k].shape == v.shape and infos[k].dtype == v.dtype for k, v in first.items())
        for infos in per_step
    ):
        return {k: np.stack([infos[k] for infos in per_step]) for k in first}
    return [(j, infos) for j, infos in enumerate(per_step) if infos]


def run_joint(
    runners: Sequence[ChunkRunner], requests: Sequence[ChunkRequest | NextChunk]
) -> list[ChunkReply | Exception]:
    """Run each runner's request, the steps of all side by side with one agent call a step
    (the first runner's copy); per runner, its reply or the exception its chunk raised."""
    if len(runners) == 1:  # alone: its own loop, without the bookkeeping of several
        try:
            return [runners[0].run(requests[0])]
        except Exception as exc:
            return [exc]
    results: list[ChunkReply | Exception | None] = [None] * len(runners)
    live: list[tuple[int, ChunkSteps, Tree]] = []
    for k, (runner, request) in enumerate(zip(runners, requests)):
        try:
            steps = runner.begin(request)
            if isinstance(steps, ChunkReply):
                results[k] = steps
            else:
                live.append((k, steps, next(steps)))
        except StopIteration as stop:
            results[k] = stop.value
        except Exception as exc:
            results[k] = exc
    merged = _MergedCheck.of(runners)
    while live:
        members = [runners[k] for k, _, _ in live]
        outputs = _actions(members, [observations for _, _, observations in live], merged)
        going = []
        for (k, steps, _), output in zip(live, outputs):
            try:
                if isinstance(output, Exception):
                    steps.throw(output)  # the loop cleans up and raises it
                going.append((k, steps, steps.send(output)))
            except StopIteration as stop:
                results[k] = stop.value
            except Exception as exc:
                results[k] = exc
        live = going
    return [r if r is not None else RuntimeError("a joint chunk lost its reply") for r in results]


class _MergedCheck:
    """The checks of the merged output of alike slots that share one action space and layout of
    action rows, run once for all (:meth:`actions`): what each slot's own checks would pass."""

    def __init__(self, row_shape: tuple[int, ...], values: Check | None) -> None:
        self.row_shape = row_shape
        self.values = values  # None: trusted actions (the built-in random agent's)

    @staticmethod
    def of(runners: Sequence[ChunkRunner]) -> _MergedCheck | None:
        """The check for ``runners``, or ``None`` where their actions differ in space, layout or
        trust (each slot's part is then checked on its own)."""
        first = runners[0]
        space, rows, values = first.action_space, first.group.buffers.actions, first.value_check
        if type(space) not in ARRAY_SPACES or type(rows) is not np.ndarray:
            return None
        for runner in runners[1:]:
            other = runner.group.buffers.actions
            if (
                (runner.value_check is None) != (values is None)
                or type(other) is not np.ndarray
                or other.shape[1:] != rows.shape[1:]
                or not (runner.action_space is space or runner.action_space == space)
            ):
                return None
        return _MergedCheck(rows.shape[1:], values)

    def actions(self, output: Any, n: int) -> np.ndarray | None:
        """The actions of ``output``, the merged call's for ``n`` rows, if it passes: an
        ``(actions, agent_infos)`` tuple without infos, an array of a row per row of the space's
        shape, every value in the space. ``None`` otherwise: each slot's checks then say why."""
        if type(output) is not tuple or len(output) != 2:
            return None
        actions, infos = output
        if infos is not None and (type(infos) is not dict or infos):
            return None
        if type(actions) is not np.ndarray or actions.shape != (n, *self.row_shape):
            return None
        if self.values is not None and len(self.values(actions)):
            return None
        return actions


def _actions(
    runners: list[ChunkRunner], observations: list[Tree], merged: _MergedCheck | None = None
) -> list[Any]:
    """Per runner, its checked ``(actions, agent_infos)`` or the error that fails its chunk;
    ``merged``: the runners' outputs pass its check at once."""
    parts = None
    if len(runners) > 1:
        flat = all(type(o) is np.ndarray for o in observations)
        rows = [len(o if flat else tree_leaves(o)[0]) for o in observations]
        try:
            output = runners[0].agent.get_actions(
                np.concatenate(observations) if flat else tree_concat(observations)
            )
            actions = None if merged is None else merged.actions(output, sum(rows))
            if actions is not None:  # checked: each slot's rows as they are
                return _split(actions, {}, rows)
            parts = split_output(output, rows)
        except AgentRowsError as exc:  # each failed row is its own slot's fault
            return _rows_failed(runners, rows, exc)
        except Exception as exc:  # the call of every slot in it failed
            return [runner.failed(exc) for runner in runners]
    out: list[Any] = []
    for i, runner in enumerate(runners):
        try:  # not split (the output is not a row per row): each asks its own copy
            out.append(
                runner.agent_actions(observations[i]) if parts is None else runner.checked(parts[i])
            )
        except Exception as exc:
            out.append(runner.failed(exc))
    return out


def _rows_failed(runners: list[ChunkRunner], rows: list[int], exc: AgentRowsError) -> list[Any]:
    """Per runner, what the merged call's failed rows ``exc`` leave it: its own
    :class:`AgentRowsError` where a row of its failed, else its checked rows of the output
    (called in the ``except`` block: the tracebacks)."""
    parts = split_output((exc.actions, exc.agent_infos or {}), rows)
    if parts is None:
        return [runner.failed(exc) for runner in runners]
    out: list[Any] = []
    start = 0
    for runner, n, (actions, infos) in zip(runners, rows, parts):
        mine = {j - start: e for j, e in exc.failures.items() if start <= j < start + n}
        start += n
        try:
            if mine:
                raise AgentRowsError(actions, infos, mine) from exc
            out.append(runner.checked((actions, infos)))
        except Exception as own:
            out.append(runner.failed(own))
    return out


def split_output(result: Any, rows: Sequence[int]) -> list[tuple[Tree, dict[str, Any]]] | None:
    """An agent's ``(actions, agent_infos)`` for stacked rows, split into parts of ``rows``
    rows each; ``None`` where it is not made of arrays with a row per input row."""
    if type(result) is not tuple or len(result) != 2 or not isinstance(result[1], dict):
        return None
    actions, infos = result
    total = sum(rows)
    leaves = [*tree_leaves(actions), *infos.values()]
    if not all(isinstance(a, np.ndarray) and a.ndim and len(a) == total for a in leaves):
        return None
    return _split(actions, infos, rows)


def _split(
    actions: Tree, infos: dict[str, Any], rows: Sequence[int]
) -> list[tuple[Tree, dict[str, Any]]]:
    """``actions`` and ``infos`` (arrays of a row per row) in parts of ``rows`` rows each."""
    plain = type(actions) is np.ndarray and not infos
    parts: list[tuple[Tree, dict[str, Any]]] = []
    start = 0
    for n in rows:
        end = start + n
        if plain:
            parts.append((actions[start:end], {}))
        else:
            part = tree_map(lambda a, s=start, e=end: a[s:e], actions)
            parts.append((part, {key: value[start:end] for key, value in infos.items()}))
        start = end
    return parts
