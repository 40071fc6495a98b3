"""Text and Sequence spaces recorded as columns (issue 49): every layout, backend, call mode and
the stream give the batches of a plain reference loop that steps the same env with the same
seeded actions; the columns (text, :class:`~asyncsample.RaggedArray`) in ``EpisodeBatch``."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import cloudpickle
import numpy as np
import pytest
import text_envs
from text_envs import LAYOUTS, TextAgent, TextAsyncEnv, TextEnv, answer

from asyncsample import EpisodeBatch, RaggedArray, Sampler, columns
from asyncsample.batch import EnvSpec
from asyncsample.seeding import worker_seeds

cloudpickle.register_pickle_by_value(text_envs)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SEED = 7


def _reference(layout: str, n_episodes: int) -> list[dict[str, Any]]:
    """The episodes of one env stepped by hand with the agent's answers (the first reset gets
    the seed the sampler gives worker 0's env 0)."""
    env = TextEnv(layout)
    seed: int | None = worker_seeds(SEED, 1, 1)[1][0].next_env_seed(0)
    episodes = []
    for _ in range(n_episodes):
        obs, info = env.reset(seed=seed)
        seed = None
        ep: dict[str, Any] = {
            "obs": [],
            "actions": [],
            "rewards": [],
            "tool": [],
            "ids": [],
            "info": info,
        }
        done = False
        while not done:
            action, ids, _ = answer(obs, layout)
            ep["obs"].append(obs)
            ep["actions"].append(action)
            ep["ids"].append(ids)
            obs, reward, term, trunc, step_info = env.step(action)
            ep["rewards"].append(reward)
            ep["tool"].append(step_info["tool"])
            done = term or trunc
        ep["last"] = obs
        episodes.append(ep)
    return episodes


def _rows(column: Any) -> list[Any]:
    """A column's rows as plain Python values (strings, lists)."""
    if isinstance(column, RaggedArray):
        return [r.tolist() for r in column.to_list()]
    return [x.tolist() if isinstance(x, np.ndarray) else x for x in column.tolist()]


def _leaf_rows(tree: Any, values: list[Any]) -> None:
    """Assert the batched ``tree`` holds ``values`` (one tree per row), leaf by leaf."""
    if isinstance(tree, dict):
        for k in tree:
            _leaf_rows(tree[k], [v[k] for v in values])
        return
    if isinstance(tree, tuple):
        for k, sub in enumerate(tree):
            _leaf_rows(sub, [v[k] for v in values])
        return
    want = [np.asarray(v).tolist() if not isinstance(v, str) else v for v in values]
    got = _rows(tree)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, list) and w and isinstance(w[0], list | float):
            np.testing.assert_allclose(np.asarray(g, dtype=float), np.asarray(w, dtype=float))
        else:
            assert g == w


def _check_against(batch: EpisodeBatch, episodes: list[dict[str, Any]], layout: str) -> None:
    """``batch``'s first episodes are the reference's (a fragment: a prefix of one)."""
    assert batch.n_episodes <= len(episodes)
    steps = batch.episode_slices
    for k, sl in enumerate(steps):
        ep = episodes[k]
        n = sl.stop - sl.start
        assert n <= len(ep["obs"])
        one = batch.select([k])
        _leaf_rows(one.observations, ep["obs"][:n])
        _leaf_rows(one.actions, ep["actions"][:n])
        np.testing.assert_array_equal(one.rewards, ep["rewards"][:n])
        assert _rows(one.env_infos["tool"]) == ep["tool"][:n]
        assert _rows(one.agent_infos["token_ids"]) == [i.tolist() for i in ep["ids"][:n]]
        if n == len(ep["obs"]):
            _leaf_rows(one.last_observations, [ep["last"]])
    # The recorded columns: text where text is, ragged where sequences are.
    assert batch.env_infos["tool"].dtype == columns.text_dtype()
    assert batch.episode_infos["task"].dtype == columns.text_dtype()
    seen = batch.env_infos["seen"]  # ragged; stacked when every row of the batch has one length
    assert isinstance(seen, RaggedArray) or seen.ndim == 2
    assert isinstance(batch.agent_infos["token_ids"], RaggedArray)
    assert batch.agent_infos["logprobs"].dtype == np.float32
    obs_space, _ = LAYOUTS[layout]
    assert EpisodeBatch.concatenate(*batch.split()).equals(batch)
    assert "RaggedArray" not in repr(batch) and len(repr(batch)) < 300
    del obs_space


