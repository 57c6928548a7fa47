"""The client's one door for a serving front end (the gateway): the client model as `typing.Protocol`s, the
decode loop, and the value types and errors a front end handles.

`ClientModel` is implemented by `swarm.client.model.causal_lm.DistributedModelForCausalLM`: its config, a route check
(`check_route`: can a session of this size be served right now), which blocks the swarm serves and by which servers
and weight formats (`coverage`), the servers' prefix cache counters (`server_prefix_caches`), the servers that the
client banned after failures (`banned_peers` / `unban`), the spot-checks' counters and distrusted servers
(`verify_stats`), and `inference_session`, which opens a
`GenerationSession` (`swarm.client.model.model_session.ModelSession`): `feed` (make the servers hold exactly these ids,
get the last position's logits), `feed_and_pick` (the same, with the next tokens chosen in the batched LM-head task;
several positions' logits for speculative decoding), `rewind`, `close`, and the spot-checks' `check_next_step`,
`check_pending`, `settle` and `servers`. `prompt_logprobs` scores a prompt's tokens (the completions API's `echo`
with `logprobs`). Generations run `DecodeLoop` (`swarm.client.decoding.loop`) with a policy of the front end's own.
The gateway imports the client from here only (tests/test_layout.py), never its routing internals, so tests may
stand in a small stub that implements these protocols.
"""
from __future__ import annotations

from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    List,
    NamedTuple,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    TypeVar,
)

import torch

from swarm.client.decoding.drafting import MAX_DRAFT_TOKENS, SpeculativeConfig, load_draft_model
from swarm.client.decoding.grammar import (
    GrammarConstraint,
    GrammarTokenizer,
    check_grammar,
    choice_grammar,
    closed_schema,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
    styled_schema,
)
from swarm.client.decoding.loop import DecodeLoop, DecodePolicy
from swarm.client.decoding.round_pick import pick_round
from swarm.client.decoding.sampling import RowSamplers, Sampler, SamplingParams, TokenChoice
from swarm.client.decoding.speculative import Speculator
from swarm.client.model.model_session import astep_sessions, round_inputs
from swarm.client.transport.routing import RoutingError, normalize_quant_types
from swarm.client.transport.session import SessionError
from swarm.client.transport.verify import OutputsRetracted, VerifyStats
from swarm.wire.protocol import RemoteError

if TYPE_CHECKING:
    from swarm.client.transport.status import SwarmStatus

# what front ends use of the client besides the protocols below: the decode loop and its pieces, the value types and
# the errors (`gateway/` imports the client only from here: tests/test_layout.py)
__all__ = [
    "MAX_DRAFT_TOKENS", "ClientModel", "Coverage", "DecodeLoop", "DecodePolicy", "GenerationSession",
    "GrammarConstraint", "GrammarTokenizer", "OutputsRetracted", "PromptLogprob", "RemoteError", "RoutingError",
    "RowSamplers", "Sampler", "SamplingParams", "ServerView", "SessionError", "SpeculativeConfig", "Speculator",
    "TokenChoice", "VerifyStats", "check_grammar", "choice_grammar", "closed_schema", "json_schema_grammar",
    "lark_grammar", "load_draft_model", "normalize_quant_types", "pick_round", "regex_grammar", "round_capable",
    "styled_schema", "RoundSession", "astep_sessions", "round_inputs",
]

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
    """An inference session as a front end drives it (`swarm.client.model.model_session.ModelSession`)."""

    token_ids: Optional[torch.Tensor]  # [batch, n] the ids whose states the servers hold (None before a feed)
    # set before the first feed: the prompt is declared to the servers' prefix caches with this salt (None: not)
    prefix_salt: Optional[str]

    @property
    def adopted_tokens(self) -> int:
        """Prompt positions the servers held already from earlier sessions' prefix pages (not computed again)."""
        ...

    @property
    def max_length(self) -> int: ...

    def feed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Make the servers hold exactly `input_ids` [batch, n]; the last position's logits [batch, vocab]."""
        ...

    def feed_and_pick(self, input_ids: torch.Tensor, pick: Optional[Callable[[torch.Tensor], T]], *,
                      num_logits: int = 1) -> Tuple[torch.Tensor, T]:
        """`feed`, then `pick(logits)` in the batched LM-head task: (logits [batch, vocab], what pick returned).
        `num_logits` n > 1 (speculative decoding: last token + drafts): the logits of the last n positions,
        [batch, n, vocab]."""
        ...

    def rewind(self, length: int) -> None:
        """Make the servers hold only the first `length` tokens of `token_ids` (rejected drafts are dropped so)."""
        ...

    def close(self) -> None: ...

    # spot-checks (`swarm.client.transport.verify`): a session of a client that checks nothing answers False / returns
    def check_next_step(self) -> bool:
        """Ask that the next feed check every span's outputs; False when this session cannot be checked."""
        ...

    @property
    def check_pending(self) -> bool:
        """Whether a full check (`check_next_step`) is asked and not yet done."""
        ...

    def settle(self) -> None:
        """Wait for the spot-checks in flight; `OutputsRetracted` if one found a server wrong."""
        ...

    def servers(self) -> List[str]:
        """Peer ids of the servers holding this session's states."""
        ...


class RoundSession(GenerationSession, Protocol):
    """A session that can step in an engine round (`gateway.serving.rounds`): the caller embeds (`round_input`),
    sends many sessions' steps together on the client's loop (`round_step`: the last states [batch, hidden]) and runs
    one LM head (`head.head`) over every session's rows."""

    head: Any  # `swarm.client.model.head.ClientHead`: `head(states [rows, hidden]) -> logits [rows, vocab]`

    def round_input(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    async def round_step(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor: ...

    def feed_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A prompt's step without the LM head: its last states [batch, hidden] (the round picks its first tokens;
        the gateway checks for it: a session without it steps its prompt with its own head)."""
        ...


def round_capable(session: Any) -> bool:
    """Whether `session` can step in an engine round (a `RoundSession`; a test's stub may not)."""
    return callable(getattr(session, "round_step", None)) and callable(getattr(session, "round_input", None)) \
        and hasattr(session, "head")


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
        """Raise `swarm.client.transport.routing.RoutingError` unless a chain over every block, with cache for
        `cache_tokens` tokens (and servers that hold LoRA `adapter`), can be routed now."""
        ...

    def coverage(self, force: bool = False) -> Coverage:
        """Which blocks the swarm serves, from the client's view (`force`: refresh it first)."""
        ...

    def swarm_status(self, model_name: str) -> "SwarmStatus":
        """A fresh snapshot of the swarm for status pages (`swarm.client.transport.status`): every server with its RTT
        from here, and the coverage of each block."""
        ...

    def server_prefix_caches(self) -> Dict[str, Any]:
        """Each online server's prefix cache counters (`swarm.wire.call_messages.PrefixCacheReport`) by peer id,
        read from the servers now (those that answer in 2 s)."""
        ...

    def banned_peers(self) -> List[str]: ...

    def unban(self, peer_id: str) -> None: ...

    def observe_routes(self, observer: Callable[[Any], None]) -> None:
        """Call `observer(timing)` with each inference chain's routing time
        (`swarm.client.transport.manager.RouteTiming`)."""
        ...

    def verify_stats(self) -> Optional[VerifyStats]:
        """Spot-checks of servers' outputs (`swarm.client.transport.verify`): counters and distrusted servers; None:
        off."""
        ...

    def shutdown(self) -> None: ...
