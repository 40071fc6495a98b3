"""Step infos of plain numbers through shared memory (``asyncsample._info_cells``): what crosses
in the cells and comes back the same (keys in order, values of their types), what is left to
pickling, the schema's versions, and a process host's step replies and sampled batches."""

from __future__ import annotations

import pickle
from collections import OrderedDict
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.spaces import Box, Discrete

from asyncsample import Sampler
from asyncsample._info_cells import CELLS, COLUMNS, InfoCells, columnar, info_rows
from asyncsample.backends._slot import HostSlot
from asyncsample.backends._transport import Op
from asyncsample.backends.base import HostSpec
from asyncsample.env_group import StepBuffers

pytestmark = pytest.mark.timeout(120)


def _pair(n: int) -> tuple[InfoCells, InfoCells]:
    """The host's and the caller's views of one block."""
    block = np.zeros((info_rows(n), CELLS))
    return InfoCells(block, n), InfoCells(block, n)


def _same(got: list[dict[Any, Any]], want: list[dict[Any, Any]]) -> None:
    assert got == want
    for g, w in zip(got, want):
        assert list(g) == list(w)  # the keys in their order
        assert [type(v) for v in g.values()] == [type(v) for v in w.values()]


NUMBERS = [
    {
        "x": np.float64(1.5),
        "n": 3,
        "ok": True,
        "f32": np.float32(0.1),
        "f16": np.float16(-2.5),
        "py": -0.0,
        "nan": float("nan"),
        "i64": np.int64(-(2**53)),
        "u8": np.uint8(200),
        "b": np.bool_(True),
    },
    {},
    {
        "x": np.float64(-2.0),
        "n": 2**53,
        "ok": False,
        "f32": np.float32(2.5),
        "f16": np.float16(0.0),
        "py": 1e300,
        "nan": float("inf"),
        "i64": np.int64(7),
        "u8": np.uint8(0),
        "b": np.bool_(False),
    },
]


def test_numbers_come_back_as_they_were() -> None:
    host, caller = _pair(3)
    assert host.write(NUMBERS)
    got = caller.read()
    assert np.isnan(got[0].pop("nan")) and type(NUMBERS[0]["nan"]) is float
    _same(got, [{k: v for k, v in NUMBERS[0].items() if k != "nan"}, {}, NUMBERS[2]])
    assert np.float32(got[0]["f32"]) == np.float32(0.1)  # exactly the float32 it was
    assert all(columnar(info) for info in NUMBERS)


@pytest.mark.parametrize(
    "infos",
    [
        [{"a": "text"}],
        [{"a": {"nested": 1.0}}],
        [{"a": np.zeros(2)}],
        [{"a": 1.0}, {"b": 1.0}],  # other keys
        [{"a": 1.0, "b": 2.0}, {"b": 2.0, "a": 1.0}],  # the same keys, in another order
        [{"a": 1.0}, {"a": 1}],  # another type
        [{"a": 2**53 + 1}],  # more than a float64 holds exactly
        [{"a": np.uint64(1)}],
        [{f"k{j}": 1.0 for j in range(CELLS)}],  # more keys than columns
        [OrderedDict(a=1.0)],  # a subclass of dict
        [{}, {}],
    ],
)
def test_anything_else_is_left_to_pickling(infos: list[dict[str, Any]]) -> None:
    host, caller = _pair(len(infos))
    assert host.write([{"kept": 1.0}] * len(infos))
    before = caller.read()
    assert not host.write(infos)
    assert caller.read() == before  # the cells were left as they were


def test_a_new_schema_is_read_again_and_a_restarted_host_goes_on() -> None:
    host, caller = _pair(2)
    assert host.write([{"a": 1.0}, {"a": 2.0}])
    _same(caller.read(), [{"a": 1.0}, {"a": 2.0}])
    assert host.write([{"b": np.int64(4)}, {}])
    _same(caller.read(), [{"b": np.int64(4)}, {}])
    # A new host process over the same block (a restart): its first schema is a new version,
    # whatever the caller cached.
    restarted = InfoCells(host.values.base, 2)  # type: ignore[arg-type]
    assert restarted.write([{"b": 1.5}, {"b": 2.5}])  # the same key, another type
    _same(caller.read(), [{"b": 1.5}, {"b": 2.5}])


