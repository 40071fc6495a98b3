"""The process backend's framing, on its own: headers, frames split across reads, frames that
share a read, and the end of the stream in the middle of a frame.

Two readers are covered: the env host's blocking :class:`FrameReader`, and the main process's
``_ReplyProtocol``, which the event loop feeds with whatever bytes one read returned.
"""

from __future__ import annotations

import pickle
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from asyncsample.backends._transport import HEADER, FrameReader, dumps, dumps_infos, send_frame
from asyncsample.backends.process import _ReplyProtocol

# (request id, opcode or status, payload): empty, small, and larger than FrameReader's buffer.
FRAMES = [(1, 1, b""), (2, 0, b"\x00\x01ab"), (70000, 12, bytes(range(256)) * 300)]


def encode(frames: list[tuple[int, int, bytes]]) -> bytes:
    """The bytes of ``frames`` on the wire."""
    return b"".join(HEADER.pack(len(p), rid, code) + p for rid, code, p in frames)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    with a, b:
        yield a, b


# -- the header ---------------------------------------------------------------------------------


def test_header_is_length_request_id_and_code_little_endian() -> None:
    assert HEADER.size == 9
    raw = HEADER.pack(5, 0x01020304, 7)
    assert raw == b"\x05\x00\x00\x00\x04\x03\x02\x01\x07"
    assert HEADER.unpack(raw) == (5, 0x01020304, 7)


@pytest.mark.parametrize("value", [(0, 0, 0), (2**32 - 1, 2**32 - 1, 255)])
def test_header_round_trips_its_extremes(value: tuple[int, int, int]) -> None:
    assert HEADER.unpack(HEADER.pack(*value)) == value


# -- the host's side: send_frame and FrameReader over a socket ---------------------------------


def test_frames_sent_one_by_one_are_read_back(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    reader = FrameReader(b)
    for rid, code, payload in FRAMES:
        send_frame(a, rid, code, payload)
    assert [reader.read() for _ in FRAMES] == FRAMES
    a.close()
    assert reader.read() is None  # end of stream between frames
    reader.close()


def _cut(data: bytes, cuts: list[int]) -> list[bytes]:
    return [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)], strict=True)]


_WIRE = encode(FRAMES)
_TWO = len(encode(FRAMES[:2]))


@pytest.mark.parametrize(
    "pieces",
    [
        [_WIRE],  # several frames in one write
        # Cut inside the first header, inside a payload, and at a frame boundary.
        _cut(_WIRE, [4, HEADER.size + 2, _TWO, _TWO + 1000]),
    ],
    ids=["one write", "split writes"],
)
def test_frames_are_read_whole_however_they_were_written(
    pair: tuple[socket.socket, socket.socket], pieces: list[bytes]
) -> None:
    a, b = pair
    reader = FrameReader(b)

    def write() -> None:
        for piece in pieces:
            a.sendall(piece)

    # The big frame may not fit the socket buffer: write while reading.
    writer = threading.Thread(target=write)
    writer.start()
    assert [reader.read() for _ in FRAMES] == FRAMES
    writer.join()
    reader.close()


@pytest.mark.parametrize("cut", [3, HEADER.size + 1])
def test_end_of_stream_inside_a_frame_is_the_end(
    pair: tuple[socket.socket, socket.socket], cut: int
) -> None:
    a, b = pair
    reader = FrameReader(b)
    a.sendall(encode([(9, 1, b"payload")])[:cut])  # in the header, then in the payload
    a.close()
    assert reader.read() is None
    reader.close()


# -- the main process's side: _ReplyProtocol fed by the event loop -----------------------------


class Owner:
    """Records what a _ReplyProtocol hands over."""

    def __init__(self) -> None:
        self.frames: list[tuple[int, int, bytes]] = []
        self.eofs = 0

    def on_frame(self, rid: int, status: int, payload: bytes) -> None:
        self.frames.append((rid, status, bytes(payload)))

    def on_eof(self) -> None:
        self.eofs += 1


def attached() -> tuple[_ReplyProtocol, Owner]:
    protocol, owner = _ReplyProtocol(), Owner()
    protocol.attach(owner.on_frame, owner.on_eof)
    return protocol, owner


def test_one_whole_frame_per_read() -> None:
    protocol, owner = attached()
    for frame in FRAMES:
        protocol.data_received(encode([frame]))
    assert owner.frames == FRAMES


def test_several_frames_in_one_read() -> None:
    protocol, owner = attached()
    protocol.data_received(encode(FRAMES))
    assert owner.frames == FRAMES


@pytest.mark.parametrize("cut", range(1, len(encode(FRAMES[:2]))))
def test_frames_split_at_any_byte(cut: int) -> None:
    data = encode(FRAMES[:2])
    protocol, owner = attached()
    protocol.data_received(data[:cut])
    assert owner.frames == (FRAMES[:1] if cut >= len(encode(FRAMES[:1])) else [])
    protocol.data_received(data[cut:])
    assert owner.frames == FRAMES[:2]


def test_a_frame_trickling_in_byte_by_byte() -> None:
    protocol, owner = attached()
    data = encode(FRAMES[1:2] * 3)
    for i in range(len(data)):
        protocol.feed(data[i : i + 1])
    assert owner.frames == FRAMES[1:2] * 3


def test_a_read_ending_inside_the_next_frame_keeps_the_rest() -> None:
    protocol, owner = attached()
    data = encode(FRAMES)
    middle = len(encode(FRAMES[:2])) + 5  # two whole frames and part of the third's header
    protocol.data_received(data[:middle])
    assert owner.frames == FRAMES[:2]
    protocol.data_received(data[middle:])
    assert owner.frames == FRAMES


def test_bytes_before_attach_are_kept_and_the_end_is_reported_once() -> None:
    protocol, owner = _ReplyProtocol(), Owner()
    protocol.data_received(encode(FRAMES[:2]))
    protocol.eof_received()
    assert protocol.ended and owner.frames == []
    protocol.attach(owner.on_frame, owner.on_eof)
    assert owner.frames == FRAMES[:2]
    assert owner.eofs == 1
    protocol.connection_lost(None)
    assert owner.eofs == 1


def test_infos_pickle_numpy_scalars_as_their_values_and_come_back_the_same() -> None:
    """A step's infos (MuJoCo's numpy floats, counters, flags): every scalar comes back with its
    type and bits, in fewer bytes than the default reduce; anything else as ``dumps`` does."""
    scalars = [
        np.float64(0.024137542317818908),
        np.float32(-0.21170369),
        np.float16(0.1),
        np.float64("nan"),
        np.float64(-0.0),
        np.int64(-3),
        np.int8(-5),
        np.uint64(2**64 - 1),
        np.bool_(True),
    ]
    infos = (
        [{"x": s, "k": k, "name": "a", "arr": np.arange(3)} for k, s in enumerate(scalars)],
        {},
    )
    blob = dumps_infos(infos)
    back = pickle.loads(blob)
    for got, want in zip(back[0], infos[0]):
        assert type(got["x"]) is type(want["x"])
        assert np.asarray(got["x"]).tobytes() == np.asarray(want["x"]).tobytes()
        assert got["k"] == want["k"] and got["name"] == "a"
        assert np.array_equal(got["arr"], want["arr"])
    assert len(blob) < len(dumps(infos))
    assert pickle.loads(dumps_infos({"f": lambda: 7}))["f"]() == 7  # cloudpickle's, as dumps
