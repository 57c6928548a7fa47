"""The gateway process: FastAPI app factory and the `swarmgate gateway MODEL ...` entry point.

`create_app(config, model=None, tokenizer=None, models=None)` builds the app around one client model per `--model`
(loaded here when not given: embeddings, final norm and LM head; the blocks run on the swarm) and its tokenizer, each
model's state its own (`gateway.api.models`: requests choose by `model`). Routes: the OpenAI endpoints
(`gateway.api.completions`; the Responses API, `gateway.responses`), `GET /v1/models` (`gateway.api.models`),
`POST /tokenize`, `POST /detokenize` (all behind the API keys when configured), `GET /health` (200 when every block of
every model is served, else 503 naming the missing ones) and `GET /metrics` (Prometheus), public unless
`--protect_probes`, and the public swarm status page `GET /status` / `/status.json` (`gateway.api.status`; the first
model's swarm), and the chat page `GET /chat` (`gateway.api.chat_page`; `GET /` sends a browser there). Every
response carries `X-Request-Id` (echoed or created); CORS is on for the configured origins.

`main(argv)` parses flags / YAML / environment into `GatewayConfig`, opens the state store (`gateway.store`,
`--database_url`: a store that cannot be used is one line on stderr and exit code 2), serves with uvicorn, and prints
`SWARMGATE_READY {"url": "http://host:port", "model": ..., "models": [...]}` on stdout once it accepts connections.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import re
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Any, List, Optional, Sequence, Tuple

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from gateway.api.admission import Admission
from gateway.api.auth import Authenticator, require_api_key, require_probe_key
from gateway.api.chat_page import add_chat_routes
from gateway.api.completions import router as completions_router
from gateway.api.models import ServedModels, discover
from gateway.api.models import install as install_models
from gateway.api.openapi import install as install_openapi
from gateway.api.params import Limits, check_messages
from gateway.api.quota import Quota
from gateway.api.responses.routes import install as install_responses
from gateway.api.state import GatewayState, format_ranges, quant_note, quant_summary
from gateway.api.status import add_status_routes
from gateway.config import GatewayConfig
from gateway.errors import bad_request, install_error_handlers
from gateway.metrics import CONTENT_TYPE_LATEST, Metrics
from gateway.schemas import DetokenizeRequest, TokenizeRequest
from gateway.serving.engine import Engine
from gateway.serving.session_pool import SessionPool
from gateway.serving.sessions import SessionProvider
from gateway.serving.tokens import Tokens
from gateway.store import Store, StoreError, open_store
from swarm.client.api import load_draft_model
from swarm.runtime import aio, malloc
from swarm.runtime.taskpool import stop_client_pool

logger = logging.getLogger("swarmgate.gateway")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/metrics",
              "/tokenize", "/detokenize", "/status", "/status.json", "/chat"}


class RequestContext:
    """Pure ASGI middleware (it must not buffer SSE nor hide disconnects): sets `request.state.request_id`
    from `X-Request-Id` or a new id, echoes it in the response with the caller's `x-ratelimit-*` headers
    (`gateway.api.quota`), and counts responses by status."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        incoming = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        request_id = incoming if _REQUEST_ID.match(incoming) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        status = [500]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                caller = scope["state"].get("caller")  # gateway.api.auth: its x-ratelimit-* once admitted
                limits = [(k.encode(), v.encode()) for k, v in caller.headers.items()] if caller is not None else []
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode()), *limits]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            path = scope.get("path", "")
            prefix = next((p for p in ("/v1/models", "/v1/responses") if path.startswith(p + "/")), "other")
            endpoint = path if path in _ENDPOINTS else prefix
            self.metrics.requests.labels(endpoint=endpoint, status=str(status[0])).inc()


