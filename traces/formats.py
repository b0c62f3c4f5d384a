"""Trace formats: Mooncake's FAST'25 JSONL and kvtier's session JSONL, read and written as streams.

Mooncake (one object per line, ordered by ``timestamp``)::

    {"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1, ...]}

``timestamp`` is milliseconds from the start; each hash id names one ``block_tokens``-token
block *and everything before it*, so two requests share a prefix exactly as far as their
``hash_ids`` agree from the start; ``len(hash_ids) == ceil(input_length / block_tokens)``.

Session (kvtier's agentic format): the same fields plus ``session_id`` (a string) and ``turn``
(1 for a session's first request). Lines are ordered by timestamp; a session's turns appear in
order. Unknown fields are ignored in both formats.

Readers validate every line and raise ``KvtierError(INVALID_ARGUMENT)`` naming the file and
line; they hold one line at a time, so a multi-million-request file costs no more memory than
a short one. ``.gz`` files are read and written transparently.
"""

from __future__ import annotations

import enum
import gzip
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import msgspec

from kvtier.core.errors import ErrorCode, KvtierError

DEFAULT_BLOCK_TOKENS = 512  # Mooncake's hash block


class TraceFormat(enum.StrEnum):
    AUTO = "auto"
    MOONCAKE = "mooncake"
    SESSION = "session"


class TraceRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One request of a trace. ``session_id``/``turn`` are None in the Mooncake format."""

    timestamp: float  # ms from the trace's start
    input_length: int  # prompt tokens
    output_length: int  # generated tokens
    hash_ids: list[int]  # one per prompt block, prefix-chained
    session_id: str | None = None
    turn: int | None = None

    @property
    def timestamp_s(self) -> float:
        return self.timestamp / 1000.0


_decoder = msgspec.json.Decoder(TraceRequest)
_encoder = msgspec.json.Encoder()


def _open_text(path: Path, mode: str) -> IO[str]:
    if path.suffix == ".gz":
        binary: Any = gzip.open(path, mode + "b")  # noqa: SIM115 - the wrapper owns it
        return io.TextIOWrapper(binary, encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def _bad(path: Path | str, line_no: int, why: str) -> KvtierError:
    return KvtierError(ErrorCode.INVALID_ARGUMENT, f"{path}:{line_no}: {why}")


def check_request(
    req: TraceRequest, block_tokens: int, path: Path | str = "<trace>", line_no: int = 0
) -> None:
    """Raise when a request breaks the format's rules (see the module docstring)."""
    if req.input_length < 0 or req.output_length < 0:
        raise _bad(path, line_no, "input_length and output_length must be >= 0")
    if req.timestamp < 0:
        raise _bad(path, line_no, f"timestamp {req.timestamp} is negative")
    want = -(-req.input_length // block_tokens)
    if len(req.hash_ids) != want:
        raise _bad(
            path,
            line_no,
            f"{len(req.hash_ids)} hash_ids for input_length {req.input_length}: expected "
            f"ceil({req.input_length}/{block_tokens}) = {want} (is --block-tokens right?)",
        )
    if (req.session_id is None) != (req.turn is None):
        raise _bad(path, line_no, "session_id and turn come together")
    if req.turn is not None and req.turn < 1:
        raise _bad(path, line_no, f"turn {req.turn} must be >= 1")


def detect_format(path: Path) -> TraceFormat:
    """Session format when the first non-empty line carries a ``session_id``."""
    with _open_text(path, "r") as f:
        for raw in f:
            if raw.strip():
                try:
                    first = msgspec.json.decode(raw)
                except msgspec.DecodeError as e:
                    raise _bad(path, 1, f"not JSON: {e}") from None
                if isinstance(first, dict) and "session_id" in first:
                    return TraceFormat.SESSION
                return TraceFormat.MOONCAKE
    return TraceFormat.MOONCAKE


class TraceReader:
    """Iterate a trace file one request at a time.

    ``bytes_read``/``total_bytes`` drive progress bars. Timestamps must not decrease: replay
    and simulation rely on file order being time order. Not thread-safe.
    """

    def __init__(
        self,
        path: Path | str,
        fmt: TraceFormat | str = TraceFormat.AUTO,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
    ) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"trace {self.path} does not exist")
        if block_tokens <= 0:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "block_tokens must be positive")
        self.format = TraceFormat(fmt)
        if self.format is TraceFormat.AUTO:
            self.format = detect_format(self.path)
        self.block_tokens = block_tokens
        self.total_bytes = os.path.getsize(self.path)
        self.bytes_read = 0

    def __iter__(self) -> Iterator[TraceRequest]:
        want_session = self.format is TraceFormat.SESSION
        last_ts = float("-inf")
        turns: dict[str, int] = {}
        with _open_text(self.path, "r") as f:
            for line_no, raw in enumerate(f, 1):
                self.bytes_read += len(raw)
                if not raw.strip():
                    continue
                try:
                    req = _decoder.decode(raw)
                except msgspec.DecodeError as e:
                    raise _bad(self.path, line_no, str(e)) from None
                check_request(req, self.block_tokens, self.path, line_no)
                if want_session and req.session_id is None:
                    raise _bad(self.path, line_no, "session format needs session_id and turn")
                if not want_session and req.session_id is not None:
                    req = msgspec.structs.replace(req, session_id=None, turn=None)
                if req.timestamp < last_ts:
                    raise _bad(
                        self.path,
                        line_no,
                        f"timestamp {req.timestamp} < previous {last_ts}: sort the trace by time",
                    )
                last_ts = req.timestamp
                if want_session:
                    assert req.session_id is not None and req.turn is not None
                    prev = turns.get(req.session_id, 0)
                    if req.turn <= prev:
                        raise _bad(
                            self.path,
                            line_no,
                            f"session {req.session_id!r} turn {req.turn} after turn {prev}",
                        )
                    turns[req.session_id] = req.turn
                yield req


def read_trace(
    path: Path | str,
    fmt: TraceFormat | str = TraceFormat.AUTO,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> Iterator[TraceRequest]:
    return iter(TraceReader(path, fmt, block_tokens))


class TraceWriter:
    """Write requests one line at a time (Mooncake drops session fields). A context manager."""

    def __init__(self, path: Path | str, fmt: TraceFormat | str = TraceFormat.SESSION) -> None:
        self.path = Path(path)
        self.format = TraceFormat(fmt)
        if self.format is TraceFormat.AUTO:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "choose mooncake or session to write")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = _open_text(self.path, "w")
        self.count = 0

    def write(self, req: TraceRequest) -> None:
        if self.format is TraceFormat.SESSION and req.session_id is None:
            raise KvtierError(
                ErrorCode.INVALID_ARGUMENT, "session format needs session_id and turn"
            )
        obj: dict[str, object] = {}
        if self.format is TraceFormat.SESSION:
            obj["session_id"] = req.session_id
            obj["turn"] = req.turn
        obj["timestamp"] = _int_if_whole(req.timestamp)
        obj["input_length"] = req.input_length
        obj["output_length"] = req.output_length
        obj["hash_ids"] = req.hash_ids
        self._f.write(_encoder.encode(obj).decode())
        self._f.write("\n")
        self.count += 1

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _int_if_whole(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x
