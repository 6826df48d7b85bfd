"""``mindqwen serve``: an OpenAI-style HTTP endpoint with dynamic batching.

    POST /v1/completions        {"prompt": "..." | [ids], "max_tokens", "temperature", "top_p",
                                 "top_k", "repetition_penalty", "stop", "seed", "stream"}
    POST /v1/chat/completions   {"messages": [{"role", "content"}], ...same options}
    GET  /health                {"status": "ok", "queued": n, "batches": [sizes of recent batches]}

HTTP comes from the standard library's ``ThreadingHTTPServer`` (one thread per connection); the
model runs on one worker thread. Requests wait in a bounded queue (full: 503). The worker
takes the first request, waits up to ``batch_timeout_ms`` for more (at most
``max_batch_size``), and generates them as one left-padded batch; each row keeps its own
sampling options and stop conditions. Streaming responses are server-sent events, one chunk
per decodable piece of text. ``shutdown()`` stops accepting (503), finishes every queued and
in-flight request, then closes.
"""
from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import List, Optional

from mindqwen.generation import GenerationConfig, Generator, RowResult

MAX_BODY_BYTES = 1 << 20
HISTORY = 256  # batch sizes kept for /health


class RequestError(ValueError):
    """A bad request: HTTP ``status`` with this message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Job:
    """One request on its way through the queue; ``events`` carries text deltas, then the result."""

    prompt: List[int]
    config: GenerationConfig
    events: "queue.Queue" = field(default_factory=queue.Queue)


class BatchWorker:
    """The model thread: drains the queue into batches and generates them.

    Args:
        generator: the ``Generator`` (model + tokenizer + output filter).
        max_batch_size: requests per batch at most.
        batch_timeout_ms: how long the first request waits for company.
        max_queue: queued requests beyond which ``submit`` refuses (503).
    """

    def __init__(self, generator: Generator, max_batch_size: int = 16, batch_timeout_ms: float = 100.0,
                 max_queue: int = 64):
        self.generator, self.max_batch, self.timeout = generator, max_batch_size, batch_timeout_ms / 1000
        self.queue: "queue.Queue[Optional[Job]]" = queue.Queue(maxsize=max_queue)
        self.batch_sizes: List[int] = []
        self.accepting = True
        self.thread = threading.Thread(target=self._loop, name="mindqwen-batcher", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        if not self.accepting:
            raise RequestError("the server is shutting down", 503)
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise RequestError(f"the queue is full ({self.queue.maxsize} requests); retry later", 503) from None

    def stop(self) -> None:
        """Refuse new requests, finish the queued ones, end the thread."""
        self.accepting = False
        self.queue.put(None)  # after every queued job
        self.thread.join()

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            job = self.queue.get()
            if job is None:
                break
            batch, deadline = [job], time.monotonic() + self.timeout
            while len(batch) < self.max_batch:
                try:
                    nxt = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    stopping = True
                    break
                batch.append(nxt)
            self._run(batch)

    def _run(self, batch: List[Job]) -> None:
        self.batch_sizes = (self.batch_sizes + [len(batch)])[-HISTORY:]
        try:
            results = self.generator.run([j.prompt for j in batch], [j.config for j in batch],
                                         on_token=lambda row, _tok, text: text and batch[row].events.put(text))
        except Exception as e:  # a failed batch fails its requests, not the server
            results = [e] * len(batch)
        for job, result in zip(batch, results):
            job.events.put(result)


class Server:
    """The HTTP front end over a ``BatchWorker``.

    Args:
        generator: a ``Generator`` with a tokenizer.
        host, port: where to listen (port 0 picks a free one: see ``address``).
        max_prompt_tokens: longer prompts get 400.
        defaults: generation defaults (``GenerationSection.config`` or a ``GenerationConfig``).
        chat_template: "qwen2.5" | "qwen3" for /v1/chat/completions.
    """

    def __init__(self, generator: Generator, host: str = "127.0.0.1", port: int = 8000,
                 max_batch_size: int = 16, batch_timeout_ms: float = 100.0, max_queue: int = 64,
                 max_prompt_tokens: int = 2048, defaults: Optional[GenerationConfig] = None,
                 chat_template: str = "qwen2.5", model_name: str = "mindqwen"):
        if generator.tokenizer is None:
            raise ValueError("serving needs a tokenizer")
        self.worker = BatchWorker(generator, max_batch_size, batch_timeout_ms, max_queue)
        self.tokenizer, self.max_prompt = generator.tokenizer, max_prompt_tokens
        self.defaults = defaults or GenerationConfig(max_new_tokens=128)
        self.chat_template, self.model_name = chat_template, model_name
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = False  # shutdown waits for in-flight responses
        self.httpd.block_on_close = True
        self.address = self.httpd.server_address

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def start(self) -> "Server":
        """Serve on a background thread (for notebooks and tests)."""
        threading.Thread(target=self.serve_forever, name="mindqwen-http", daemon=True).start()
        return self

    def shutdown(self) -> None:
        """Stop accepting, finish queued and in-flight requests, close the socket."""
        self.worker.stop()
        self.httpd.shutdown()
        self.httpd.server_close()

    # ------------------------------------------------------------------ request handling
    def parse(self, path: str, body: dict) -> Job:
        """Validate a request body into a ``Job``; raises ``RequestError`` (400/404)."""
        if path == "/v1/completions":
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in prompt):
                ids = prompt
            else:
                raise RequestError("'prompt' must be a non-empty string or a list of token ids")
        elif path == "/v1/chat/completions":
            ids = self.tokenizer.encode(self._render_chat(body.get("messages")))
        else:
            raise RequestError(f"no endpoint {path}; use /v1/completions or /v1/chat/completions", 404)
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) > self.max_prompt:
            raise RequestError(f"the prompt has {len(ids)} tokens; the limit is {self.max_prompt}")
        if any(not 0 <= t < self.worker.generator.model.config.vocab_size for t in ids):
            raise RequestError("token ids must be in [0, vocab_size)")
        return Job(ids, self._config(body))

    def _render_chat(self, messages) -> str:
        from mindqwen.data.chat import render
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise RequestError("'messages' must be a non-empty list of {role, content} strings")
        try:
            return render(messages, self.chat_template, add_generation_prompt=True)[0]
        except ValueError as e:
            raise RequestError(str(e)) from None

    def _config(self, body: dict) -> GenerationConfig:
        d = self.defaults
        stop = body.get("stop", list(d.stop_strings))
        options = {"max_new_tokens": body.get("max_tokens", d.max_new_tokens),
                   "temperature": body.get("temperature", d.temperature), "top_p": body.get("top_p", d.top_p),
                   "top_k": body.get("top_k", d.top_k),
                   "repetition_penalty": body.get("repetition_penalty", d.repetition_penalty),
                   "stop_strings": [stop] if isinstance(stop, str) else stop, "seed": body.get("seed")}
        # OpenAI semantics: temperature 0 (or absent with greedy defaults) means greedy.
        options["do_sample"] = bool(body.get("do_sample", d.do_sample if "temperature" not in body
                                             else options["temperature"] > 0))
        if not options["do_sample"]:
            options["temperature"] = 1.0
        try:
            return GenerationConfig(eos_token_id=self.tokenizer.eos_token_id, **options)
        except (TypeError, ValueError) as e:
            raise RequestError(f"bad generation option: {e}") from None

    def response(self, path: str, job: Job, result: RowResult) -> dict:
        chat = path == "/v1/chat/completions"
        choice = {"index": 0, "finish_reason": result.finish_reason}
        choice.update({"message": {"role": "assistant", "content": result.text}} if chat else {"text": result.text})
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:12]}",
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice],
                "usage": {"prompt_tokens": len(job.prompt), "completion_tokens": len(result.tokens),
                          "total_tokens": len(job.prompt) + len(result.tokens)}}


def _handler(server: Server):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 60  # seconds a client may stall while sending; idle sockets never block shutdown

        def log_message(self, fmt, *args):  # keep test and notebook output clean
            pass

        def do_GET(self):
            if self.path != "/health":
                return self._json(404, {"error": {"message": f"no endpoint {self.path}"}})
            w = server.worker
            self._json(200, {"status": "ok" if w.accepting else "shutting down", "queued": w.queue.qsize(),
                             "batches": w.batch_sizes[-32:]})

        def do_POST(self):
            try:
                body = self._body()
                job = server.parse(self.path, body)
                server.worker.submit(job)
            except RequestError as e:
                return self._json(e.status, {"error": {"message": str(e)}})
            if body.get("stream"):
                return self._stream(job)
            result = self._wait(job)
            if isinstance(result, Exception):
                return self._json(500, {"error": {"message": f"generation failed: {result}"}})
            self._json(200, server.response(self.path, job, result))

        def _body(self) -> dict:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                raise RequestError(f"the body has {length} bytes; the limit is {MAX_BODY_BYTES}", 413)
            try:
                body = json.loads(self.rfile.read(length) or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(f"the body is not valid JSON ({e})") from None
            if not isinstance(body, dict):
                raise RequestError("the body must be a JSON object")
            return body

        def _wait(self, job: Job):
            while True:
                event = job.events.get()
                if not isinstance(event, str):
                    return event

        def _stream(self, job: Job) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            chat = self.path == "/v1/chat/completions"
            while True:
                event = job.events.get()
                if isinstance(event, str):
                    delta = {"delta": {"content": event}} if chat else {"text": event}
                    self._event({"choices": [{"index": 0, "finish_reason": None, **delta}]})
                    continue
                if isinstance(event, Exception):
                    self._event({"error": {"message": f"generation failed: {event}"}})
                else:
                    final = {"delta": {}} if chat else {"text": ""}
                    self._event({"choices": [{"index": 0, "finish_reason": event.finish_reason, **final}]})
                self.wfile.write(b"data: [DONE]\n\n")
                return

        def _event(self, payload: dict) -> None:
            self.wfile.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")
            self.wfile.flush()

        def _json(self, status: int, payload: dict) -> None:
            data = json.dumps(payload, ensure_ascii=False).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")  # one request per connection: shutdown never waits on idle ones
            self.end_headers()
            self.close_connection = True
            self.wfile.write(data)

    return Handler