def load_model(config: GatewayConfig):
    import torch

    from swarm import AutoDistributedModelForCausalLM
    from swarm.modeling.prepare import resolve_model
    from swarm.wire.records import dht_prefix_for

    if not config.initial_peers:
        raise ValueError("initial_peers is required: the multiaddr(s) of a peer of the swarm")
    device = torch.device(config.device)
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"device {config.device!r}: no such CUDA device here")
    # a bundled name opens its prepared directory; the DHT prefix stays the one servers derive from the name
    return AutoDistributedModelForCausalLM.from_pretrained(
        resolve_model(config.model_path), initial_peers=config.initial_peers,
        dht_prefix=config.dht_prefix or dht_prefix_for(config.model_path),
        torch_dtype=config.torch_dtype, step_timeout=config.step_timeout, request_timeout=config.rpc_timeout,
        allowed_quant_types=config.allowed_quant_types, swarm_key=config.swarm_key, compression=config.compression,
        swarm_key_file=config.swarm_key_file, verify=config.verify_rate > 0, verify_probability=config.verify_rate,
        use_push=config.push,
        head_packed_rows=config.head_packed_rows,  # padded head rows: ~3 MB; each pack: the head's size again
        revision=config.revision, token=config.token, device=device)


def load_tokenizer(config: GatewayConfig):
    from transformers.models.auto import AutoTokenizer

    from swarm.modeling.checkpoint import Checkpoint
    from swarm.modeling.prepare import resolve_model

    checkpoint = Checkpoint(resolve_model(config.model_path), revision=config.revision, token=config.token)
    # with the model config given, AutoTokenizer does not load it through AutoConfig (swarm.modeling.model_config: why)
    return AutoTokenizer.from_pretrained(checkpoint.config_dir, config=checkpoint.load_config(),
                                         revision=config.revision, token=config.token)


def _eos_ids(model) -> list:
    eos = getattr(model.generation_config, "eos_token_id", None)  # (Hugging Face configs: set or not)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    return [eos] if isinstance(eos, int) else list(eos or [])


def create_app(config: GatewayConfig, model=None, tokenizer=None, store: Optional[Store] = None,
               models: Optional[Sequence[Tuple[Any, Any]]] = None) -> FastAPI:
    """`store`: the state store (default: the one `config.database_url` names, opened here and closed at shutdown).
    `models`: the (client model, tokenizer) of each of `config.model`, in order; `model` and `tokenizer` stand for the
    first's; what is not given is loaded here."""
    own_store = store is None
    store = store if store is not None else open_store(config.database_url)
    loaded = list(models) if models is not None else [(model, tokenizer)]
    loaded += [(None, None)] * (len(config.model) - len(loaded))
    if config.draft_model:  # loaded once, at start: a bad path fails here, not in the first request
        load_draft_model(config.draft_model)
    metrics = Metrics()  # the gateway-wide metrics, and the first model's
    admission = Admission(config.max_concurrent, config.max_queue, config.queue_timeout, config.retry_after,
                          on_change=metrics.observe_admission)
    # a stream's lease outlives any generation (its deadline) by a minute: a gateway killed mid-request frees it then
    quota = Quota(store, metrics, lease_ttl=config.generation_timeout + 60, retry_after=config.retry_after)
    served = ServedModels([_model_state(config.for_model(path), model, tokenizer, metrics if i == 0 else Metrics(),
                                        admission=admission, store=store, quota=quota)
                           for i, (path, (model, tokenizer)) in enumerate(zip(config.model, loaded))])
    state = served.default

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        served.shutdown()  # cancel running generations: their sessions close; so do pooled ones
        quota.shutdown()  # usage still to be written
        if own_store:
            store.close()

    app = FastAPI(title="swarmgate", version=_version(), docs_url="/docs", redoc_url=None, lifespan=lifespan)
    app.state.gateway = state  # the first model's (and the gateway-wide settings, admission, metrics, store)
    app.state.models = served
    app.state.authenticator = Authenticator(config.accepted_api_keys, store)
    install_error_handlers(app)
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"],
                           allow_credentials="*" not in config.cors_origins)
    app.add_middleware(RequestContext, metrics=metrics)
    app.include_router(completions_router)
    install_responses(app, config, store)  # /v1/responses (gateway.responses), its responses in the state store
    install_models(app, served)  # /v1/models
    _add_routes(app, served)
    # `model` in /openapi.json: the served names (each model, its path and its adapters)
    install_openapi(app, served.served_ids)
    add_status_routes(app, state)
    return app


