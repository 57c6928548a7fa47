"""Bases for the test doubles of the client (`swarm.client.api.ClientModel` and `GenerationSession`): what a double
does not script behaves as a client without spot-checks, adapters or routes to report. A double names only what its
test scripts; the gateway calls the protocols' every method without probing for them."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Optional


class StubSession:
    """A `GenerationSession` that checks nothing (no spot-checks: `check_next_step` is False, `settle` returns)."""

    token_ids: Any = None

    def check_next_step(self) -> bool:
        return False

    @property
    def check_pending(self) -> bool:
        return False

    def settle(self) -> None:
        pass

    def servers(self) -> List[str]:
        return []

    def rewind(self, length: int) -> None:
        if self.token_ids is not None:
            self.token_ids = self.token_ids[:, :length]

    @contextlib.contextmanager
    def unverified(self) -> Iterator[None]:
        yield

    def close(self) -> None:
        pass


class StubClientModel:
    """A `ClientModel` with no spot-checks, no adapters, no bans and no routes to report."""

    def verify_stats(self) -> Optional[Any]:
        return None

    def served_adapters(self, force: bool = False) -> List[str]:
        return []

    def observe_routes(self, observer: Callable[[Any], None]) -> None:
        pass

    def banned_peers(self) -> List[str]:
        return []

    def unban(self, peer_id: str) -> None:
        pass

    def check_route(self, cache_tokens: int = 0, adapter: Optional[str] = None) -> None:
        pass

    def shutdown(self) -> None:
        pass
