"""``kvtier trace replay``: send a trace to an OpenAI-compatible endpoint and time it.

Each request becomes a streaming ``POST /v1/completions`` whose ``prompt`` is a list of token
ids (prompts.py: shared hash ids give shared token prefixes), ``max_tokens`` the trace's
output length (optionally capped) and ``ignore_eos`` so the server generates that many. Timing:
TTFT = first streamed token, TPOT = (last token - first token) / (output tokens - 1), E2E =
whole response; all from the client's clock.

Three pacings:
- open loop (default): request i is sent at ``timestamp_i * time_scale`` after the start,
  whatever is in flight (``lag_s`` records a late send: the client could not keep up);
- closed loop (``concurrency``): that many requests in flight; a session's next turn waits
  for its previous turn to finish (sessions named by the trace, or derived, see sessions.py).
  Items are taken in file order, so a slow session holds back the turns queued behind it;
- closed loop per session (``per_session``): each session sends its turns one after the
  other, each as soon as its previous one finished, independently of the other sessions;
  ``concurrency`` sessions at a time (all if None), a waiting session starting when one
  ends. The items are grouped by session first (held in memory: for generated workloads and
  small traces).

Every request gives one record, written and flushed as one JSON line at once (``ResultSink``),
so a crash loses at most the requests in flight; ``resume`` skips those already recorded.
Errors and timeouts are records too: nothing is dropped.

Reuse: ``ReplayItem`` + ``Replayer.run`` take any iterable of items, so other benchmarks (a
capacity knee, tier latency) build their own prompts and share the client, the pacing, the
sink and ``summary.summarize``. A server's Prometheus counters, read around a replay:
``server_metrics.py``.

Threading: one asyncio loop; ``Replayer`` is not thread-safe.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.traces.formats import DEFAULT_BLOCK_TOKENS, TraceFormat, TraceReader
from kvtier.traces.prompts import (
    DEFAULT_CLASSES,
    PromptBuilder,
    PromptSpec,
    TokenClass,
    classify,
    parse_classes,
)
from kvtier.traces.sessions import SessionTracker


@dataclass
class ReplayItem:
    """One request to send. ``tokens`` is built lazily (``make_tokens``) at send time."""

    index: int
    scheduled_s: float  # send time after the start, open loop
    max_tokens: int
    make_tokens: Callable[[], list[int]]
    session: str = ""
    turn: int = 1
    cls: str = ""
    warmup: bool = False
    expected_cached_tokens: int = 0  # what an infinite prefix cache would hit
    meta: dict[str, Any] = field(default_factory=dict)  # copied into the record


@dataclass
class ReplayResult:
    index: int
    session: str
    turn: int
    cls: str
    warmup: bool
    status: str  # ok | error | timeout
    scheduled_s: float
    sent_s: float = 0.0
    lag_s: float = 0.0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    expected_cached_tokens: int = 0
    http_status: int | None = None
    error: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplayOptions:
    url: str  # base URL: http://host:port (the client adds /v1/completions)
    model: str
    timeout_s: float = 600.0  # per request, end to end
    concurrency: int | None = None  # None: open loop at trace timing
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    max_in_flight: int = 4096  # open loop: a guard; a send that waits for it shows as lag
    per_session: bool = False  # closed loop per session (see the module docstring)


class ResultSink:
    """Append-only JSONL of ``ReplayResult``: one flushed line per request (crash-safe).

    ``done`` lists the indices already recorded (resume). A torn last line, left by a crash in
    the middle of a write, is cut off before appending.
    """

    def __init__(self, path: Path | str, resume: bool = False) -> None:
        self.path = Path(path)
        self.done: set[int] = set()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume and self.path.exists():
            self._recover()
            mode = "a"
        else:
            mode = "w"
        self._f = open(self.path, mode, encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._last_sync = time.monotonic()

    def _recover(self) -> None:
        data = self.path.read_bytes()
        cut = data.rfind(b"\n") + 1
        if cut < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(cut)
        for line in data[:cut].splitlines():
            if line.strip():
                self.done.add(int(json.loads(line)["index"]))

    def write(self, result: ReplayResult) -> None:
        self._f.write(json.dumps(asdict(result), separators=(",", ":")) + "\n")
        self._f.flush()
        now = time.monotonic()
        if now - self._last_sync > 1.0:
            os.fsync(self._f.fileno())
            self._last_sync = now

    def close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


def iter_results(path: Path | str) -> Iterator[dict[str, Any]]:
    """The records of a results file, one at a time (a torn last line is skipped)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line after a crash


def read_results(path: Path | str) -> list[dict[str, Any]]:
    return list(iter_results(path))


