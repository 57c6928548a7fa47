"""What a serving front end (the gateway) needs from the client model, as `typing.Protocol`s.

`ClientModel` is implemented by `swarm.client.model.DistributedModelForCausalLM`: its config, a route check
(`check_route`: can a session of this size be served right now), which blocks the swarm serves and by which servers
and weight formats (`coverage`), the
servers that the client banned after failures (`banned_peers` / `unban`), and `inference_session`, which opens a
`GenerationSession` (`swarm.client.model.ModelSession`): `feed` (make the servers hold exactly these ids, get the
last position's logits), `feed_and_pick` (the same, with the next tokens chosen in the batched LM-head task) and
`close` (and, with spot-checks on, `check_next_step` and `servers`; `ClientModel.verify_stats` gives their counters).
`prompt_logprobs` scores a prompt's tokens (the completions API's `echo` with `logprobs`). Front ends use
only these, never the client's routing internals, so tests may stand in a small stub.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, NamedTuple, Optional, Protocol, Sequence, Tuple, TypeVar

import torch

if TYPE_CHECKING:
    from swarm.client.status import SwarmStatus
    from swarm.client.verify import VerifyStats

T = TypeVar("T")


class ServerView(NamedTuple):
    """One online server as the client sees it: its blocks [start, end) and weight format."""

    peer_id: str
    start: int
    end: int
    quant_type: str  # what its record announces: "none", "int8", "nf4"
    allowed: bool  # whether this client's routes may use it (its `allowed_quant_types`)


class Coverage(NamedTuple):
    missing: List[int]  # block indices that no server announces (no server of an allowed quant type)
    num_blocks: int
    servers: int  # spans (servers) online that routes may use
    spans: Tuple[ServerView, ...] = ()  # every online server seen, allowed or not
    allowed_quant_types: Optional[Tuple[str, ...]] = None  # the client's restriction (None: any weight format)


class PromptLogprob(NamedTuple):
    """A prompt token scored given the tokens before it: its log-probability and the `top_k` best (id, logprob)."""

    token_id: int
    logprob: float
    top: List[Tuple[int, float]]  # best first; empty when top_k is 0


class GenerationSession(Protocol):
    token_ids: Optional[torch.Tensor]  # [batch, n] the ids whose states the servers hold (None before a feed)

    @property
    def max_length(self) -> int: ...

    def feed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Make the servers hold exactly `input_ids` [batch, n]; the last position's logits [batch, vocab]."""
        ...

    def feed_and_pick(self, input_ids: torch.Tensor, pick: Callable[[torch.Tensor], T]) -> Tuple[torch.Tensor, T]:
        """`feed`, then `pick(logits)` in the batched LM-head task: (logits [batch, vocab], what pick returned).
        Speculative decoding also passes `num_logits=n` (logits of the last n positions, [batch, n, vocab]) and
        calls `rewind(length)` (`swarm.client.model_session.ModelSession`); only sessions that have them can run
        speculative requests."""
        ...

    def close(self) -> None: ...

    # spot-checks (`swarm.client.verify`); optional: front ends use getattr, test doubles may lack them
    def check_next_step(self) -> bool:
        """Ask that the next feed check every span's outputs; False when this session cannot be checked."""
        ...

    def settle(self) -> None:
        """Wait for the spot-checks in flight; `OutputsRetracted` if one found a server wrong."""
        ...

    def servers(self) -> List[str]:
        """Peer ids of the servers holding this session's states."""
        ...


class ClientModel(Protocol):
    config: Any  # the Hugging Face model config (vocab_size, max_position_embeddings, eos_token_id)
    generation_config: Any  # its GenerationConfig (eos_token_id)

    def inference_session(self, max_length: int, adapter: Optional[str] = None) -> GenerationSession:
        """A session of up to `max_length` tokens, with LoRA `adapter` (None: the base model)."""
        ...

    def served_adapters(self, force: bool = False) -> List[str]:
        """The LoRA adapters the swarm serves over every block (`force`: refresh the swarm's view first)."""
        ...

    def prompt_logprobs(self, input_ids: Sequence[int], top_k: int, adapter: Optional[str] = None
                        ) -> List[PromptLogprob]:
        """Score a prompt: for each token after the first, its log-probability (log_softmax of the float32 logits)
        given the tokens before it, with the `top_k` most likely tokens there. One forward pass through the swarm
        (no cache), on the calling (worker) thread; `len(input_ids) - 1` entries."""
        ...

    def check_route(self, cache_tokens: int = 0, adapter: Optional[str] = None) -> None:
        """Raise `swarm.client.routing.RoutingError` unless a chain over every block, with cache for
        `cache_tokens` tokens (and servers that hold LoRA `adapter`), can be routed now."""
        ...

    def coverage(self, force: bool = False) -> Coverage:
        """Which blocks the swarm serves, from the client's view (`force`: refresh it first)."""
        ...

    def swarm_status(self, model_name: str) -> "SwarmStatus":
        """A fresh snapshot of the swarm for status pages (`swarm.client.status`): every server with its RTT from
        here, and the coverage of each block."""
        ...

    def banned_peers(self) -> List[str]: ...

    def unban(self, peer_id: str) -> None: ...

    def verify_stats(self) -> Optional["VerifyStats"]:
        """Spot-checks of servers' outputs (`swarm.client.verify`): counters and distrusted servers; None: off."""
        ...

    def shutdown(self) -> None: ...
