"""The OpenAI-compatible HTTP API in front of `AsyncLLM` (vLLM's `vllm serve` routes and shapes).

`POST /v1/completions`, `POST /v1/chat/completions` (with `"stream": true`: server-sent events, one chunk per engine
step that produced text, `data: [DONE]` at the end, a usage chunk first when `stream_options.include_usage`),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text, `serve.metrics`). With an API key every `/v1`
route wants `Authorization: Bearer KEY`. Bad input gets HTTP 400 in OpenAI's error shape naming the field (every error
has that shape: 401, 404 for an unknown model or route, 405, 413 for a body over the limit, 500, 503); a full queue
gets 503; a client that disconnects, streaming or not, has its request aborted (its KV blocks go back); a request
whose serving raises fails alone (500) while the engine keeps stepping the others."""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmso_lab.engine.sampling_params import SamplingParams
from llmso_lab.serve.async_llm import AsyncLLM, Delta, EngineDead, Overloaded, RequestFailed, RequestStream, Usage
from llmso_lab.serve.metrics import CONTENT_TYPE, ServerMetrics

# OpenAI / vLLM fields this server does not implement: accepted at their "off" value, refused otherwise.
NOT_YET = {"logit_bias": None, "echo": False, "best_of": None, "suffix": None}
MAX_N = 128                  # completions per request (OpenAI's limit): each is a sequence the engine steps
MAX_REQUEST_BYTES = 4 << 20  # a request body larger than this gets a 413 before it is read further


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None   # sent by OpenAI clients; not used
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict | None = None   # not implemented (NOT_YET)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        for name, off in NOT_YET.items():
            if getattr(self, name, off) != off:
                raise BadField(name, f"{name} is not supported by this server; leave it out")
        try:
            return SamplingParams(n=self.n, max_tokens=self.max_tokens or default_max_tokens,
                                  temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                                  ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids, stop=self.stop_strings or None,
                                  presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                  repetition_penalty=self.repetition_penalty, min_p=self.min_p,
                                  min_tokens=self.min_tokens, logprobs=self.num_logprobs)
        except ValueError as exc:   # SamplingParams names the field first
            raise BadField(str(exc).split(" ")[0], str(exc)) from None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = None   # the top tokens' log-probs per position (and the chosen one's)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadField("top_logprobs", "top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class BadField(ValueError):
    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "BadRequestError",
               413: "BadRequestError", 422: "BadRequestError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


def _text(x: str | None) -> str | None:
    """Text safe to send as UTF-8 JSON (a lone surrogate, e.g. echoed from the request, becomes U+FFFD)."""
    return None if x is None else str(x).encode("utf-8", "replace").decode("utf-8")


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse({"error": {"message": _text(message), "type": ERROR_TYPES.get(status, "InternalServerError"),
                                   "param": _text(param), "code": status}}, status_code=status)


def has_surrogate(text: str) -> bool:
    """A lone UTF-16 surrogate (JSON's \\ud800): not a character, so no tokenizer can encode it."""
    return any("\ud800" <= c <= "\udfff" for c in text)


