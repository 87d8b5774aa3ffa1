"""The server's engine: one background thread owns the Generator and batches the requests of
every client together.

Requests (`Engine.submit`: prompts and their SamplingParams) wait in a queue. The thread runs
one long `Generator.stream`: whenever the generator has admitted everything fed so far (at
each host check, every `check_every` decode steps), its feed takes every request waiting and
hands them over as one batch. Their groups take the free cache rows at once and decode
alongside the rows already running (continuous batching), so requests from many clients
share every decode step. A request's future completes when its batch does: `stream` yields
batches in the order they were fed, so a short request fed after a long one waits for it.
A request submitted with `on_tokens` hears its samples' new tokens at each host check
(`SamplingParams.stream`), before its future completes: the server's token streaming.

A `Generator.swap_hook` (tidal/serve/follow.py: the newest policy of an RL run's store) runs
between decode steps as in RL, and while the engine is idle.

Requests are checked before they are queued (`Engine.check`, the Generator's own checks), so
a bad one never reaches the stream; should the stream raise anyway, the requests in flight
get the error and the thread starts a new stream.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from tidal.generate import Generator, Sample, SamplingParams
from tidal.generate.slots import make_requests

_IDLE_WAIT_S = 0.05
"""How long the feed waits for a request when nothing is in flight (bounded, to see stop)."""


@dataclass(slots=True)
class EngineStats:
    """What the engine did since it started (tests and benchmarks read them)."""

    requests: int = 0
    """Requests completed or failed."""
    batches_fed: int = 0
    """Batches handed to the Generator's stream."""
    largest_batch: int = 0
    """Most requests in one fed batch."""
    max_in_flight: int = 0
    """Most requests fed to the Generator and not yet complete at once: they shared decode
    steps."""
    restarts: int = 0
    """Streams started again after an error."""


Listener = Callable[[int, int, list[int]], None]
"""`on_tokens(prompt_index, sample_index, ids)` of `Engine.submit`: a running sample's new
tokens."""


@dataclass(slots=True)
class _Job:
    prompts: list[list[int]]
    params: list[SamplingParams]
    future: Future[list[list[Sample]]]
    on_tokens: Listener | None = None


class Engine:
    """Owns `generator` on a background thread (`start`, `stop`) and serves `submit`.

    Example::

        engine = Engine(generator)
        engine.start()
        groups = engine.submit([ids], [SamplingParams(n=2)]).result()
        engine.stop()
    """

    def __init__(self, generator: Generator):
        self.generator = generator
        self.stats = EngineStats()
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._fed: deque[list[_Job]] = deque()
        self._yielded = 0  # batches of the current stream already yielded (left _fed)
        self._in_flight = 0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the client side ------------------------------------------------------------------

    def check(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> None:
        """Raise the ValueError the Generator would raise for this request (too long a prompt,
        n over max_batch, a stop string the tokenizer cannot produce, ...)."""
        g = self.generator
        make_requests(
            prompts,
            params,
            vocab_size=g.vocab_size,
            capacity=g.capacity,
            model_max_seq_len=g.model.args.max_seq_len,
            max_batch=g.config.max_batch,
            tokenizer=g.tokenizer,
        )

    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        on_tokens: Listener | None = None,
    ) -> Future[list[list[Sample]]]:
        """Queue one request (checked first: ValueError here, not in the engine); the future
        gives one list of n samples per prompt, as `Generator.generate` returns them.

        `on_tokens(prompt_index, sample_index, ids)` is called on the engine's thread with
        each running sample's new tokens at every host check (see `Generator.stream`), all
        before the future completes. A listener that raises is not called again; its request
        completes all the same."""
        if self._stopping.is_set():
            raise RuntimeError("the engine is stopped")
        self.check(prompts, params)
        if on_tokens is not None:
            params = [replace(p, stream=True) for p in params]
        future: Future[list[list[Sample]]] = Future()
        self._queue.put(_Job([list(p) for p in prompts], list(params), future, on_tokens))
        return future

    # -- the thread -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (requests submitted before wait for it)."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self._thread = threading.Thread(target=self._loop, name="tidal-serve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Let the batches in flight finish, stop the thread and fail what still waits."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            job.future.set_exception(RuntimeError("the server is shutting down"))

    def _feed(self, idle: bool) -> tuple[list[list[int]], list[SamplingParams]] | None | object:
        if self._stopping.is_set():
            return Generator.END
        if idle:
            self._swap_idle()
        try:
            first = self._queue.get(timeout=_IDLE_WAIT_S) if idle else self._queue.get_nowait()
        except queue.Empty:
            return None
        if idle:  # a version published while idle serves this request from its first token
            self._swap_idle()
        jobs = [first]
        while True:
            try:
                jobs.append(self._queue.get_nowait())
            except queue.Empty:
                break
        self._fed.append(jobs)
        self._in_flight += len(jobs)
        s = self.stats
        s.batches_fed += 1
        s.largest_batch = max(s.largest_batch, len(jobs))
        s.max_in_flight = max(s.max_in_flight, self._in_flight)
        prompts = [p for job in jobs for p in job.prompts]
        params = [p for job in jobs for p in job.params]
        return prompts, params

    def _swap_idle(self) -> None:
        """Run the swap hook with nothing in flight (the Generator runs it only while rows
        decode); the version it loads is the one new rows are stamped with."""
        hook = self.generator.swap_hook
        if hook is not None:
            version = hook()
            if version is not None:
                self.generator.version = version

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._yielded = 0
            try:
                for groups in self.generator.stream(self._feed, on_tokens=self._report):
                    self._finish(self._fed.popleft(), groups)
                    self._yielded += 1
            except Exception as e:  # fail the requests in flight, serve on
                self.stats.restarts += 1
                while self._fed:
                    for job in self._fed.popleft():
                        self._done(job, error=e)

    def _report(self, batch: int, index: int, sample_index: int, ids: list[int]) -> None:
        """The Generator's `on_tokens`: hand a streamed sample's new tokens to its job."""
        for job in self._fed[batch - self._yielded]:
            if index < len(job.prompts):
                break
            index -= len(job.prompts)
        if job.on_tokens is None:
            return
        try:
            job.on_tokens(index, sample_index, ids)
        except Exception:  # e.g. a client gone; the request still completes
            job.on_tokens = None

    def _finish(self, jobs: list[_Job], groups: list[list[Sample]]) -> None:
        at = 0
        for job in jobs:
            mine = groups[at : at + len(job.prompts)]
            for k, group in enumerate(mine):  # numbered in the job, not in the fed batch
                for sample in group:
                    sample.prompt_index = k
            self._done(job, result=mine)
            at += len(job.prompts)

    def _done(self, job: _Job, *, result: Any = None, error: BaseException | None = None) -> None:
        self._in_flight -= 1
        self.stats.requests += 1
        if job.future.set_running_or_notify_cancel():
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)