def _model_state(config: GatewayConfig, model, tokenizer, metrics: Metrics, *, admission: Admission, store: Store,
                 quota: Quota) -> GatewayState:
    """One served model's state (`config`: the gateway's settings for that model alone): its client model and
    tokenizer (loaded when None), limits, engine and session pool, sharing admission, store and quota."""
    model = model if model is not None else load_model(config)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config)
    tokens = Tokens(tokenizer, _eos_ids(model))
    threading.Thread(target=lambda: tokens.token_bytes, name="token-table", daemon=True).start()  # warm it
    context = config.max_context or int(getattr(model.config, "max_position_embeddings", 2048))
    limits = Limits(context=context, default_max_tokens=config.default_max_tokens, max_n=config.max_n,
                    vocab_size=min(int(model.config.vocab_size), tokens.vocab_size),
                    eos_token_ids=tuple(tokens.eos_token_ids))
    pool: Optional[SessionPool] = None
    if config.session_pool and config.pool_max_sessions > 0:
        pool = SessionPool(config.pool_max_sessions, config.pool_max_tokens, config.pool_ttl,
                           on_evict=metrics.count_eviction)
        metrics.pool = pool
    sessions = SessionProvider(model, pool, metrics, headroom=config.pool_headroom, context=context,
                               prefix_sharing=config.prefix_sharing)
    engine = Engine(model, tokens, metrics, max_workers=config.max_concurrent, sessions=sessions,
                    verify_holdback=config.verify_holdback, engine_round=config.engine_round)
    state = GatewayState(config=config, model=model, tokens=tokens, engine=engine, admission=admission,
                         metrics=metrics, limits=limits, created=int(time.time()), store=store, quota=quota)
    metrics.coverage_source = state.coverage_numbers
    metrics.verify_source = model.verify_stats
    metrics.prefix_source = model.server_prefix_caches
    model.observe_routes(metrics.observe_route)
    return state


def _version() -> str:
    from swarm import __version__

    return __version__


def _add_routes(app: FastAPI, served: ServedModels) -> None:
    @app.post("/tokenize", dependencies=[Depends(require_api_key)])
    async def tokenize(body: TokenizeRequest):
        state = await served.route(body.model)  # a served model or LoRA adapter; none: the first model
        tokens = state.tokens
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("Give exactly one of 'prompt' or 'messages'.", param="prompt")
        if body.messages is not None:
            check_messages(body.messages)
            ids = await run_in_threadpool(tokens.chat_prompt, body.messages, bool(body.add_generation_prompt),
                                          body.chat_template_kwargs)
        else:
            ids = await run_in_threadpool(tokens.encode, body.prompt or "", bool(body.add_special_tokens))
        return {"tokens": ids, "count": len(ids), "max_model_len": state.limits.context}

    @app.post("/detokenize", dependencies=[Depends(require_api_key)])
    async def detokenize(body: DetokenizeRequest):
        state = await served.route(body.model)
        state.tokens.check_ids(body.tokens, "tokens")
        return {"prompt": await run_in_threadpool(state.tokens.decode, body.tokens)}

    @app.get("/health", dependencies=[Depends(require_probe_key)])
    async def health():
        """200 when every block of every model is served; else 503 naming the first model with missing blocks."""
        answers = []
        for state in served.states:
            try:
                coverage = await run_in_threadpool(state.coverage, True)
            except Exception as e:
                return JSONResponse({"status": "unavailable", "model": state.config.model_name,
                                     "message": f"cannot read the swarm's state: {e}", "missing_blocks": None},
                                    status_code=503)
            answers.append((state, coverage))
        for state, coverage in answers:
            missing, total, servers = coverage.missing, coverage.num_blocks, coverage.servers
            if missing:
                what = ("online server" if coverage.allowed_quant_types is None
                        else "online server of an allowed quant type")
                of = f" of {state.config.model_name}" if len(answers) > 1 else ""
                return JSONResponse({"status": "unavailable", "model": state.config.model_name, "blocks": total,
                                     "servers": servers, "missing_blocks": missing,
                                     "message": f"blocks {format_ranges(missing)}{of} are not served by any {what}"
                                                f"{quant_note(coverage)}",
                                     **quant_summary(coverage)},
                                    status_code=503)
        state, coverage = answers[0]
        extra = ({"models": {s.config.model_name: {"blocks": c.num_blocks, "servers": c.servers}
                             for s, c in answers}} if len(answers) > 1 else {})
        return {"status": "ok", "blocks": coverage.num_blocks, "servers": coverage.servers,
                "model": state.config.model_name, **extra, **quant_summary(coverage)}

    @app.get("/metrics", dependencies=[Depends(require_probe_key)])
    async def prometheus_metrics():
        return Response(await run_in_threadpool(served.render_metrics), media_type=CONTENT_TYPE_LATEST)

    # `/`: the chat page for a browser, this JSON for anything else
    add_chat_routes(app, lambda: JSONResponse({"service": "swarmgate", "model": served.names[0],
                                               "models": served.names, "api": "/v1", "chat": "/chat"}))