def test_a_key_that_does_not_pickle_is_left_to_pickling() -> None:
    class Key(str):
        def __reduce__(self) -> Any:
            raise TypeError("no")

    host, _ = _pair(1)
    assert not host.write([{Key("a"): 1.0}])


class NumberInfos(gym.Env[Any, Any]):
    """Infos of plain numbers at every step but every fifth (nothing then), an episode end every
    eleventh step (its reset info: text)."""

    observation_space = Box(-1.0, 1.0, (2,), np.float32)
    action_space = Discrete(2)

    def __init__(self) -> None:
        self.t = 0

    def reset(self, *, seed: int | None = None, options: Any = None):  # type: ignore[no-untyped-def]
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {"why": "start"}

    def step(self, action: Any):  # type: ignore[no-untyped-def]
        self.t += 1
        info: dict[str, Any] = {}
        if self.t % 5:
            info = {"x": np.float64(self.t * 0.5), "n": self.t, "f": np.float32(action)}
        obs = self.np_random.random(2).astype(np.float32)
        return obs, 1.0, self.t % 11 == 0, False, info


def test_a_host_slot_replies_columns_for_numbers_only() -> None:
    """A slot with info cells answers a step of plain-number infos with :data:`COLUMNS` (the
    caller's view reads them), a step with a reset info (an episode's end) pickled."""
    spec = HostSpec(0, 2, NumberInfos.observation_space, NumberInfos.action_space, None)
    buffers = StepBuffers.allocate(spec.observation_space, spec.action_space, 2, info_cells=True)
    slot = HostSlot(spec, buffers)
    slot.group.build([[NumberInfos]] * 2, [1, 2])
    slot.reset(np.ones(2, np.bool_))
    assert buffers.infos is not None
    caller = InfoCells(buffers.infos.values.base, 2)  # type: ignore[arg-type]
    body = b"\x01\x01"  # the mask (the frame's slot already read)
    kinds = []
    for t in range(1, 12):
        buffers.actions[:] = t % 2
        payload = slot.serve(Op.STEP, body)
        if t % 5 == 0:
            assert payload == b""  # nothing to say
        elif t == 11:  # episodes end: the reset infos are pickled with the step's
            env_infos, resets = pickle.loads(payload)
            assert resets == {0: {"why": "start"}, 1: {"why": "start"}}
            assert env_infos == [{"x": 5.5, "n": 11, "f": np.float32(1)}] * 2
        else:
            assert payload == COLUMNS
            want = {"x": np.float64(t * 0.5), "n": t, "f": np.float32(t % 2)}
            _same(caller.read(), [want, want])
        kinds.append(payload[:1])
    slot.close()
    assert kinds.count(COLUMNS) == 8


async def test_a_process_host_samples_the_same_infos_as_the_callers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sampler's lockstep on env-host processes: the batches' infos (their values and
    dtypes) equal those of the caller's own process, most of them read from the cells."""
    reads = []
    read = InfoCells.read
    monkeypatch.setattr(InfoCells, "read", lambda self: reads.append(1) or read(self))
    batches = []
    for backend in ("local", "process"):
        async with Sampler(
            NumberInfos,
            n_workers=2,
            envs_per_worker=3,
            backend=backend,
            seed=3,
            inference="per_worker",
        ) as sampler:
            batches.append(await sampler.obtain_samples(200))
    local, hosted = batches
    assert {"x", "n", "f"} <= set(local.env_infos) == set(hosted.env_infos)
    for key, want in local.env_infos.items():
        got = hosted.env_infos[key]
        assert got.dtype == want.dtype, key
        np.testing.assert_array_equal(got, want, err_msg=key)
    np.testing.assert_array_equal(hosted.observations, local.observations)
    assert len(reads) > 40  # two hosts, 34 steps each: numbers at 4 in 5