class CompletionClient:
    """Streams one completion and times it. Owns an aiohttp session; use ``async with``."""

    def __init__(self, opts: ReplayOptions) -> None:
        self.opts = opts
        self.endpoint = opts.url.rstrip("/") + "/v1/completions"
        self._session: Any = None

    async def __aenter__(self) -> CompletionClient:
        import aiohttp

        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), read_bufsize=1 << 20
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()

    def body(self, tokens: list[int], max_tokens: int) -> dict[str, Any]:
        body = {
            "model": self.opts.model,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "temperature": self.opts.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.opts.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.opts.extra_body)
        return body

    async def send(self, item: ReplayItem, start: float) -> ReplayResult:
        """Send ``item`` now; ``start`` is the replay's perf_counter origin."""
        import aiohttp

        res = ReplayResult(
            index=item.index,
            session=item.session,
            turn=item.turn,
            cls=item.cls,
            warmup=item.warmup,
            status="error",
            scheduled_s=item.scheduled_s,
            expected_cached_tokens=item.expected_cached_tokens,
            meta=item.meta,
        )
        tokens = item.make_tokens()
        res.prompt_tokens = len(tokens)
        t0 = time.perf_counter()
        res.sent_s = t0 - start
        first = last = None
        chunks = 0
        try:
            async with asyncio.timeout(self.opts.timeout_s):
                async with self._session.post(
                    self.endpoint, json=self.body(tokens, item.max_tokens)
                ) as resp:
                    res.http_status = resp.status
                    if resp.status != 200:
                        res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                        return _finish(res, t0)
                    async for raw in resp.content:
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            break
                        obj = json.loads(data)
                        if obj.get("error"):
                            res.error = f"stream error: {str(obj['error'])[:300]}"
                            return _finish(res, t0)
                        if obj.get("choices"):
                            now = time.perf_counter()
                            if first is None:
                                first = now
                                res.ttft_s = first - t0  # kept even if it then times out
                            last = now
                            chunks += 1
                        usage = obj.get("usage")
                        if usage:
                            res.prompt_tokens = usage.get("prompt_tokens") or res.prompt_tokens
                            res.output_tokens = usage.get("completion_tokens") or 0
                            details = usage.get("prompt_tokens_details") or {}
                            if details.get("cached_tokens") is not None:
                                res.cached_tokens = int(details["cached_tokens"])
        except TimeoutError:
            res.status = "timeout"
            res.error = f"no complete response within {self.opts.timeout_s} s"
            return _finish(res, t0)
        except (aiohttp.ClientError, OSError, ValueError) as e:
            res.error = f"{type(e).__name__}: {e}"[:300]
            return _finish(res, t0)
        if first is None:
            res.error = "the stream ended without a token"
            return _finish(res, t0)
        res.status = "ok"
        res.output_tokens = res.output_tokens or chunks
        if res.output_tokens > 1 and last is not None:
            res.tpot_s = (last - first) / (res.output_tokens - 1)
        return _finish(res, t0)


def _finish(res: ReplayResult, t0: float) -> ReplayResult:
    res.e2e_s = time.perf_counter() - t0
    return res


