"""The model thread: continuous batching over one ``SlotBatch``.

Between two decode steps the worker takes the requests that arrived, prefills them together
into free rows of the running batch, and steps every row once; a row leaves the moment it ends
(eos, stop string, length, or its client went away), and its slot is free for the next step
(iteration-level scheduling, as vLLM does). Every check is per request and done before a job
is queued, and a row only ever computes what it would alone, so one request never fails or
changes another. If prefilling several joiners fails, they are prefilled again one by one, so
the failure stays with the request that causes it.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Deque, List, Optional

from mindqwen.generation import GenerationConfig, Generator

HISTORY = 256  # rows per decode step, kept for /health
log = logging.getLogger("mindqwen.serve")


class Busy(RuntimeError):
    """The queue is full or the server is shutting down: HTTP 503."""


@dataclass(eq=False)
class Job:
    """One prompt on its way through the queue. ``events`` (an asyncio queue on ``loop``)
    receives text deltas, then a ``RowResult`` or an exception."""

    prompt: List[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    echo: str = ""  # text the answer starts with (completions' ``echo``: the prompt)
    image: Optional[object] = None  # a multimodal model's pixel values for this prompt

    def put(self, event) -> None:
        """From the worker thread: hand ``event`` to the request's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled.set()


class BatchWorker:
    """Runs the decode batch on its own thread; requests join it between steps.

    Args:
        generator: the ``Generator`` (model + tokenizer + output filter).
        max_batch_size: rows decoding at once at most.
        max_queue: requests waiting for a row beyond which ``submit`` raises ``Busy`` (503).
    """

    def __init__(self, generator: Generator, max_batch_size: int = 16, max_queue: int = 64):
        self.generator, self.max_batch = generator, max_batch_size
        self.batch = generator.batch(max_batch_size)
        self.queue: "queue.Queue[Optional[Job]]" = queue.Queue(maxsize=max_queue)
        self.waiting: Deque[Job] = collections.deque()  # taken from the queue, not yet in a row
        self.batch_sizes: List[int] = []
        self.accepting, self.stopping = True, False
        self.thread = threading.Thread(target=self._loop, name="mindqwen-batcher", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        if not self.accepting:
            raise Busy("the server is shutting down")
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise Busy(f"the queue is full ({self.queue.maxsize} requests); retry later") from None

    def stop(self) -> None:
        """Refuse new requests, finish the queued and running ones, end the thread."""
        self.accepting = False
        self.queue.put(None)  # after every queued job
        self.thread.join()

    def _loop(self) -> None:
        with self.generator.graph_mode():
            while not (self.stopping and not self.waiting and not self.batch.active):
                self._take(block=not self.batch.active and not self.waiting)
                self.waiting = collections.deque(j for j in self.waiting if not j.cancelled.is_set())
                joiners = self._admit()
                if joiners:
                    self._join(joiners)
                if self.batch.active:
                    self._step()
                self._hand_out()

    def _take(self, block: bool) -> None:
        """Move queued jobs to ``waiting``; when idle, wait for the first."""
        while not self.stopping:
            try:
                job = self.queue.get(block=block)
            except queue.Empty:
                return
            if job is None:
                self.stopping = True
            else:
                self.waiting.append(job)
            block = False

    def _admit(self) -> List[Job]:
        """The waiting jobs that join the batch now: as many as there are free rows."""
        return [self.waiting.popleft() for _ in range(min(self.batch.room, len(self.waiting)))]

    def _join(self, jobs: List[Job]) -> None:
        try:
            self.batch.join([j.prompt for j in jobs], [j.config for j in jobs], jobs, self._on_token,
                            [j.image for j in jobs])
        except Exception as e:  # noqa: BLE001 - a failed prefill must not end the worker
            log.exception("prefill failed for %d request(s)", len(jobs))
            if len(jobs) > 1:  # find the request that fails; the others join
                for job in jobs:
                    self._join([job])
            else:
                jobs[0].put(e)

    def _step(self) -> None:
        self.batch_sizes = (self.batch_sizes + [len(self.batch.active)])[-HISTORY:]
        try:
            self.batch.step(self._on_token, lambda job: job.cancelled.is_set())
        except Exception as e:  # noqa: BLE001 - the device step failed: every row ends with it
            log.exception("a decode step failed for %d rows", len(self.batch.active))
            self._hand_out()
            for row in self.batch.active:
                row.owner.put(e)
            self.batch = self.generator.batch(self.max_batch)

    def _hand_out(self) -> None:
        """Give every row that ended its result (or its error)."""
        for row in self.batch.pop_finished():
            row.owner.put(row.error if row.error is not None else row.result())

    @staticmethod
    def _on_token(job: Job, _token: int, text: str) -> None:
        if text:
            job.put(text)
