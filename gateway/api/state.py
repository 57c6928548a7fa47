"""What one served model holds: its config, client model, tokenizer, limits, engine (with its session pool) and
metrics, and what it shares with the gateway's other models (`gateway.api.models`): admission, the state store, quota.

`GatewayState` is one per model (`app.state.models`); the first model's is also `app.state.gateway`.
`admit(jobs, caller)` checks the caller's key limits (`gateway.api.quota`), takes a generation slot (429 when the
queue is full) and checks that the swarm can route a session of the needed size right now (503 otherwise), before any
response starts, so that those errors reach the client as plain HTTP errors even for streaming requests.
`coverage()` describes which blocks are served; `quant_summary` adds, for `/health`, the weight formats
(`quant_type`) of the servers seen: counts, the formats covering each block range, and each server.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from starlette.concurrency import run_in_threadpool

from gateway.api.admission import Admission, Slot
from gateway.api.auth import Caller
from gateway.api.params import Limits, check_model
from gateway.api.quota import Quota
from gateway.config import GatewayConfig
from gateway.errors import bad_request, not_found
from gateway.metrics import Metrics
from gateway.serving.engine import Engine, RequestRun
from gateway.serving.events import swarm_error
from gateway.serving.runs import GenerationJob
from gateway.serving.tokens import Tokens
from gateway.store import Store
from swarm.client.api import ClientModel, Coverage, SpeculativeConfig

logger = logging.getLogger("swarmgate.gateway")


@dataclass
class GatewayState:
    config: GatewayConfig
    model: ClientModel
    tokens: Tokens
    engine: Engine
    admission: Admission
    metrics: Metrics
    limits: Limits
    created: int
    store: Store  # the state store (gateway.store): stored responses, keys, usage, rate-limit windows
    quota: Quota  # per-key limits and usage (gateway.api.quota)

    def new_job(self, prompt_ids: List[int], params, n: int, request_id: str,
                owner: Optional[str] = None, adapter: Optional[str] = None, stream: bool = False,
                speculative: Optional[SpeculativeConfig] = None) -> GenerationJob:
        """`owner`: the session pool namespace (`gateway.api.auth.owner_of`); None never reuses nor pools. `adapter`:
        the LoRA adapter the request named (`resolve_model`); `stream`: the response is streamed; `speculative`: its
        drafting (`speculation`)."""
        return GenerationJob(prompt_ids, params, n, request_id=request_id, owner=owner, adapter=adapter, stream=stream,
                             deadline=time.monotonic() + self.config.generation_timeout, speculative=speculative)

    def speculation(self, body) -> Optional[SpeculativeConfig]:
        """A request's speculative decoding: its `speculative` / `num_draft_tokens` fields, else the gateway's
        settings; None: off. A draft model needs the gateway's `--draft_model` (else a 400)."""
        method = body.speculative or self.config.speculative
        if method == "off":
            return None
        if method == "draft_model" and not self.config.draft_model:
            raise bad_request("speculative 'draft_model' needs a gateway started with --draft_model.",
                              param="speculative")
        return SpeculativeConfig(method=method, draft_model=self.config.draft_model,
                                 num_draft_tokens=body.num_draft_tokens or self.config.num_draft_tokens)

    async def admit(self, jobs: List[GenerationJob], caller: Optional[Caller] = None) -> RequestRun:
        """`caller`: who asks (`gateway.api.auth.caller_of`): its key's limits are checked first (429), and its usage
        is recorded when the slot is released."""
        caller = caller if caller is not None else Caller("anonymous")
        lease = await self.quota.admit(caller, sum(len(job.prompt_ids) for job in jobs))
        try:
            await self.admission.acquire()
        except BaseException:
            self.quota.release(caller, lease)
            raise
        model = jobs[0].adapter or self.config.model_name
        slot = Slot(self.admission, on_release=lambda: self.quota.finished(caller, lease, model, jobs))
        try:
            needed = max(job.n * (len(job.prompt_ids) + job.params.max_tokens) for job in jobs)
            await run_in_threadpool(self._route, needed, jobs[0].adapter)
        except BaseException:
            slot.close()
            raise
        return RequestRun(self.engine, slot, jobs)

    def _route(self, cache_tokens: int, adapter: Optional[str] = None) -> None:
        try:
            if adapter is None:
                self.model.check_route(cache_tokens)
            else:
                self.model.check_route(cache_tokens, adapter=adapter)
        except Exception as e:
            raise swarm_error(e) from None

    # ---- LoRA adapters as models ----------------------------------------------------------------------------------
    def served_adapters(self, force: bool = False) -> List[str]:
        """The LoRA adapters the swarm serves over every block (each is a model id of its own); [] when the model
        has no notion of adapters or the swarm's view cannot be read."""
        try:
            return list(self.model.served_adapters(force=force))
        except Exception as e:  # a DHT hiccup must not break /v1/models
            logger.warning(f"cannot read the swarm's adapters: {e}")
            return []

    async def aresolve_model(self, requested: Optional[str], required: bool = False) -> Tuple[str, Optional[str]]:
        """`resolve_model` from the event loop: the base model's names answered here (no thread hop per request,
        issue 46), an adapter's on a worker thread (it may read the swarm's view)."""
        if not requested or requested in (self.config.model_name, self.config.model_path):
            return self.resolve_model(requested, required)
        return await run_in_threadpool(self.resolve_model, requested, required)

    def resolve_model(self, requested: Optional[str], required: bool = False) -> Tuple[str, Optional[str]]:
        """A request's `model` -> (the model id to answer with, the LoRA adapter to use or None). The base model's
        names, or an adapter the swarm serves (the view refreshed once before a 404). Runs on a worker thread."""
        if not requested or requested in (self.config.model_name, self.config.model_path):
            return check_model(requested, self.config, required), None
        if requested in self.served_adapters() or requested in self.served_adapters(force=True):
            return requested, requested
        served = self.served_adapters()
        raise not_found(f"The model '{requested}' does not exist; this gateway serves '{self.config.model_name}'"
                        + (f" and its LoRA adapters {', '.join(served)}" if served else "") + ".",
                        param="model", code="model_not_found")

    # ---- swarm coverage -------------------------------------------------------------------------------------------
    def coverage(self, force: bool = False) -> Coverage:
        """Missing block indices, number of blocks, usable online servers and every server seen (with its
        quant_type), from the client's view of the swarm."""
        coverage = Coverage(*self.model.coverage(force=force))
        return coverage._replace(missing=list(coverage.missing))

    def coverage_numbers(self) -> Tuple[int, int, int]:
        coverage = self.coverage(force=False)
        return coverage.num_blocks - len(coverage.missing), coverage.num_blocks, coverage.servers


