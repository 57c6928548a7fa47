"""What one gateway process holds: config, the client model, tokenizer, engine, admission, metrics.

`GatewayState` is stored on `app.state.gateway`. `admit(jobs)` takes a generation slot (429 when the queue is
full) and checks that the swarm can route a session of the needed size right now (503 otherwise), before
any response starts, so that those errors reach the client as plain HTTP errors even for streaming requests.
`coverage()` / `health()` describe which blocks are served.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

from starlette.concurrency import run_in_threadpool

from gateway.admission import Admission, Slot
from gateway.config import GatewayConfig
from gateway.engine import Engine, RequestRun
from gateway.events import swarm_error
from gateway.metrics import Metrics
from gateway.params import Limits
from gateway.runs import GenerationJob
from gateway.tokens import Tokens
from swarm.client.api import ClientModel


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

    def new_job(self, prompt_ids: List[int], params, n: int, request_id: str,
                 owner: Optional[str] = None) -> GenerationJob:
        """`owner`: the session pool namespace (`gateway.auth.owner_of`); None never reuses nor pools."""
        return GenerationJob(prompt_ids, params, n, request_id=request_id, owner=owner,
                             deadline=time.monotonic() + self.config.generation_timeout)

    async def admit(self, jobs: List[GenerationJob]) -> RequestRun:
        await self.admission.acquire()
        slot = Slot(self.admission)
        try:
            needed = max(job.n * (len(job.prompt_ids) + job.params.max_tokens) for job in jobs)
            await run_in_threadpool(self._route, needed)
        except BaseException:
            slot.close()
            raise
        return RequestRun(self.engine, slot, jobs)

    def _route(self, cache_tokens: int) -> None:
        try:
            self.model.check_route(cache_tokens)
        except Exception as e:
            raise swarm_error(e) from None

    # ---- swarm coverage -------------------------------------------------------------------------------------------
    def coverage(self, force: bool = False) -> Tuple[List[int], int, int]:
        """(missing block indices, number of blocks, online servers) from the client's view of the swarm."""
        missing, num_blocks, servers = self.model.coverage(force=force)
        return list(missing), num_blocks, servers

    def coverage_numbers(self) -> Tuple[int, int, int]:
        missing, total, servers = self.coverage(force=False)
        return total - len(missing), total, servers


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
