"""The models one gateway serves (`--model` given several times): each its own `GatewayState`, and the routing of a
request to one of them by its `model` field.

`ServedModels` holds one `gateway.api.state.GatewayState` per model, in the order given (the first is the default of
requests that may omit `model`, like `/tokenize`); each has its own client model, tokenizer and chat template, limits,
engine, conversation session pool and per-model metrics, and they share the admission slots, the state store, the
per-key limits and the gateway-wide metrics. `pick(requested)` finds the model a request names: a model's id or its
path, or a LoRA adapter that the swarm of one of them serves (the adapters are read once more before the 404, OpenAI's
`model_not_found`, naming what is served). `install(app, models)` adds `GET /v1/models` (each model with its swarm
coverage, then its adapters) and `GET /v1/models/{id}`. `render_metrics()` is `/metrics`: with one model the
Prometheus text as before; with several, each model's series carry a `model` label (`gateway.metrics.render_models`).
`discover(config)` is `--model all`: the settings for every model the swarm's servers announce (`ModelRecord`s under
`swarm.wire.records.MODELS_KEY`), read once at start.
"""
from __future__ import annotations

import logging
import time
from typing import List, Optional, Sequence

from fastapi import Depends, FastAPI
from starlette.concurrency import run_in_threadpool

from gateway.api.auth import require_api_key
from gateway.api.params import check_model
from gateway.api.state import GatewayState, format_ranges
from gateway.config import GatewayConfig
from gateway.errors import not_found
from gateway.metrics import render_models
from gateway.schemas import ModelCard, ModelCoverage, ModelList

logger = logging.getLogger("swarmgate.gateway")


class ServedModels:
    def __init__(self, states: Sequence[GatewayState]):
        if not states:
            raise ValueError("a gateway serves at least one model")
        self.states: List[GatewayState] = list(states)

    @property
    def default(self) -> GatewayState:
        return self.states[0]

    @property
    def names(self) -> List[str]:
        return [state.config.model_name for state in self.states]

    def by_name(self, requested: str) -> Optional[GatewayState]:
        """The model whose id or path is `requested` (not its adapters), or None."""
        return next((s for s in self.states if requested in (s.config.model_name, s.config.model_path)), None)

    async def route(self, requested: Optional[str], required: bool = False) -> GatewayState:
        """`pick` from the event loop: a model's own id or path without a worker thread, the rest (adapters) on one."""
        state = self.by_name(requested) if requested else None
        return state if state is not None else await run_in_threadpool(self.pick, requested, required)

    def pick(self, requested: Optional[str], required: bool = False) -> GatewayState:
        """The model a request's `model` names (its id, its path or one of its served LoRA adapters); no `model`: the
        first (a 400 when `required`); anything else: a 404 `model_not_found`. Runs on a worker thread (the adapters
        are read from the swarm)."""
        if not requested:
            check_model(requested, self.default.config, required)
            return self.default
        state = self.by_name(requested)
        if state is not None:
            return state
        for force in (False, True):  # the adapters as last seen, then read again once before the 404
            for state in self.states:
                if requested in state.served_adapters(force=force):
                    return state
        served = [f"'{name}'" for name in self.names] + [a for s in self.states for a in s.served_adapters()]
        raise not_found(f"The model '{requested}' does not exist; this gateway serves {', '.join(served)}.",
                        param="model", code="model_not_found")

    def served_ids(self) -> List[str]:
        """Every id a request may name now: the models, their paths and their served adapters."""
        ids: List[str] = []
        for state in self.states:
            ids += [state.config.model_name, state.config.model_path, *state.served_adapters()]
        return list(dict.fromkeys(ids))

    def render_metrics(self) -> bytes:
        return render_models([(state.config.model_name, state.metrics) for state in self.states])

    def shutdown(self) -> None:
        for state in self.states:
            state.engine.shutdown()


def coverage_of(state: GatewayState) -> Optional[ModelCoverage]:
    """A model's swarm coverage as `/v1/models` shows it (None when the swarm's state cannot be read now)."""
    try:
        coverage = state.coverage(force=False)
    except Exception as e:  # a DHT hiccup must not break /v1/models
        logger.warning(f"cannot read the coverage of {state.config.model_name}: {e}")
        return None
    return ModelCoverage(blocks=coverage.num_blocks, blocks_served=coverage.num_blocks - len(coverage.missing),
                         servers=coverage.servers, missing_blocks=format_ranges(coverage.missing))


def card(state: GatewayState, adapter: Optional[str] = None, with_coverage: bool = True) -> ModelCard:
    """A base model's card (with its coverage), or a LoRA adapter's: its own id, the base model as `parent` (as vLLM
    lists LoRA modules). Runs on a worker thread."""
    name = state.config.model_name
    return ModelCard(id=adapter or name, created=state.created, context_length=state.limits.context,
                     max_model_len=state.limits.context, parent=name if adapter else None,
                     coverage=coverage_of(state) if with_coverage and adapter is None else None)


def install(app: FastAPI, models: ServedModels) -> None:
    """`GET /v1/models` and `GET /v1/models/{model_id}` (behind the API keys when configured)."""

    def listing() -> ModelList:
        cards = []
        for state in models.states:
            cards += [card(state)] + [card(state, adapter) for adapter in state.served_adapters()]
        return ModelList(data=cards)

    def one(model_id: str) -> ModelCard:
        state = models.pick(model_id)
        _, adapter = state.resolve_model(model_id)
        return card(state, adapter)

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def list_models() -> ModelList:
        return await run_in_threadpool(listing)

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(require_api_key)])
    async def get_model(model_id: str) -> ModelCard:
        return await run_in_threadpool(one, model_id)


def discover(config: GatewayConfig) -> GatewayConfig:
    """`--model all`: `config` with `model` = every model the swarm's online servers announce (at least one of its
    blocks served by an online server now; waiting up to
    `rpc_timeout` seconds for the first), each found under the DHT prefix derived from its name; a RuntimeError when
    none is. A model announced under another prefix (a server's own `--dht_prefix`) is skipped with a warning: name
    it with `--dht_prefix` on a gateway of its own."""
    from swarm.runtime.swarm_key import join_dht
    from swarm.wire.records import dht_prefix_for, fetch_block_records, fetch_models, online_spans

    dht = join_dht(config.load_swarm_key(), initial_peers=config.initial_peers, client_mode=True)

    def served_now() -> list:  # a record outlives its server by its expiration: keep models with an online server
        return [r for r in fetch_models(dht) if online_spans(fetch_block_records(dht, r.prefix, r.num_blocks))]

    try:
        deadline = time.monotonic() + config.rpc_timeout
        records = served_now()
        while not records and time.monotonic() < deadline:
            time.sleep(1.0)
            records = served_now()
    finally:
        dht.shutdown()
    models: dict = {}
    for record in records:
        name = record.model.rstrip("/").split("/")[-1] or record.model
        if record.prefix != dht_prefix_for(record.model):
            logger.warning(f"skipping {record.model}: its servers announce it under the DHT prefix {record.prefix!r}, "
                           f"not the one derived from its name (serve it with --dht_prefix on a gateway of its own)")
        elif name in models:
            logger.warning(f"skipping {record.model}: its id {name!r} is {models[name]}'s too")
        else:
            models[name] = record.model
    if not models:
        raise RuntimeError("--model all: no server of the swarm announces a model (servers of release 0.2.0 and "
                           "older do not: name their models)")
    logger.info(f"--model all: serving {', '.join(models.values())}")
    return config.model_copy(update={"model": list(models.values())})
