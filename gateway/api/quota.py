"""Per-key limits at admission, and usage recorded when a request ends.

`Quota.admit(caller, prompt_tokens)` runs before a generation slot is taken. A key with limits (`swarmgate keys create
NAME --rpm N --tpm N --max_streams N`) is counted in the state store's window for this minute, atomically with the
check (`gateway.store.base`: with Redis the limits hold across every gateway); over a limit it gets 429 in OpenAI's
shape (`rate_limit_exceeded`) with `Retry-After` (the window's end for requests and tokens, `--retry_after` for
streams) and the `x-ratelimit-*` headers. An admitted request's response carries OpenAI's headers as the admission
left the window (`x-ratelimit-limit-requests`, `-remaining-requests`, `-reset-requests` and the same for `-tokens`, for
the limits the key has; `RequestContext` in `gateway.app` adds them; every other response of the key carries them as
`gateway.api.auth` read the window), and a lease on one of the key's streams.

`Quota.finished(caller, lease, model, jobs)` runs when the request's slot is released: finished, cut, cancelled or
failed, what its jobs prefilled and generated (`GenerationJob.usage`) is counted in `/metrics` by key name (never the
key) at once and, on a store thread, in the store's usage (per key, model and day) and the key's token window, and
the stream's lease is returned. A store that fails then is logged and counted (`swarmgate_store_errors`); the
request itself has already been answered.
"""
from __future__ import annotations

import logging
import math
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

from starlette.concurrency import run_in_threadpool

from gateway.api.auth import Caller, ratelimit_headers
from gateway.errors import APIError
from gateway.metrics import Metrics
from gateway.serving.runs import GenerationJob
from gateway.store import Store, StoreUnavailable

logger = logging.getLogger("swarmgate.gateway")
_LIMIT_NAMES = {"requests": "requests per minute", "tokens": "tokens per minute", "streams": "concurrent streams"}


class Quota:
    def __init__(self, store: Store, metrics: Metrics, lease_ttl: float, retry_after: int):
        self.store, self.metrics, self.lease_ttl, self.retry_after = store, metrics, lease_ttl, retry_after
        self.writer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="store-writes")

    async def admit(self, caller: Caller, prompt_tokens: int) -> Optional[str]:
        """Count the request against its key's limits: the stream's lease (None: the key has no limits), or 429."""
        limits = caller.limits
        if not limits.any:
            return None
        lease = uuid.uuid4().hex
        decision = await run_in_threadpool(self.store.admit, caller.name, limits, prompt_tokens, lease,
                                           self.lease_ttl)
        headers = ratelimit_headers(limits, decision)
        if decision.refused is None:
            caller.headers = headers
            return lease
        caller.headers = {}  # the 429 carries them
        self.metrics.rate_limited.labels(key=caller.name, limit=decision.refused).inc()
        limit = {"requests": limits.rpm, "tokens": limits.tpm, "streams": limits.max_streams}[decision.refused]
        retry = self.retry_after if decision.refused == "streams" else max(1, math.ceil(decision.reset))
        raise APIError(429, f"Rate limit reached for key '{caller.name}': {limit} {_LIMIT_NAMES[decision.refused]}. "
                            f"Retry after {retry}s.", "rate_limit_error", None, "rate_limit_exceeded",
                       headers={"Retry-After": str(retry), **headers})

    def release(self, caller: Caller, lease: Optional[str]) -> None:
        """A lease whose request never ran (refused by the gateway's own admission)."""
        if lease is not None:
            self._submit(caller.name, lease, None, 0, 0, 0, False)

    def finished(self, caller: Caller, lease: Optional[str], model: str, jobs: List[GenerationJob]) -> None:
        prompt = cached = completion = 0
        for job in jobs:
            if job.usage is not None:
                prompt, cached, completion = (prompt + job.usage[0], cached + job.usage[1],
                                              completion + job.usage[2])
        m = self.metrics
        m.key_requests.labels(key=caller.name).inc()
        m.key_tokens.labels(key=caller.name, kind="prompt").inc(prompt)
        m.key_tokens.labels(key=caller.name, kind="cached").inc(cached)
        m.key_tokens.labels(key=caller.name, kind="completion").inc(completion)
        self._submit(caller.name, lease, model, prompt, cached, completion, True)

    def _submit(self, *args) -> None:
        try:
            self.writer.submit(self._write, *args)
        except RuntimeError:  # the gateway is stopping and its writes are done: the lease expires by itself
            logger.warning(f"usage of key '{args[0]}' not recorded: the gateway is stopping")

    def _write(self, name: str, lease: Optional[str], model: Optional[str], prompt: int, cached: int,
               completion: int, record: bool) -> None:
        try:
            if lease is not None:
                self.store.finish(name, completion, lease)
            if record and model is not None:
                self.store.record_usage(name, model, prompt, cached, completion)
        except StoreUnavailable as e:
            self.metrics.store_errors.inc()
            logger.warning(f"usage of key '{name}' not recorded: {e}")

    def shutdown(self) -> None:
        """Write what is pending (at the gateway's end)."""
        self.writer.shutdown(wait=True)