def quant_summary(coverage: Coverage) -> Dict[str, Any]:
    """The weight formats of the swarm as `/health` shows them (every online server seen, allowed or not):

    `allowed_quant_types` (None: any), `quant_types` (servers per format), `block_quant_types` (block ranges
    with the formats that serve them, `[]` where none does) and `server_spans` (each server: blocks, format,
    whether routes may use it)."""
    num_blocks = coverage.num_blocks
    per_block: List[Tuple[str, ...]] = [()] * num_blocks
    counts: Dict[str, int] = {}
    for view in coverage.spans:
        counts[view.quant_type] = counts.get(view.quant_type, 0) + 1
        for block in range(max(view.start, 0), min(view.end, num_blocks)):
            if view.quant_type not in per_block[block]:
                per_block[block] = tuple(sorted(per_block[block] + (view.quant_type,)))
    ranges: List[Dict[str, Any]] = []
    start = 0
    for block in range(1, num_blocks + 1):
        if block == num_blocks or per_block[block] != per_block[start]:
            ranges.append({"blocks": f"{start}:{block}", "quant_types": list(per_block[start])})
            start = block
    allowed = coverage.allowed_quant_types
    return {
        "allowed_quant_types": None if allowed is None else list(allowed),
        "quant_types": dict(sorted(counts.items())),
        "block_quant_types": ranges,
        "server_spans": [{"peer_id": v.peer_id, "blocks": f"{v.start}:{v.end}", "quant_type": v.quant_type,
                          "allowed": v.allowed} for v in sorted(coverage.spans, key=lambda v: (v.start, v.peer_id))],
    }


def quant_note(coverage: Coverage) -> str:
    """For missing blocks that servers of disallowed quant types serve: '; blocks 15:30 are served only by nf4
    servers; allowed quant types: none', else ''."""
    if coverage.allowed_quant_types is None:
        return ""
    missing = set(coverage.missing)
    others: Dict[int, set[str]] = {}
    for view in coverage.spans:
        if not view.allowed:
            for block in range(view.start, view.end):
                if block in missing:
                    others.setdefault(block, set()).add(view.quant_type)
    if not others:
        return ""
    by_types: Dict[Tuple[str, ...], List[int]] = {}
    for block in sorted(others):
        by_types.setdefault(tuple(sorted(others[block])), []).append(block)
    parts = [f"blocks {format_ranges(blocks)} are served only by {' / '.join(types)} servers"
             for types, blocks in sorted(by_types.items(), key=lambda item: item[1][0])]
    return f"; {'; '.join(parts)}; allowed quant types: {', '.join(coverage.allowed_quant_types)}"


def format_ranges(indices: List[int]) -> str:
    """[0, 1, 2, 5] -> '0:3, 5:6' (half-open block ranges, as the CLI writes them)."""
    ranges, start = [], None
    for i, value in enumerate(indices):
        if start is None:
            start = value
        if i + 1 == len(indices) or indices[i + 1] != value + 1:
            ranges.append(f"{start}:{value + 1}")
            start = None
    return ", ".join(ranges)