# ---- the process ----------------------------------------------------------------------------------------------------
def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def _serve(app: FastAPI, config: GatewayConfig, sock: socket.socket) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:  # end running generations now, so that their streams close before the grace
                threading.Thread(target=app.state.gateway.engine.shutdown, name="stop-generations",
                                 daemon=True).start()
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, log_level=config.log_level.lower(), timeout_graceful_shutdown=5,
                                   access_log=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = sock.getsockname()[:2]
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        print("SWARMGATE_READY " + json.dumps({"url": url, "model": config.model_name,
                                                "models": config.model_names}), flush=True)
        logger.info(f"serving {', '.join(config.model_names)} at {url}/v1")
    await task


def main(argv=None) -> int:
    from swarm.runtime.config import ConfigError, build_parser, load_config

    parser = build_parser(GatewayConfig, "swarmgate gateway",
                          "Serve the OpenAI-compatible HTTP API over the swarm.", positional="model")
    args = parser.parse_args(argv)
    try:
        config = load_config(GatewayConfig, args, section="gateway")
    except ConfigError as e:
        parser.error(str(e))
    if not config.initial_peers:
        parser.error("--initial_peers is required: the multiaddr(s) of a peer of the swarm")
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    aio.use_loop(config.event_loop)  # (before the client model starts its loop)
    if config.num_threads:
        import torch

        torch.set_num_threads(config.num_threads)
    try:  # first: a store that cannot be used is one line and exit 2, before minutes of loading
        store = open_store(config.database_url)
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    loaded: List[Tuple[Any, Any]] = []
    code = 1
    try:
        sock = _listen(config.host, config.port)
        if config.discover:  # --model all: the models the swarm's servers announce now
            config = discover(config)
        for path in config.model:
            # the tokenizer first: what parsing it takes and frees (tens of MB) goes back to the OS before the
            # weights come, so that the two never add up in the peak
            tokenizer = load_tokenizer(config.for_model(path))
            malloc.trim()
            loaded.append((load_model(config.for_model(path)), tokenizer))
        app = create_app(config, store=store, models=loaded)
        malloc.trim()
        # what loading made (modules, the model, the tokenizer: hundreds of thousands of objects that live as long
        # as the process) leaves the collector's generations: a full collection while serving then walks only what
        # requests made since, ~0.2 s less each (they came every few waves of 64 streams: issue 46)
        gc.collect()
        gc.freeze()
        # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown; with these handlers in place that only
        # returns here, so that the client model's DHT (a child process) is shut down instead of orphaned
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        aio.run_main(_serve(app, config, sock))
        logger.info("stopping: closing the swarm client")
        code = 0
    except (ValueError, RuntimeError, OSError) as e:
        logger.error(f"gateway failed: {e}")
        print(f"error: {e}", file=sys.stderr)
    finally:
        for model, _ in loaded:
            model.shutdown()
        store.close()
        stop_client_pool()
    return code


if __name__ == "__main__":
    sys.exit(main())