class ApiGuard:
    """Pure ASGI middleware (it leaves `request.is_disconnected()` working, which Starlette's BaseHTTPMiddleware
    hides): refuses a body over `max_bytes` (413) and, with an API key, a `/v1` request without `Authorization:
    Bearer KEY` (401; the scheme in any case, the key compared in constant time, CORS preflights let through)."""

    def __init__(self, app, api_key: str | None, max_bytes: int) -> None:
        self.app, self.api_key, self.max_bytes = app, api_key, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8", "replace"),
                                                                      self.api_key.encode("utf-8")):
                return await error(401, "missing or wrong API key: send Authorization: Bearer KEY")(scope, receive, send)
        try:
            declared = int(headers.get("content-length", "0"))
        except ValueError:
            declared = 0
        if declared > self.max_bytes:
            return await error(413, f"the request body has {declared} bytes; the limit is {self.max_bytes}")(
                scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await error(413, f"the request body is larger than the limit of {self.max_bytes} bytes")(scope, receive, send)


class _TooLarge(Exception):
    pass


def build_app(llm: AsyncLLM, model_name: str, *, api_key: str | None = None,
              max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI app; `llm` must be started (its engine thread steps while the app serves)."""
    app = FastAPI(title="llmso-lab", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(ApiGuard, api_key=api_key, max_bytes=max_request_bytes)
    engine = llm.engine
    metrics = llm.metrics or ServerMetrics(model_name)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError):
        e = exc.errors()[0]
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if e.get("type") == "json_invalid":
            return error(400, f"the request body is not valid JSON: {e.get('msg')}; send a JSON object")
        if e.get("type") == "extra_forbidden":
            return error(400, f"unsupported field {param!r}: this server does not know it; leave it out", param)
        return error(400, f"{param}: {e.get('msg')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return error(404, "no such route; this server has /v1/completions, /v1/chat/completions, /v1/models, "
                              "/health and /metrics")
        if exc.status_code == 405:
            return error(405, "method not allowed on this route")
        if exc.status_code == 400:   # e.g. a body that is not UTF-8
            return error(400, f"the request could not be read: {exc.detail}; send a UTF-8 JSON object")
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception):   # never a plain-text 500
        return error(500, f"the server could not handle this request ({type(exc).__name__}); it keeps serving others")

    @app.get("/health")
    async def health():
        return Response(status_code=503 if llm.dead else 200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "llmso-lab", "max_model_len": engine.max_model_len}]}

    def refuse(req: _Sampling) -> JSONResponse | None:
        """What is wrong with a request before any of it is tokenized, or None."""
        if has_surrogate(req.model):
            return error(400, "model: not valid Unicode (a lone surrogate)", "model")
        if req.model != model_name:
            return error(404, f"the model `{req.model}` does not exist; this server serves `{model_name}`", "model")
        if req.stream_options is not None and not req.stream:
            return error(400, "stream_options is only allowed with stream: true", "stream_options")
        if any(has_surrogate(s) for s in req.stop_strings):
            return error(400, "stop: not valid Unicode (a lone surrogate)", "stop")
        return None

    async def start(req: _Sampling, prompt, default_max_tokens) -> RequestStream | JSONResponse:
        try:
            params = req.sampling_params(default_max_tokens(prompt) if callable(default_max_tokens) else default_max_tokens)
            ids = llm.check(prompt, params)
            return llm.submit(ids, params, req.stop_strings)
        except BadField as exc:
            return error(400, str(exc), exc.param)
        except ValueError as exc:
            return error(400, str(exc))
        except (Overloaded, EngineDead) as exc:
            return error(503, str(exc))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        if (bad := refuse(req)) is not None:
            return bad
        if isinstance(req.prompt, str) and has_surrogate(req.prompt):
            return error(400, "prompt: not valid Unicode (a lone surrogate)", "prompt")
        stream = await start(req, req.prompt, 16)
        return stream if isinstance(stream, JSONResponse) else await respond(request, req, stream, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        if (bad := refuse(req)) is not None:
            return bad
        tok = engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            return error(400, "this model's tokenizer has no chat template; use /v1/completions")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        for i, m in enumerate(messages):
            if any(has_surrogate(str(v)) for v in m.values()):
                return error(400, f"messages.{i}: not valid Unicode (a lone surrogate)", f"messages.{i}")
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        except Exception as exc:   # noqa: BLE001 - the template refused these messages
            return error(400, f"the chat template could not render these messages: {exc}", "messages")
        stream = await start(req, ids, lambda p: max(1, engine.max_model_len - len(p)))
        return stream if isinstance(stream, JSONResponse) else await respond(request, req, stream, chat=True)

    async def respond(request: Request, req: _Sampling, stream: RequestStream, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": model_name}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(sse(stream, head, chat, req.n, include_usage), media_type="text/event-stream")
        try:
            texts, reasons, usage = [""] * req.n, [None] * req.n, None
            logprobs: list[list[dict] | None] = [None if req.num_logprobs is None else [] for _ in range(req.n)]
            async for item in _until_disconnected(request, stream):
                if isinstance(item, Delta):
                    texts[item.index] += item.text
                    reasons[item.index] = item.finish_reason or reasons[item.index]
                    if item.logprobs:
                        logprobs[item.index] += item.logprobs
                else:
                    usage = item
        except EngineDead as exc:
            return error(503, str(exc))
        except RequestFailed as exc:
            return error(500, str(exc))
        finally:
            if not stream.finished:
                llm.abort(stream)
        if usage is None:   # the client went away
            return Response(status_code=499)
        choices = [({"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": r}
                    if chat else {"index": i, "text": t, "finish_reason": r})
                   | {"logprobs": _logprobs(lp, chat, engine.decode)} for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))]
        return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                "usage": _usage(usage)}

    async def sse(stream: RequestStream, head: dict, chat: bool, n: int, include_usage: bool):
        try:
            if chat:   # the role comes first, as in OpenAI's stream
                for i in range(n):
                    yield _event({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}]})
            async for item in stream:
                if isinstance(item, Usage):
                    if include_usage:
                        yield _event({**head, "choices": [], "usage": _usage(item)})
                    continue
                choice = ({"index": item.index, "delta": {"content": item.text} if item.text else {}}
                          if chat else {"index": item.index, "text": item.text})
                yield _event({**head, "choices": [{**choice, "logprobs": _logprobs(item.logprobs, chat, engine.decode),
                                                   "finish_reason": item.finish_reason}]})
            yield "data: [DONE]\n\n"
        except (EngineDead, RequestFailed) as exc:
            code = 503 if isinstance(exc, EngineDead) else 500
            yield _event({"error": {"message": str(exc), "type": ERROR_TYPES[code], "param": None, "code": code}})
        finally:   # also on a client disconnect (the response task is cancelled)
            if not stream.finished:
                llm.abort(stream)

    return app


async def _until_disconnected(request: Request, stream: RequestStream, poll_s: float = 0.25):
    """The stream's items; stops early if the client disconnects (checked every `poll_s`, also while items keep
    coming: a request that produces a token every step must still notice that nobody waits for its answer)."""
    it = stream.__aiter__()
    nxt = asyncio.ensure_future(it.__anext__())
    checked = time.monotonic()
    try:
        while True:
            done, _ = await asyncio.wait({nxt}, timeout=poll_s)
            if nxt in done:
                try:
                    item = nxt.result()
                except StopAsyncIteration:
                    return
                yield item
                nxt = asyncio.ensure_future(it.__anext__())
            if time.monotonic() - checked >= poll_s:
                checked = time.monotonic()
                if await request.is_disconnected():
                    return
    finally:
        nxt.cancel()


def _logprobs(entries: list[dict] | None, chat: bool, decode) -> dict | None:
    """OpenAI's logprobs object for some output tokens: chat's {"content": [...]}, or the completions' parallel lists."""
    if entries is None:
        return None
    if chat:
        item = lambda t, lp: {"token": decode([t]), "logprob": lp, "bytes": list(decode([t]).encode())}   # noqa: E731
        return {"content": [{**item(e["token_id"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]}
                            for e in entries]}
    return {"tokens": [decode([e["token_id"]]) for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{decode([t]): lp for t, lp in e["top"]} for e in entries]}


def _usage(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.num_cached_tokens}}


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