class Replayer:
    """Paces items (open or closed loop), sends them, records every result."""

    def __init__(
        self,
        opts: ReplayOptions,
        sink: ResultSink | None = None,
        on_result: Callable[[ReplayResult], None] | None = None,
        keep_results: bool = True,
    ) -> None:
        self.opts = opts
        self.sink = sink
        self.on_result = on_result
        self.keep_results = keep_results  # False for long runs: the sink has them all
        self.results: list[ReplayResult] = []

    def _record(self, res: ReplayResult) -> None:
        if self.keep_results:
            self.results.append(res)
        if self.sink is not None:
            self.sink.write(res)
        if self.on_result is not None:
            self.on_result(res)

    async def run(self, items: Iterable[ReplayItem]) -> list[ReplayResult]:
        async with CompletionClient(self.opts) as client:
            start = time.perf_counter()
            if self.opts.per_session:
                await self._session_loop(client, items, start)
            elif self.opts.concurrency:
                await self._closed_loop(client, items, start)
            else:
                await self._open_loop(client, items, start)
        return self.results

    async def _open_loop(
        self, client: CompletionClient, items: Iterable[ReplayItem], start: float
    ) -> None:
        gate = asyncio.Semaphore(self.opts.max_in_flight)
        tasks: set[asyncio.Task[None]] = set()

        async def one(item: ReplayItem) -> None:
            try:
                res = await client.send(item, start)
                res.lag_s = max(0.0, res.sent_s - item.scheduled_s)
                self._record(res)
            finally:
                gate.release()

        for item in items:
            delay = item.scheduled_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            await gate.acquire()
            task = asyncio.create_task(one(item))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    async def _closed_loop(
        self, client: CompletionClient, items: Iterable[ReplayItem], start: float
    ) -> None:
        source: Iterator[ReplayItem] = iter(items)
        in_flight: dict[str, asyncio.Event] = {}  # session -> its latest turn's completion

        async def worker() -> None:
            for item in source:  # the shared iterator hands each item to one worker
                previous = in_flight.get(item.session) if item.session else None
                done = asyncio.Event()
                if item.session:
                    in_flight[item.session] = done
                try:
                    if previous is not None:
                        await previous.wait()
                    self._record(await client.send(item, start))
                finally:
                    done.set()
                    if item.session and in_flight.get(item.session) is done:
                        del in_flight[item.session]

        assert self.opts.concurrency
        await asyncio.gather(*(worker() for _ in range(self.opts.concurrency)))

    async def _session_loop(
        self, client: CompletionClient, items: Iterable[ReplayItem], start: float
    ) -> None:
        sessions: dict[str, list[ReplayItem]] = {}
        for item in items:  # an item without a session is a session of its own
            sessions.setdefault(item.session or f"#{item.index}", []).append(item)
        waiting: Iterator[list[ReplayItem]] = iter(sessions.values())

        async def worker() -> None:
            for turns in waiting:  # the shared iterator hands each session to one worker
                for item in turns:
                    self._record(await client.send(item, start))

        workers = min(self.opts.concurrency or len(sessions), len(sessions))
        await asyncio.gather(*(worker() for _ in range(workers)))


# -- trace -> items ------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceReplaySpec:
    prompt: PromptSpec = field(default_factory=PromptSpec)
    max_output_tokens: int | None = None  # cap on the trace's output_length
    limit: int | None = None  # requests to send (warm-up included)
    warmup: int = 0  # first requests sent but left out of the summary
    time_scale: float = 1.0
    classes: str = DEFAULT_CLASSES
    skip: frozenset[int] = frozenset()  # indices already recorded (resume)


def trace_items(
    path: Path | str,
    spec: TraceReplaySpec,
    fmt: TraceFormat | str = TraceFormat.AUTO,
    trace_block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> Iterator[ReplayItem]:
    """Stream a trace file as replay items (sessions, classes and expected hits attached)."""
    if spec.time_scale <= 0:
        raise KvtierError(ErrorCode.INVALID_ARGUMENT, "time scale must be > 0")
    reader = TraceReader(path, fmt, trace_block_tokens)
    builder = PromptBuilder(spec.prompt)
    classes: list[TokenClass] = parse_classes(spec.classes)
    tracker = SessionTracker.standalone(
        trace_block_tokens, derive=reader.format is TraceFormat.MOONCAKE
    )
    first_ts: float | None = None
    bt = spec.prompt.block_tokens
    for index, req in enumerate(reader):
        if spec.limit is not None and index >= spec.limit:
            return
        obs = tracker.observe(req)
        if first_ts is None:
            first_ts = req.timestamp
        if index in spec.skip:
            continue
        prompt_len = builder.prompt_length(req.input_length, len(req.hash_ids))
        new_tokens = req.input_length - min(obs.hit_blocks * trace_block_tokens, req.input_length)
        out = req.output_length
        if spec.max_output_tokens is not None:
            out = min(out, spec.max_output_tokens)
        yield ReplayItem(
            index=index,
            scheduled_s=(req.timestamp - first_ts) / 1000.0 * spec.time_scale,
            max_tokens=max(out, 1),
            make_tokens=functools.partial(builder.request_tokens, req),
            session=req.session_id or f"d{obs.session}",
            turn=obs.turn,
            cls=classify(classes, new_tokens),
            warmup=index < spec.warmup,
            expected_cached_tokens=min(obs.hit_blocks * bt, prompt_len),
            meta={"trace_input_length": req.input_length, "trace_new_tokens": new_tokens},
        )


async def replay_trace(
    path: Path | str,
    opts: ReplayOptions,
    spec: TraceReplaySpec,
    sink: ResultSink,
    fmt: TraceFormat | str = TraceFormat.AUTO,
    trace_block_tokens: int = DEFAULT_BLOCK_TOKENS,
    on_result: Callable[[ReplayResult], None] | None = None,
    keep_results: bool = True,
) -> list[ReplayResult]:
    replayer = Replayer(opts, sink, on_result, keep_results)
    items = trace_items(path, spec, fmt, trace_block_tokens)
    return await replayer.run(items)
