"""Online serving: `llmso-lab serve MODEL` — the engine behind an OpenAI-compatible HTTP server (vLLM's
`vllm serve`), with streaming and vLLM's Prometheus metrics. `serve.async_llm` steps the engine in a thread,
`serve.api` is the HTTP layer, `serve.metrics` the `/metrics` page, `serve.detokenizer` the streamed text and its
stop strings. `running_server` starts one in the background (tests, notebooks) and always stops it."""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

DEFAULT_HOST = "127.0.0.1"   # never 0.0.0.0 by default: the course's servers are reached from this machine only


@dataclass
class Server:
    """A server running in this process: its address, the engine wrapper and uvicorn's handle."""
    host: str
    port: int
    llm: object
    uvicorn_server: object

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def build(model, tokenizer=None, *, served_model_name: str | None = None, api_key: str | None = None,
          max_queue: int = 64, **engine_args):
    """(app, AsyncLLM) for a model (a registry name or a HF model) and engine arguments with vLLM's names."""
    from llmso_lab.engine.core import LLMEngine
    from llmso_lab.serve.api import build_app
    from llmso_lab.serve.async_llm import AsyncLLM
    from llmso_lab.serve.metrics import ServerMetrics

    name = served_model_name or (model if isinstance(model, str) else type(model).__name__)
    engine = LLMEngine(model, tokenizer, **engine_args)
    llm = AsyncLLM(engine, max_queue=max_queue, metrics=ServerMetrics(name)).start()
    return build_app(llm, name, api_key=api_key), llm


@contextlib.contextmanager
def running_server(model, tokenizer=None, *, host: str = DEFAULT_HOST, port: int = 0, startup_timeout_s: float = 60,
                   log_level: str = "warning", **kwargs):
    """Serve in a background thread (port 0: a free port); yields a `Server`; stops it (and the engine thread) on
    leaving the block, whatever happened inside."""
    import uvicorn

    app, llm = build(model, tokenizer, **kwargs)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off"))
    thread = threading.Thread(target=server.run, name="llmso-serve", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {host}:{port} (is the port in use?)")
            time.sleep(0.02)
        bound = server.servers[0].sockets[0].getsockname()[1]
        yield Server(host, bound, llm, server)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        llm.shutdown()


def serve(model: str, *, host: str = DEFAULT_HOST, port: int = 8000, **kwargs) -> None:
    """Run until interrupted (the CLI's `llmso-lab serve`)."""
    import uvicorn

    app, llm = build(model, **kwargs)
    print(f"llmso-lab serving {model} on http://{host}:{port}  (POST /v1/completions, /v1/chat/completions; "
          "GET /v1/models, /health, /metrics)", flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        llm.shutdown()
