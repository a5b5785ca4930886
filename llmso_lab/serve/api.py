"""The OpenAI-compatible HTTP API in front of `AsyncLLM` (vLLM's `vllm serve` routes and shapes).

`POST /v1/completions`, `POST /v1/chat/completions` (with `"stream": true`: server-sent events, one chunk per engine
step that produced text, `data: [DONE]` at the end, a usage chunk first when `stream_options.include_usage`),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text, `serve.metrics`). With an API key every `/v1`
route wants `Authorization: Bearer KEY`. Bad input gets HTTP 400 in OpenAI's error shape naming the field; a full
queue gets 503; a client that disconnects has its request aborted (its KV blocks go back)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from llmso_lab.engine.sampling_params import SamplingParams
from llmso_lab.serve.async_llm import AsyncLLM, Delta, EngineDead, Overloaded, RequestStream, Usage
from llmso_lab.serve.metrics import CONTENT_TYPE, ServerMetrics

# OpenAI / vLLM fields this server does not implement: accepted at their "off" value, refused otherwise.
NOT_YET = {"logit_bias": None, "echo": False, "best_of": None, "suffix": None}


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
    n: int = Field(default=1, ge=1)
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


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
    return JSONResponse({"error": {"message": message, "type": kind.get(status, "InternalServerError"), "param": param,
                                   "code": status}}, status_code=status)


def build_app(llm: AsyncLLM, model_name: str, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI app; `llm` must be started (its engine thread steps while the app serves)."""
    app = FastAPI(title="llmso-lab", docs_url=None, redoc_url=None)
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

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1") and \
                request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

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

    async def start(req: _Sampling, prompt, default_max_tokens) -> RequestStream | JSONResponse:
        if req.model != model_name:
            return error(400, f"the model `{req.model}` does not exist; this server serves `{model_name}`", "model")
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
        stream = await start(req, req.prompt, 16)
        return stream if isinstance(stream, JSONResponse) else await respond(request, req, stream, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        tok = engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            return error(400, "this model's tokenizer has no chat template; use /v1/completions")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
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
        except EngineDead as exc:
            yield _event({"error": {"message": str(exc), "type": "ServiceUnavailableError", "param": None, "code": 503}})
        finally:   # also on a client disconnect (the response task is cancelled)
            if not stream.finished:
                llm.abort(stream)

    return app


async def _until_disconnected(request: Request, stream: RequestStream, poll_s: float = 0.25):
    """The stream's items; stops early if the client disconnects (checked every `poll_s` while waiting)."""
    it = stream.__aiter__()
    nxt = asyncio.ensure_future(it.__anext__())
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
            elif await request.is_disconnected():
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
