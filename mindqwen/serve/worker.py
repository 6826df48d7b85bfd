"""The model thread: requests queue up, the worker drains them into batches and generates.

The first queued request waits up to ``batch_timeout_ms`` for company (at most
``max_batch_size``). A request joins a batch only if the batch still fits the model's positions
(longest prompt + largest ``max_tokens``), so two requests that fit alone never fail together;
one that does not fit waits for the next batch. If a batch fails, its requests are run again
one by one, so a failure stays with the request that causes it. A request whose client went
away is cancelled: its row stops at the next decode step.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Deque, List, Optional

from mindqwen.generation import GenerationConfig, Generator

HISTORY = 256  # batch sizes kept for /health
log = logging.getLogger("mindqwen.serve")


class Busy(RuntimeError):
    """The queue is full or the server is shutting down: HTTP 503."""


@dataclass
class Job:
    """One prompt on its way through the queue. ``events`` (an asyncio queue on ``loop``)
    receives text deltas, then a ``RowResult`` or an exception."""

    prompt: List[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    streamed: bool = False  # text has gone out: a failed batch cannot run this job again
    echo: str = ""  # text the answer starts with (completions' ``echo``: the prompt)

    def put(self, event) -> None:
        """From the worker thread: hand ``event`` to the request's event loop."""
        self.streamed = self.streamed or isinstance(event, str)
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled.set()

    @property
    def length(self) -> int:
        return len(self.prompt) + self.config.max_new_tokens


class BatchWorker:
    """Drains the queue into batches that fit ``max_positions`` and generates them.

    Args:
        generator: the ``Generator`` (model + tokenizer + output filter).
        max_batch_size: requests per batch at most.
        batch_timeout_ms: how long the first request waits for company.
        max_queue: queued requests beyond which ``submit`` raises ``Busy`` (503).
    """

    def __init__(self, generator: Generator, max_batch_size: int = 16, batch_timeout_ms: float = 100.0,
                 max_queue: int = 64):
        self.generator, self.max_batch, self.timeout = generator, max_batch_size, batch_timeout_ms / 1000
        self.max_positions = generator.model.config.max_position_embeddings
        self.queue: "queue.Queue[Optional[Job]]" = queue.Queue(maxsize=max_queue)
        self.held: Deque[Job] = collections.deque()  # did not fit the last batch: first in the next
        self.batch_sizes: List[int] = []
        self.accepting = True
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
        """Refuse new requests, finish the queued ones, end the thread."""
        self.accepting = False
        self.queue.put(None)  # after every queued job
        self.thread.join()

    def _loop(self) -> None:
        stopping = False
        while not (stopping and not self.held):
            first = self.held.popleft() if self.held else self.queue.get()
            if first is None:
                stopping = True
                continue
            batch, deadline = [first], time.monotonic() + self.timeout
            while len(batch) < self.max_batch and not stopping:
                if self.held:
                    nxt = self.held.popleft()
                else:
                    try:
                        nxt = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
                    except queue.Empty:
                        break
                if nxt is None:
                    stopping = True
                elif self._fits(batch + [nxt]):
                    batch.append(nxt)
                else:
                    self.held.append(nxt)
                    break
            self._run([j for j in batch if not j.cancelled.is_set()])

    def _fits(self, batch: List[Job]) -> bool:
        return (max(len(j.prompt) for j in batch) + max(j.config.max_new_tokens for j in batch)
                <= self.max_positions)

    def _run(self, batch: List[Job]) -> None:
        if not batch:
            return
        self.batch_sizes = (self.batch_sizes + [len(batch)])[-HISTORY:]
        try:
            results = self.generator.run([j.prompt for j in batch], [j.config for j in batch],
                                         on_token=lambda row, _tok, text: text and batch[row].put(text),
                                         cancelled=lambda row: batch[row].cancelled.is_set())
        except Exception as e:  # noqa: BLE001 - a failed batch must not end the worker
            log.exception("generation failed for a batch of %d", len(batch))
            if len(batch) > 1:  # find the request that fails; the others get their answers
                for job in batch:
                    job.put(e) if job.streamed else self._run([job])
                return
            results = [e]
        for job, result in zip(batch, results):
            job.put(result)
