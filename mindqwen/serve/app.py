"""``mindqwen serve``: the OpenAI API over FastAPI + uvicorn (``pip install mindqwen[serve]``).

    GET  /health                 {"status", "queued", "batches": rows of recent decode steps}
    GET  /v1/models[/{id}]       the served model
    POST /v1/completions         prompt: text, token ids, or a list of them (one choice each)
    POST /v1/chat/completions    messages: {role, content: text | [{"type": "text", ...}]}

Every client error is a 4xx in OpenAI's error shape ``{"error": {"message", "type", "param",
"code"}}``, with the field named; no error body carries a traceback or a file path. Bodies are
typed (``protocol.py``); limits are settings: connections (uvicorn's ``limit_concurrency``:
beyond it, 503), body bytes (413), queued requests (503), prompt tokens, keep-alive. With
``api_key`` every /v1 request needs ``Authorization: Bearer <key>`` (compared in constant time).
Request logs name the endpoint, sizes and status, not the prompt text (``log_prompts`` adds it).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import AsyncIterator, List, Optional

import numpy as np

from mindqwen.generation import GenerationConfig, Generator, RowResult
from mindqwen.serve.protocol import ChatRequest, CompletionRequest, UnsupportedField
from mindqwen.serve.worker import BatchWorker, Busy, Job

IMAGE_SLOT = "\0"  # where an image part sits in a rendered chat, until it becomes the image token

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException
except ImportError as _missing:  # pragma: no cover - the [serve] extra is not installed
    raise ImportError(f"mindqwen serve needs the serving extra: pip install 'mindqwen[serve]' ({_missing})") from None

log = logging.getLogger("mindqwen.serve")
DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there


class ClientGone(Exception):
    """The client disconnected while its request was generating."""


class ApiError(Exception):
    """A response in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class Server:
    """The HTTP front end over a ``BatchWorker``.

    Args:
        generator: a ``Generator`` with a tokenizer.
        host, port: where to listen (port 0 picks a free one: see ``address``).
        max_prompt_tokens: longer prompts get 400.
        defaults: generation defaults (a recipe's ``generation`` section or a ``GenerationConfig``).
        chat_template: "qwen2.5" | "qwen3" for /v1/chat/completions.
        api_key: required as a Bearer token when set.
        max_connections: open connections at most (beyond: 503).
        max_body_bytes: larger request bodies get 413.
        keep_alive_s: idle keep-alive connections close after this.
        log_prompts: include prompt text in the request log.
        allowed_local_media_path: a folder on this machine whose image files a multimodal
            model's chat requests may name (``image_url`` a path or ``file://``); None (default):
            none, data URLs only (always accepted).
    """

    def __init__(self, generator: Generator, host: str = "127.0.0.1", port: int = 8000,
                 max_batch_size: int = 16, max_queue: int = 64,
                 max_prompt_tokens: int = 2048, defaults: Optional[GenerationConfig] = None,
                 chat_template: str = "qwen2.5", model_name: str = "mindqwen", api_key: Optional[str] = None,
                 max_connections: int = 512, max_body_bytes: int = 1 << 20, keep_alive_s: float = 5.0,
                 log_prompts: bool = False, allowed_local_media_path: Optional[str] = None):
        if generator.tokenizer is None:
            raise ValueError("serving needs a tokenizer")
        self.generator, self.tokenizer = generator, generator.tokenizer
        self.worker = BatchWorker(generator, max_batch_size, max_queue)
        self.max_prompt, self.max_body, self.api_key = max_prompt_tokens, max_body_bytes, api_key
        self.max_positions = generator.model.config.context_length
        self.vocab_size = generator.model.config.vocab_size
        self.defaults = defaults or GenerationConfig(max_new_tokens=128)
        self.chat_template, self.model_name, self.log_prompts = chat_template, model_name, log_prompts
        self.image_token_id = generator.image_token_id
        self.media_folder = os.path.realpath(allowed_local_media_path) if allowed_local_media_path else None
        if self.media_folder is not None and not os.path.isdir(self.media_folder):
            raise ValueError(f"serve.allowed_local_media_path: {allowed_local_media_path} is not a folder")
        self.created = int(time.time())
        self.sock = socket.create_server((host, port), backlog=2048, reuse_port=False)
        self.address = self.sock.getsockname()[:2]
        self.uvicorn = uvicorn.Server(uvicorn.Config(
            build_app(self), log_level="warning", access_log=False, lifespan="off",
            limit_concurrency=max_connections, timeout_keep_alive=keep_alive_s, timeout_graceful_shutdown=600))
        self.thread: Optional[threading.Thread] = None

    def serve_forever(self) -> None:
        """Serve until SIGINT/SIGTERM (or ``shutdown``), then finish the queued requests."""
        try:
            self.uvicorn.run(sockets=[self.sock])
        finally:
            if self.worker.accepting:
                self.worker.stop()

    def start(self) -> "Server":
        """Serve on a background thread (for notebooks and tests); returns once listening."""
        self.thread = threading.Thread(target=self.serve_forever, name="mindqwen-http", daemon=True)
        self.thread.start()
        while not self.uvicorn.started and self.thread.is_alive():
            time.sleep(0.01)
        return self

    def shutdown(self) -> None:
        """Refuse new requests (503), finish queued and in-flight ones, close the socket."""
        self.worker.stop()
        self.uvicorn.should_exit = True
        if self.thread is not None:
            self.thread.join()

    # ------------------------------------------------------------------ requests → jobs
    def jobs(self, request, loop) -> List[Job]:
        """One ``Job`` per prompt of a checked request; raises ``ApiError`` (400)."""
        image = None
        if isinstance(request, ChatRequest):
            prompt, image = self.chat_prompt(request)
            prompts, field, new_tokens = [prompt], "messages", request.new_tokens()
        else:
            prompts = [self.tokenizer.encode(p) if isinstance(p, str) else p for p in request.prompts()]
            field, new_tokens = "prompt", request.max_tokens
        jobs = []
        for k, ids in enumerate(prompts):
            if not ids:
                raise ApiError(400, "the prompt is empty", field)
            if len(ids) > self.max_prompt:
                raise ApiError(400, f"the prompt has {len(ids)} tokens; the limit is {self.max_prompt}", field)
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise ApiError(400, f"token ids must be in [0, {self.vocab_size})", field)
            if image is None and self.image_token_id is not None and self.image_token_id in ids:
                raise ApiError(400, f"the prompt holds the image token {self.image_token_id} without an image "
                                    "(send an image_url content part)", field)
            room = self.max_positions - len(ids)
            if new_tokens is not None and new_tokens > room:
                raise ApiError(400, f"the prompt has {len(ids)} tokens and max_tokens is {new_tokens}: together more "
                                    f"than the model's {self.max_positions} positions", "max_tokens")
            if room < 1:
                raise ApiError(400, f"the prompt fills all {self.max_positions} positions", field)
            echo = ""
            if getattr(request, "echo", False):
                given = request.prompts()[k]
                echo = given if isinstance(given, str) else self.tokenizer.decode(given)
            for i in range(request.n):  # n choices: distinct draws (seed, seed + 1, … when seeded)
                config = self.config(request, new_tokens or min(self.defaults.max_new_tokens, room), i)
                jobs.append(Job(list(ids), config, loop, echo=echo, image=image))
        return jobs

    def chat_prompt(self, request: ChatRequest):
        """The prompt ids of a chat request through the chat template and, for a multimodal model,
        its image: the one ``image_url`` part becomes the image token and the pixel values."""
        from mindqwen.data.chat import render
        urls = [url for m in request.messages for url in m.image_urls()]
        slot = IMAGE_SLOT if self.image_token_id is not None else None
        if slot is not None and len(urls) > 1:
            raise ApiError(400, f"a request carries one image (the model attends to one per prompt), got {len(urls)}",
                           "messages")
        try:
            text = render(request.rendered_messages(slot), self.chat_template, add_generation_prompt=True)[0]
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        if not urls:
            return self.tokenizer.encode(text), None
        before, after = text.split(IMAGE_SLOT)
        return (self.tokenizer.encode(before) + [self.image_token_id] + self.tokenizer.encode(after),
                self.read_image(urls[0]))

    def read_image(self, url) -> np.ndarray:
        """An ``image_url`` (a base64 data URL, or a path under ``allowed_local_media_path``) as
        the model's pixel values, transformed as in training; raises ``ApiError`` (400) naming why.
        A path is refused with one message whatever the reason (outside the folder, missing,
        unreadable), so a client cannot learn which files exist on the server."""
        import base64
        import binascii
        import io
        from mindqwen.multimodal.data import apply_transforms, image_transforms, load_image
        vision = self.generator.model.vision_config
        if vision.num_frames > 1:
            raise ApiError(400, "this model reads videos (vision.num_frames > 1): image parts are for image models",
                           "messages")
        if not isinstance(url, str):
            raise ApiError(400, "image_url.url must be a string", "messages")
        if url.startswith("data:"):
            head, _, data = url.partition(",")
            if not head.endswith(";base64"):
                raise ApiError(400, "an image data URL is base64: data:image/png;base64,...", "messages")
            try:
                source = io.BytesIO(base64.b64decode(data, validate=True))
            except (binascii.Error, ValueError):
                raise ApiError(400, "the image data URL is not valid base64", "messages") from None
        elif url.startswith(("http://", "https://")):
            raise ApiError(400, "images are not fetched over the network: send a data URL "
                                "(data:image/png;base64,...)", "messages")
        elif self.media_folder is None:
            raise ApiError(400, "local image paths are off on this server (serve.allowed_local_media_path): "
                                "send a data URL", "messages")
        else:
            return self.read_local_image(url[len("file://"):] if url.startswith("file://") else url)
        try:
            rgb = load_image(source)
        except ValueError as e:
            raise ApiError(400, f"image_url: {str(e).split(': ', 1)[-1]}", "messages") from None
        return apply_transforms(rgb, image_transforms(vision.image_size))

    def read_local_image(self, path: str) -> np.ndarray:
        """``read_image`` of a path: only a readable image file under the allowed folder (links
        resolved first, so neither ``..`` nor a link leads out of it)."""
        from mindqwen.multimodal.data import apply_transforms, image_transforms, load_image
        real = os.path.realpath(path)
        try:
            if os.path.commonpath([real, self.media_folder]) != self.media_folder or not os.path.isfile(real):
                raise ValueError(path)
            rgb = load_image(real)
        except ValueError:
            raise ApiError(400, "image_url: no readable image at this path in the server's allowed folder "
                                "(serve.allowed_local_media_path)", "messages") from None
        return apply_transforms(rgb, image_transforms(self.generator.model.vision_config.image_size))

    def stops(self, request) -> List[str]:
        """The request's stop strings, else the server's defaults."""
        return request.stop_list() if request.stop is not None else list(self.defaults.stop_strings)

    def config(self, request, max_new_tokens: int, choice: int = 0) -> GenerationConfig:
        d = self.defaults
        temperature = d.temperature if request.temperature is None else request.temperature
        # OpenAI semantics: temperature 0 is greedy; absent, the defaults decide.
        do_sample = d.do_sample if request.temperature is None else request.temperature > 0
        return GenerationConfig(
            max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature if do_sample else 1.0,
            top_p=d.top_p if request.top_p is None else request.top_p,
            top_k=d.top_k if request.top_k is None else request.top_k,
            repetition_penalty=d.repetition_penalty if request.repetition_penalty is None else request.repetition_penalty,
            stop_strings=self.stops(request),
            seed=None if request.seed is None else request.seed + choice, eos_token_id=self.tokenizer.eos_token_id,
            top_logprobs=request.top_logprobs_wanted())


