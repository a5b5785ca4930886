"""The OpenAI-compatible HTTP API in front of `AsyncLLM` (vLLM's `vllm serve` routes and shapes).

`POST /v1/completions` (one prompt or a list of them, text or token ids; `echo`), `POST /v1/chat/completions`
(content as text or text parts, the `developer` role, `max_completion_tokens`); with `"stream": true` server-sent
events, one chunk per engine step that produced text, `data: [DONE]` at the end, a usage chunk last when
`stream_options.include_usage`. `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text, `serve.metrics`).
With an API key every `/v1` route wants `Authorization: Bearer KEY`. Prompts and chat templates are tokenized off the
event loop with a tokenizer of the HTTP side's own. Fields this server does not know are ignored with a warning in
its log, as vLLM does. Bad input gets HTTP 400 in OpenAI's error shape naming the field (every error has that
shape: 401, 404 for an unknown model or route, 405, 413 for a body over the limit, 500, 503); a full queue gets
503; a client that disconnects, streaming or not, has its request aborted (its KV blocks go back); a request whose
serving raises fails alone (500) while the engine keeps stepping the others."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
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
NOT_YET = {"logit_bias": None, "best_of": None, "suffix": None}
MAX_N = 128                  # completions per request (OpenAI's limit): each is a sequence the engine steps
MAX_PROMPTS = 32             # prompts in one /v1/completions request (a list of prompts)
MAX_REQUEST_BYTES = 4 << 20  # a request body larger than this gets a 413 before it is read further
log = logging.getLogger("llmso_lab.serve")


class _Open(BaseModel):
    """Fields this server does not know are ignored with a warning, as vLLM does (`extra="allow"`, then logged)."""
    model_config = ConfigDict(extra="allow")


def ignored_fields(obj: BaseModel, prefix: str = "") -> list[str]:
    """The unknown fields of a parsed request, nested ones as `messages.0.x`."""
    out = [prefix + k for k in (obj.model_extra or {})]
    for name, value in obj:
        items = value if isinstance(value, list) else [value]
        for i, v in enumerate(items):
            if isinstance(v, BaseModel):
                out += ignored_fields(v, f"{prefix}{name}.{i}." if isinstance(value, list) else f"{prefix}{name}.")
    return out


class StreamOptions(_Open):
    include_usage: bool = False


class _Sampling(_Open):
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

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        for name, off in NOT_YET.items():
            if getattr(self, name, off) != off:
                raise BadField(name, f"{name} is not supported by this server; leave it out")
        try:
            return SamplingParams(n=self.n, max_tokens=self.token_limit or default_max_tokens,
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
    # one prompt (text or token ids) or a list of them: each gets `n` choices, numbered prompt by prompt
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None   # the top tokens' log-probs per position (and the chosen one's)
    echo: bool = False            # each choice's text starts with its prompt
    best_of: int | None = None
    suffix: str | None = None

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)


class ContentPart(_Open):
    type: str
    text: str | None = None


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def for_template(self, i: int) -> dict:
        """The message as the chat template takes it: text parts joined by newlines (vLLM does the same), and the
        `developer` role (OpenAI's newer name for `system`) as `system`."""
        content = self.content or ""
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise BadField(f"messages.{i}.content.{j}", f"content part of type {part.type!r} is not supported: "
                                   'this server serves a text model; send {"type": "text", "text": "..."}')
            content = "\n".join(part.text for part in content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": content}
        return out | ({"name": self.name} if self.name is not None else {})


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)   # OpenAI's newer name for max_tokens; wins over it

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

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
        """What is wrong with a request before any of it is tokenized, or None. Unknown fields are only logged."""
        if ignored := ignored_fields(req):
            log.warning("The following fields were present in the request but ignored: %s", ignored)
        if has_surrogate(req.model):
            return error(400, "model: not valid Unicode (a lone surrogate)", "model")
        if req.model != model_name:
            return error(404, f"the model `{req.model}` does not exist; this server serves `{model_name}`", "model")
        if req.stream_options is not None and not req.stream:
            return error(400, "stream_options is only allowed with stream: true", "stream_options")
        if any(has_surrogate(s) for s in req.stop_strings):
            return error(400, "stop: not valid Unicode (a lone surrogate)", "stop")
        return None

    async def start(req: _Sampling, prompts: list, default_max_tokens) -> list[RequestStream] | JSONResponse:
        """Check every prompt (tokenized off the event loop), then queue them all; on any error none is queued."""
        try:
            checked = []
            for prompt in prompts:
                limit = default_max_tokens(prompt) if callable(default_max_tokens) else default_max_tokens
                params = req.sampling_params(limit)
                checked.append((await asyncio.to_thread(llm.check, prompt, params), params))
        except BadField as exc:
            return error(400, str(exc), exc.param)
        except ValueError as exc:
            return error(400, str(exc))
        streams = []
        try:
            for ids, params in checked:
                streams.append(llm.submit(ids, params, req.stop_strings))
        except (Overloaded, EngineDead) as exc:
            for stream in streams:
                llm.abort(stream)
            return error(503, str(exc))
        return streams

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        if (bad := refuse(req)) is not None:
            return bad
        prompts = req.prompts
        if len(prompts) > MAX_PROMPTS:
            return error(400, f"{len(prompts)} prompts in one request; send at most {MAX_PROMPTS}", "prompt")
        for i, p in enumerate(prompts):
            if isinstance(p, str) and has_surrogate(p):
                return error(400, "prompt: not valid Unicode (a lone surrogate)", "prompt")
        if req.echo and req.logprobs is not None:
            return error(400, "echo with logprobs needs the prompt's log-probs, which this server does not compute; "
                              "leave out one of them", "echo")
        streams = await start(req, prompts, 16)
        if isinstance(streams, JSONResponse):
            return streams
        echo = [(p if isinstance(p, str) else await asyncio.to_thread(llm.prompt_text, p)) if req.echo else ""
                for p in prompts]
        return await respond(request, req, streams, chat=False, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        if (bad := refuse(req)) is not None:
            return bad
        try:
            messages = [m.for_template(i) for i, m in enumerate(req.messages)]
        except BadField as exc:
            return error(400, str(exc), exc.param)
        for i, m in enumerate(messages):
            if any(has_surrogate(str(v)) for v in m.values()):
                return error(400, f"messages.{i}: not valid Unicode (a lone surrogate)", f"messages.{i}")
        try:
            ids = await asyncio.to_thread(llm.render_chat, messages)
        except ValueError as exc:
            return error(400, str(exc), "messages")
        streams = await start(req, [ids], lambda p: max(1, engine.max_model_len - len(p)))
        if isinstance(streams, JSONResponse):
            return streams
        return await respond(request, req, streams, chat=True, echo=[""])

    async def respond(request: Request, req: _Sampling, streams: list[RequestStream], chat: bool, echo: list[str]):
        """Choice `k * n + i` is sample i of prompt k (OpenAI numbers a list of prompts' choices that way)."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": model_name}
        n = req.n
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(sse(streams, head, chat, n, include_usage, echo), media_type="text/event-stream")
        total = n * len(streams)
        try:
            texts, reasons = [echo[c // n] for c in range(total)], [None] * total
            logprobs: list[list[dict] | None] = [None if req.num_logprobs is None else [] for _ in range(total)]
            usages: list[Usage] = []
            async for k, item in _until_disconnected(request, _merged(streams)):
                if isinstance(item, Delta):
                    c = k * n + item.index
                    texts[c] += item.text
                    reasons[c] = item.finish_reason or reasons[c]
                    if item.logprobs:
                        logprobs[c] += item.logprobs
                else:
                    usages.append(item)
        except EngineDead as exc:
            return error(503, str(exc))
        except RequestFailed as exc:
            return error(500, str(exc))
        finally:
            for stream in streams:
                if not stream.finished:
                    llm.abort(stream)
        if len(usages) < len(streams):   # the client went away
            return Response(status_code=499)
        choices = [({"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": r}
                    if chat else {"index": i, "text": t, "finish_reason": r})
                   | {"logprobs": _logprobs(lp, chat, token_text)} for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))]
        return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                "usage": _usage(usages)}

    async def sse(streams: list[RequestStream], head: dict, chat: bool, n: int, include_usage: bool, echo: list[str]):
        try:
            if chat:   # the role comes first, as in OpenAI's stream
                for i in range(n):
                    yield _event({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}]})
            for k, prompt_text in enumerate(echo):   # echo: each choice's prompt comes first
                for i in range(n) if prompt_text else ():
                    yield _event({**head, "choices": [{"index": k * n + i, "text": prompt_text, "logprobs": None,
                                                       "finish_reason": None}]})
            usages = []
            async for k, item in _merged(streams):
                if isinstance(item, Usage):
                    usages.append(item)
                    continue
                index = k * n + item.index
                choice = ({"index": index, "delta": {"content": item.text} if item.text else {}}
                          if chat else {"index": index, "text": item.text})
                yield _event({**head, "choices": [{**choice, "logprobs": _logprobs(item.logprobs, chat, token_text),
                                                   "finish_reason": item.finish_reason}]})
            if include_usage:
                yield _event({**head, "choices": [], "usage": _usage(usages)})
            yield "data: [DONE]\n\n"
        except (EngineDead, RequestFailed) as exc:
            code = 503 if isinstance(exc, EngineDead) else 500
            yield _event({"error": {"message": str(exc), "type": ERROR_TYPES[code], "param": None, "code": code}})
        finally:   # also on a client disconnect (the response task is cancelled)
            for stream in streams:
                if not stream.finished:
                    llm.abort(stream)

    def token_text(ids: list[int]) -> str:
        """A token as the logprobs show it: special tokens (EOS) by name, not as empty text."""
        tok = engine.tokenizer
        return tok.decode(ids, skip_special_tokens=False) if tok is not None else ""

    return app


async def _merged(streams: list[RequestStream]):
    """(k, item) for the items of several request streams, as they arrive (k: the stream's position)."""
    its = [s.__aiter__() for s in streams]
    pending = {asyncio.ensure_future(it.__anext__()): k for k, it in enumerate(its)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=pending.get):
                k = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                yield k, item
                pending[asyncio.ensure_future(its[k].__anext__())] = k
    finally:
        for fut in pending:
            fut.cancel()


async def _until_disconnected(request: Request, stream, poll_s: float = 0.25):
    """The (async iterable) stream's items; stops early if the client disconnects (checked every `poll_s`, also while items keep
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


def _usage(usages: list[Usage]) -> dict:
    """OpenAI's usage object, summed over the request's prompts."""
    prompt, completion = sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.num_cached_tokens for u in usages)}}


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