BACKENDS = [
    ("asyncio", "async"),
    ("thread", "sync"),
    ("local", "sync"),
    ("process", "sync"),
    ("process", "async"),
    ("ray", "sync"),
    ("ray", "async"),
]


def _sampler(
    backend: str,
    kind: str,
    layout: str,
    n_workers: int = 1,
    envs_per_worker: int = 1,
    **kw: Any,
) -> Sampler:
    env_class = TextAsyncEnv if kind == "async" else TextEnv
    extra: dict[str, Any] = {}
    if backend in ("process", "ray"):
        extra["n_processes"] = 1
    if backend == "ray":
        extra["backend_options"] = {"init_kwargs": {"num_cpus": 2, "include_dashboard": False}}
    return Sampler(
        lambda: env_class(layout),
        TextAgent(layout),
        backend=backend,
        n_workers=n_workers,
        envs_per_worker=envs_per_worker,
        seed=SEED,
        max_episode_length=10,
        **extra,
        **kw,
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("backend,kind", BACKENDS)
async def test_every_layout_and_backend_records_the_reference_episodes(
    backend: str, kind: str, layout: str, request: pytest.FixtureRequest
) -> None:
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    episodes = _reference(layout, 8)
    async with _sampler(backend, kind, layout) as s:
        exact = await s.obtain_exact_episodes(3)
        assert exact.n_episodes == 3
        _check_against(exact, episodes, layout)
        samples = await s.obtain_samples(6)  # fresh episodes, continuing the env's stream
        _check_against(samples, episodes[3:], layout)


@pytest.mark.parametrize("mode", ["fragments", "stream", "batched", "host"])
@pytest.mark.parametrize("backend,kind", BACKENDS)
async def test_call_modes_and_inference_modes(
    backend: str, kind: str, mode: str, request: pytest.FixtureRequest
) -> None:
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    layout = "dict"
    episodes = _reference(layout, 8)
    kw: dict[str, Any] = {}
    if mode in ("batched", "host"):
        kw["inference"] = mode
    if mode == "host" and backend not in ("process", "ray"):
        # the agent runs in env hosts: an in-process backend refuses it, naming the backends
        with pytest.raises(ValueError, match=r"inference='host'.*'process' or 'ray'"):
            _sampler(backend, kind, layout, **kw)
        return
    async with _sampler(backend, kind, layout, **kw) as s:
        if mode == "fragments":
            batch = await s.obtain_fragments(4)
            assert batch.n_transitions >= 4
        elif mode == "stream":
            async with contextlib.aclosing(s.stream(5)) as it:
                batch = await anext(it)
        else:
            batch = await s.obtain_exact_episodes(2)
        _check_against(batch, episodes, layout)


def test_ragged_array_layout_and_padding() -> None:
    r = RaggedArray.from_rows([[1, 2, 3], [], [4]], dtype=np.int64)
    np.testing.assert_array_equal(r.offsets, [0, 3, 3, 4])
    np.testing.assert_array_equal(r.values, [1, 2, 3, 4])
    padded, lengths = r.to_padded(pad_value=-1)
    np.testing.assert_array_equal(padded, [[1, 2, 3], [-1, -1, -1], [4, -1, -1]])
    np.testing.assert_array_equal(lengths, [3, 0, 1])
    cut, _ = r.to_padded(length=2)
    np.testing.assert_array_equal(cut, [[1, 2], [0, 0], [4, 0]])
    view = r[1:]
    assert view.values is r.values and _rows(view) == [[], [4]]
    assert _rows(r[np.array([2, 0])]) == [[4], [1, 2, 3]]
    assert _rows(r[np.array([True, False, True])]) == [[1, 2, 3], [4]]
    assert RaggedArray.concatenate([r[2:], r[:1]]).equals(r.take(np.array([2, 0])))
    emb = RaggedArray.from_rows([np.ones((2, 3)), np.zeros((0, 3))])
    assert emb.item_shape == (3,) and emb.to_padded()[0].shape == (2, 2, 3)
    with pytest.raises(ValueError, match="offsets"):
        RaggedArray(np.zeros(2), np.array([0, 3]))


def _batch(
    obs: Any, actions: Any, lengths: list[int], obs_space: Any, act_space: Any
) -> EpisodeBatch:
    n, t = len(lengths), sum(lengths)
    last = obs[:n] if not isinstance(obs, RaggedArray) else obs[np.arange(n)]
    return EpisodeBatch(
        env_spec=EnvSpec(obs_space, act_space, None),
        episode_infos={},
        observations=obs,
        last_observations=last,
        actions=actions,
        rewards=np.zeros(t),
        env_infos={},
        agent_infos={},
        step_types=np.ones(t, dtype=np.uint8),
        lengths=np.array(lengths),
    )


def test_batch_checks_split_concatenate_pad_equality() -> None:
    obs = RaggedArray.from_rows([[1], [2, 3], [], [4, 5, 6]], dtype=np.int64)
    actions = columns.text_array(["a", "bb", "", "dddd"])
    b = _batch(obs, actions, [3, 1], text_envs.TOKENS, text_envs.REPLY)
    parts = b.split()
    assert [p.n_transitions for p in parts] == [3, 1]
    assert EpisodeBatch.concatenate(*parts).equals(b)
    assert not b.equals(
        _batch(
            obs, columns.text_array(["a", "bb", "", "x"]), [3, 1], text_envs.TOKENS, text_envs.REPLY
        )
    )
    padded = b.padded_observations  # N * L rows, episode-major, empty past each end
    assert isinstance(padded, RaggedArray) and len(padded) == 2 * 3
    assert _rows(padded) == [[1], [2, 3], [], [4, 5, 6], [], []]
    assert b.padded_actions.tolist() == [["a", "bb", ""], ["dddd", "", ""]]
    nxt = b.next_observations
    assert _rows(nxt)[:2] == [[2, 3], []]
    with pytest.raises(ValueError, match="RaggedArray of items of shape"):
        _batch(actions, actions, [3, 1], text_envs.TOKENS, text_envs.REPLY)
    with pytest.raises(ValueError, match="array of strings"):
        _batch(obs, obs, [3, 1], text_envs.TOKENS, text_envs.REPLY)
    joined = columns.concat_leaves([np.zeros((2, 3), np.int64), obs])  # stacked, then ragged
    assert isinstance(joined, RaggedArray) and joined.lengths.tolist() == [3, 3, 1, 2, 0, 3]
    paths = b.to_list()
    assert EpisodeBatch.from_list(b.env_spec, paths).observations.equals(obs)


def test_text_columns_fall_back_to_object_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy 1.x has no StringDType: text columns are object arrays of str, with the same
    checks, joins and equality."""
    monkeypatch.setattr(columns, "_TEXT_DTYPE", np.dtype(object))
    col = columns.text_array(["x", "yé"])
    assert col.dtype == object and col.tolist() == ["x", "yé"]
    assert columns.infer_column(np.array(["a", "b"])).dtype == object
    obs = RaggedArray.from_rows([[1], [2]], dtype=np.int64)
    b = _batch(obs, col, [1, 1], text_envs.TOKENS, text_envs.REPLY)
    assert EpisodeBatch.concatenate(*b.split()).equals(b)
    assert b.padded_actions.tolist() == [["x"], ["yé"]]


async def test_object_fallback_records_through_a_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(columns, "_TEXT_DTYPE", np.dtype(object))
    episodes = _reference("text", 3)
    async with _sampler("asyncio", "async", "text") as s:
        batch = await s.obtain_exact_episodes(2)
    assert batch.observations.dtype == object and batch.env_infos["tool"].dtype == object
    assert _rows(batch.observations) == [o for ep in episodes[:2] for o in ep["obs"]]


def test_a_space_it_cannot_record_is_refused_naming_the_leaf() -> None:
    import gymnasium as gym

    from asyncsample import _validate

    _validate.recordable_space("env: observation_space", gym.spaces.Dict({"a": text_envs.TEXT}))
    bad = gym.spaces.Dict({"g": gym.spaces.Sequence(gym.spaces.Text(4))})
    with pytest.raises(ValueError, match=r"observation_space\['g'\].*cannot record"):
        _validate.recordable_space("env: observation_space", bad)


def test_memory_bound_sizes_text_and_sequences_and_says_from_what() -> None:
    """Text sizes from its max_length, Sequence from max_sequence_length (default 1,024
    items); a configuration that cannot fit is refused before anything starts, naming both."""
    from asyncsample import _validate

    huge = text_envs.gym.spaces.Dict(
        {"p": text_envs.gym.spaces.Text(10**9), "ids": text_envs.TOKENS}
    )
    with pytest.raises(
        ValueError,
        match=r"(?=.*'p'\] from Text max_length=1000000000)"
        r"(?=.*max_sequence_length=1024 \(the default)",
    ):
        _validate.memory_fits(
            huge, text_envs.REPLY, n_workers=4, envs_per_worker=8, chunk_steps=0, shared=True
        )
    with pytest.raises(ValueError, match=r"max_sequence_length=1000000000 \(given\)"):
        Sampler(
            lambda: TextEnv("tokens"),
            backend="process",
            n_workers=64,
            envs_per_worker=64,
            max_sequence_length=10**9,
        )
    with pytest.raises(ValueError, match="max_sequence_length must be >= 1"):
        Sampler(lambda: TextEnv("tokens"), backend="asyncio", max_sequence_length=0)
    # A modest bound fits.
    _validate.memory_fits(
        huge.spaces["ids"],
        text_envs.REPLY,
        n_workers=2,
        envs_per_worker=2,
        chunk_steps=0,
        shared=True,
    )


def test_rows_travel_as_one_buffer_per_column() -> None:
    """Text rows as one utf-8 buffer and offsets, ragged rows as one array and offsets; the
    lane messages keep each reply and request whole."""
    from asyncsample.backends import _column_wire as wire

    kind, data, offsets = wire.pack_column(["ab", "", "é"])
    assert kind == "t" and data == "abé".encode() and offsets.tolist() == [0, 2, 2, 4]
    rows = [np.arange(3), np.arange(0), np.arange(2)]
    kind, values, offsets = wire.pack_column(rows)
    assert kind == "a" and values.tolist() == [0, 1, 2, 0, 1] and offsets.tolist() == [0, 3, 3, 5]
    assert [r.tolist() for r in wire.unpack_column(("a", values, offsets))] == [
        [0, 1, 2],
        [],
        [0, 1],
    ]
    obs = [{"p": "x", "ids": np.arange(2)}, {"p": "yé", "ids": np.arange(0)}]
    replies = [
        (1, 0, ((1.0, False), obs[0], None)),
        (2, 5, "err"),
        (3, 0, ((0.0, True), obs[1], obs[0])),
    ]
    message = wire.pack_replies(replies, 0)
    assert [c[0] for c in message[3][2]] == ["t", "a"]  # one column per leaf, no objects
    back = wire.unpack_replies(message)
    assert back[1] == (2, 5, "err") and back[2][2][1]["p"] == "yé"
    assert back[2][2][2]["ids"].tolist() == [0, 1] and back[0][2][2] is None
    requests = [
        (0, 7, 0, 1, "reply one", None),
        (1, 8, 0, 2, "pending", None, None),
        (0, 9, 0, 3, "é", 2.0),
    ]
    packed = wire.pack_requests(requests, 0)
    assert packed is not None and packed[3][2][0][0] == "t"
    assert wire.unpack_requests(packed) == requests


async def test_process_lane_messages_carry_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncsample.backends import _lane_link

    kinds: list[str] = []
    unpack = _lane_link.unpack_replies

    def counted(message: Any) -> Any:
        kinds.extend(c[0] for packed in (message[3], message[4]) for c in packed[2])
        return unpack(message)

    monkeypatch.setattr(_lane_link, "unpack_replies", counted)
    async with _sampler("process", "async", "dict") as s:
        await s.obtain_exact_episodes(2)
    assert kinds and set(kinds) <= {"t", "a"}, kinds


@pytest.mark.parametrize("backend,kind", [b for b in BACKENDS if b != ("asyncio", "async")])
async def test_batches_equal_across_backends(
    backend: str, kind: str, request: pytest.FixtureRequest
) -> None:
    """Two workers of two envs: every backend's batches equal the asyncio backend's, field by
    field (text and ragged columns included)."""
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    batches = []
    for b, k in (("asyncio", "async"), (backend, kind)):
        async with _sampler(b, k, "dict", n_workers=2, envs_per_worker=2) as s:
            batches.append(await s.obtain_exact_episodes(3))
    reference, other = batches
    assert reference.n_episodes == 6 and other.equals(reference)