def logprobs(tokenizer, result: RowResult, chat: bool) -> Optional[dict]:
    """``result``'s token log-probabilities in OpenAI's completions or chat layout."""
    if result.logprobs is None:
        return None
    piece = lambda i: tokenizer.decode([i])  # noqa: E731
    if chat:
        entry = lambda i, lp: {"token": piece(i), "logprob": lp, "bytes": list(piece(i).encode())}  # noqa: E731
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                            for t, lp, top in result.logprobs]}
    offsets, at = [], 0
    for t, _, _ in result.logprobs:
        offsets.append(at)
        at += len(piece(t))
    return {"tokens": [piece(t) for t, _, _ in result.logprobs],
            "token_logprobs": [lp for _, lp, _ in result.logprobs],
            "top_logprobs": [{piece(i): v for i, v in top} for _, _, top in result.logprobs],
            "text_offset": offsets}


def strip_stop(text: str, result: RowResult, stops) -> str:
    """OpenAI leaves the stop string out of the text."""
    if result.finish_reason == "stop":
        for s in stops:
            if text.endswith(s):
                return text[:-len(s)]
    return text


async def read_json(request: Request, limit: int) -> dict:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body has {declared} bytes; the limit is {limit}")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the body is larger than the limit of {limit} bytes")
    try:
        data = json.loads(body or b"null")
    except (ValueError, RecursionError):
        raise ApiError(400, "the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    return data


def checked(model, data: dict):
    """``model`` validated from ``data``; a bad field is a 400 naming it."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, UnsupportedField):
            raise ApiError(400, str(cause), cause.field, "unsupported_parameter") from None
        param = str(first["loc"][0]) if first["loc"] else None  # the request field, not pydantic's union branch
        message = first["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{param}: {message}" if param else message, param) from None


def usage(jobs: List[Job], n: int, completion: int) -> dict:
    """OpenAI's token counts: each prompt once, whatever ``n`` (the choices per prompt)."""
    prompt = sum(len(j.prompt) for j in jobs[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(payload: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def _server(request: Request) -> Server:
    return request.app.state.server


async def on_api_error(_request, exc: ApiError):
    return exc.response()


async def on_http_error(request, exc: HTTPException):
    message = f"no endpoint {request.method} {request.url.path}" if exc.status_code in (404, 405) else exc.detail
    return ApiError(exc.status_code, str(message)).response()


async def on_validation_error(_request, exc: RequestValidationError):
    return ApiError(400, str(exc.errors()[0].get("msg", "bad request"))).response()


async def on_unexpected(_request, exc: Exception):
    log.error("internal error: %s", type(exc).__name__, exc_info=exc)
    return ApiError(500, "internal server error").response()


async def auth_and_log(request: Request, call_next):
    """Every /v1 request carries the API key, when the server has one; every request is logged."""
    start, key = time.monotonic(), _server(request).api_key
    if key is not None and request.url.path.startswith("/v1/"):
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return ApiError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                            code="invalid_api_key").response()
    response = await call_next(request)
    log.info("%s %s %d %.0f ms", request.method, request.url.path, response.status_code,
             1000 * (time.monotonic() - start))
    return response


async def health(request: Request):
    w = _server(request).worker
    return {"status": "ok" if w.accepting else "shutting down", "queued": w.queue.qsize(),
            "batches": w.batch_sizes[-32:]}


def model_card(server: Server) -> dict:
    return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "mindqwen"}


async def list_models(request: Request):
    return {"object": "list", "data": [model_card(_server(request))]}


async def get_model(request: Request, model_id: str):
    server = _server(request)
    if model_id != server.model_name:
        raise ApiError(404, f"no model {model_id!r}; this server serves {server.model_name!r}", "model",
                       "model_not_found")
    return model_card(server)


async def completions(request: Request):
    return await answer(request, checked(CompletionRequest, await read_json(request, _server(request).max_body)))


async def chat_completions(request: Request):
    return await answer(request, checked(ChatRequest, await read_json(request, _server(request).max_body)))


async def submit(server: Server, req) -> List[Job]:
    """The request's jobs (one per prompt and choice), queued for the batch worker (503 when full)."""
    loop = asyncio.get_running_loop()
    if isinstance(req, ChatRequest) and any(m.image_urls() for m in req.messages):
        # Decoding and resizing an image takes milliseconds to seconds: off the event loop, so
        # streams of other requests keep flowing meanwhile.
        jobs = await loop.run_in_executor(None, server.jobs, req, loop)
    else:
        jobs = server.jobs(req, loop)
    if server.log_prompts:
        log.info("prompt: %r", [server.tokenizer.decode(j.prompt) for j in jobs])
    try:
        for job in jobs:
            server.worker.submit(job)
    except Busy as e:
        for job in jobs:
            job.cancelled.set()
        raise ApiError(503, str(e)) from None
    return jobs


async def answer(http: Request, req):
    """A completion or chat completion: streamed, or whole once every choice is done."""
    server = _server(http)
    jobs = await submit(server, req)
    chat = isinstance(req, ChatRequest)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    if req.stream:
        return StreamingResponse(stream(http, req, jobs, rid, chat), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        results = [await wait(http, job) for job in jobs]
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the rows are already freed
    finally:
        for job in jobs:
            job.cancelled.set()
    stops, choices = server.stops(req), []
    for i, (job, result) in enumerate(zip(jobs, results)):
        text = job.echo + strip_stop(result.text, result, stops)
        body = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        choices.append({"index": i, "finish_reason": result.finish_reason,
                        "logprobs": logprobs(server.tokenizer, result, chat), **body})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": server.model_name, "choices": choices,
            "usage": usage(jobs, req.n, sum(len(r.tokens) for r in results))}


async def next_event(http: Request, job: Job):
    """The job's next event; raises ``ClientGone`` once the client has disconnected."""
    while True:
        try:
            event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            event = None
        if await http.is_disconnected():
            raise ClientGone()
        if event is not None:
            return event


async def wait(http: Request, job: Job) -> RowResult:
    """The job's result, skipping text deltas."""
    while True:
        event = await next_event(http, job)
        if isinstance(event, Exception):
            raise ApiError(500, "generation failed")
        if not isinstance(event, str):
            return event


class Chunks:
    """The server-sent chunks of one streamed response, in OpenAI's completions or chat shape."""

    def __init__(self, server: Server, req, rid: str, chat: bool):
        self.chat = chat
        self.head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": server.model_name}
        self.usage = req.stream_options is not None and req.stream_options.include_usage

    def delta(self, index: int, text: Optional[str], finish: Optional[str], first: bool = False) -> bytes:
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else {} if text is None else {"content": text}
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": None}
        return sse({**self.head, "choices": [choice], **({"usage": None} if self.usage else {})})

    def totals(self, jobs: List[Job], n: int, completion: int) -> bytes:
        return sse({**self.head, "choices": [], "usage": usage(jobs, n, completion)})


async def stream(http: Request, req, jobs: List[Job], rid: str, chat: bool) -> AsyncIterator[bytes]:
    """The choices one after another, each as text deltas, then (if asked) the token counts."""
    server = _server(http)
    chunks, stops, completion = Chunks(server, req, rid, chat), server.stops(req), 0
    # The newest text may be (part of) a stop string, completed by the delta just received:
    # it goes out only once the next delta or the result shows it is not.
    hold = max([len(s) for s in stops] + [0])
    try:
        for index, job in enumerate(jobs):
            if chat:
                yield chunks.delta(index, "", None, first=True)
            elif job.echo:
                yield chunks.delta(index, job.echo, None)
            text, sent = "", 0
            while True:
                event = await next_event(http, job)
                if isinstance(event, str):
                    text += event
                    if len(text) - hold > sent:
                        yield chunks.delta(index, text[sent:len(text) - hold], None)
                        sent = len(text) - hold
                    continue
                if isinstance(event, Exception):
                    yield sse(ApiError(500, "generation failed").body())
                    break
                final = strip_stop(text, event, stops)
                completion += len(event.tokens)
                if len(final) > sent:
                    yield chunks.delta(index, final[sent:], None)
                yield chunks.delta(index, None if chat else "", event.finish_reason)
                break
        if chunks.usage:
            yield chunks.totals(jobs, req.n, completion)
        yield b"data: [DONE]\n\n"
    except ClientGone:
        pass
    finally:  # the client went away (or the stream ended): free the rows
        for job in jobs:
            job.cancelled.set()


def build_app(server: Server) -> "FastAPI":
    """The routes, error handlers and middleware; the handlers find ``server`` in the app's state."""
    app = FastAPI(title="mindqwen", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)
    app.middleware("http")(auth_and_log)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    return app
