"""A client model's inference session: `ModelSession` pairs an `InferenceSession` with the token ids `[batch, n]`
whose states the servers hold, so that a new call sends only what they do not hold yet (rewinding them where the new
input diverges), with beam parents (`hypo_ids`), left padding and shallow prompts (`swarm.client.model.ptune`) applied.
It needs only the client's local layers (`swarm.client.model.head.ClientHead`: embeddings, final norm, LM head), the
swarm manager and the prompts it was opened with, not the model."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, TypeVar, Union, cast

import torch

from swarm.client.decoding.rows import held_prefix
from swarm.client.model.head import ClientHead
from swarm.client.model.ptune import PromptTuning
from swarm.client.transport.manager import SwarmManager
from swarm.client.transport.rounds import astep_round
from swarm.client.transport.session import PUSH_MAX_TOKENS, InferenceSession
from swarm.client.transport.verify import OutputsRetracted
from swarm.runtime.taskpool import PRIORITY_DECODE, client_pool
from swarm.wire import protocol as P

# embeddings of fewer elements than this run in the caller's thread: below torch's parallel grain size (32768),
# the lookup is serial and starts no OpenMP team there (`swarm.runtime.threads`)
SMALL_EMBED_ELEMENTS = 32768

T = TypeVar("T")


class ModelSession:
    """An inference session plus the token ids `[batch, n]` whose states the servers hold (and their rows' left
    padding)."""

    def __init__(self, head: ClientHead, manager: SwarmManager, max_length: int, adapter: Optional[str] = None,
                 ptune: Optional[PromptTuning] = None, recompute: Optional[Callable[[int, int], bool]] = None,
                 rope_lengths: bool = False):
        """`ptune`: the model's trainable prompts (`swarm.client.model.ptune`): shallow ones take the first positions,
        deep ones go to the servers. `recompute(held, total)`: whether extending `held` cached positions to `total`
        computes everything again (the family's `recompute_cache`: Phi-3's LongRoPE switching factors).
        `rope_lengths`: `InferenceSession`'s (LongRoPE: the factors of a step sent in parts are the whole step's)."""
        self.head, self.ptune, self.recompute = head, ptune, recompute
        self.offset = ptune.pre_seq_len if ptune is not None else 0  # positions the shallow prompts hold
        deep = None if ptune is None or ptune.deep_prompts is None else \
            ptune.deep_prompts.detach().unsqueeze(1).cpu()  # [num_blocks, 1, pre_seq_len, hidden]
        # the servers hold the shallow prompts' positions too
        self.session = InferenceSession(manager, max_length + self.offset, adapter=adapter, prompts=deep,
                                        rope_lengths=rope_lengths)
        self.token_ids: Optional[torch.Tensor] = None
        self.left_padding: Optional[List[int]] = None
        # set before the first feed: its prompt is declared to the servers' prefix caches with this salt, and the
        # leading positions they hold already (same salt, adapter and tokens) are adopted, not computed
        # (`swarm.client.transport.prefix`); None: not declared
        self.prefix_salt: Optional[str] = None

    @property
    def max_length(self) -> int:
        return self.session.max_length

    @property
    def position(self) -> int:
        return self.session.position

    @property
    def adopted_tokens(self) -> int:
        """Positions adopted from the servers' prefix caches (`prefix_salt`; shallow prompts never declare)."""
        return self.session.adopted_tokens

    def reusable_prefix(self, input_ids: torch.Tensor, hypo_ids: Optional[List[int]] = None,
                        left_padding: Optional[List[int]] = None) -> Tuple[int, Optional[List[int]]]:
        """(how many leading tokens of `input_ids` the servers already hold, at most len - 1: the last token is
        always sent again, as its logits are needed; the held row each row continues, None for the same rows).
        `hypo_ids`: the caller's parents of the rows (beam search), `left_padding`: the rows' padding."""
        held, held_padding = self.token_ids, self.left_padding
        if hypo_ids is None and held is not None and held_padding == left_padding and \
                held.shape[0] == input_ids.shape[0] and held.shape[1] == input_ids.shape[1] - 1 and \
                held.shape[1] > 0 and torch.equal(input_ids[:, :-1], held):
            return held.shape[1], None  # a decode step: one comparison (each torch call here waits for the GIL)
        if hypo_ids is not None and held is not None and held.shape[0] == len(hypo_ids):
            held = held[hypo_ids]
        reuse, parents = held_prefix(held, input_ids)
        if parents is not None:
            hypo_ids = parents if hypo_ids is None else [hypo_ids[p] for p in parents]
        if held_padding is not None and hypo_ids is not None:
            held_padding = [held_padding[i] for i in hypo_ids]
        if held_padding != left_padding:
            return 0, None  # other padding: other positions and masks, everything is computed again
        return reuse, hypo_ids if reuse > 0 else None

    @property
    def check_pending(self) -> bool:
        """Whether a full check (`check_next_step`) is asked and not yet done."""
        return bool(self.session.check_all_next)

    def check_next_step(self) -> bool:
        """Ask that the next `feed` spot-check every span of the chain (`swarm.client.transport.verify`): once it
        returns, every output the session holds was checked (or is unverifiable: one server covers the span). False when
        this session's steps cannot be checked (verification off, deep prompts); nothing is asked then."""
        inner = self.session
        if inner._verifier is None or inner.prompts is not None or not inner.verify_steps:
            return False
        inner.check_all_next = True
        return True

    def settle(self) -> None:
        """Wait for the session's spot-checks in flight (`swarm.client.transport.verify.BackgroundChecks`): raises
        `OutputsRetracted` (in tokens) if one found a server wrong; the servers then hold the tokens before it."""
        offset = self.offset
        try:
            self.session.settle()
        except OutputsRetracted as e:
            if not offset:
                raise
            raise self._in_tokens(e, offset) from e
        finally:
            if self.token_ids is not None:
                self.token_ids = self.token_ids[:, :max(self.session.position - offset, 0)]

    def _in_tokens(self, e: OutputsRetracted, offset: int) -> OutputsRetracted:
        """A retraction in the caller's tokens: the session's positions count the shallow prompts (`offset`)."""
        if e.position < offset:
            self.session.rewind(0)  # the prompts' own outputs were wrong: they go again
        return OutputsRetracted(max(e.position - offset, 0))

    def servers(self) -> List[str]:
        """The peer ids of the servers that hold this session's states now."""
        return [hop.peer_id for hop in self.session.chain]

    def open(self, batch_size: int = 1) -> "ModelSession":
        """Route and open the servers' sessions now (else the first `feed` does it); errors surface here."""
        self.session.open(batch_size)
        return self

    def feed(self, input_ids: torch.Tensor, hypo_ids: Optional[List[int]] = None,
             left_padding: Optional[List[int]] = None) -> torch.Tensor:
        """Make the servers hold exactly `input_ids` [batch, n]; returns the last position's logits [batch, vocab].
        `hypo_ids` [batch]: row i continues held row hypo_ids[i] (beam search: the servers reorder their caches);
        `left_padding` [batch]: each row's leading padding positions (`swarm.client.decoding.rows.left_padding`).

        The LM head runs on the process's compute thread (`swarm.runtime.taskpool.client_pool`): the heads of concurrent
        sessions' steps become one pass there. So does the embedding, unless it is a few rows (a decode step:
        a lookup too small to be worth a hand-over)."""
        return self._feed(input_ids, None, hypo_ids, left_padding)[0]

    def feed_and_pick(self, input_ids: torch.Tensor, pick: Callable[[torch.Tensor], T],
                      left_padding: Optional[List[int]] = None, *, num_logits: int = 1) -> Tuple[torch.Tensor, T]:
        """`feed`, then `pick(logits)` (the next tokens [batch], or the gateway's per-row choices) in the same
        compute-thread task as the LM head: returns (logits [batch, vocab], what pick returned). With
        `num_logits` n > 1 the logits of the last n positions go to `pick` and come back, [batch, n, vocab]
        (speculative decoding verifies a token's drafts this way: `swarm.client.decoding.speculative`)."""
        return self._feed(input_ids, pick, None, left_padding, num_logits)

    def feed_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`feed` without the LM head (no beams, no padding): the servers made to hold `input_ids` [batch, n] on
        this thread; returns the last position's states [batch, hidden], for a caller that runs the head over them
        with other rows (an engine round takes a prompt's first pick so: `gateway.serving.rounds`, issue 46)."""
        input_ids = input_ids.cpu()
        hidden = self.round_input(input_ids)
        try:
            outcome: Union[torch.Tensor, BaseException] = self.session.step(hidden)
        except BaseException as e:  # noqa: BLE001 - the held ids follow the servers first; raised by round_finish
            outcome = e
        return self.round_finish(input_ids, outcome)

    @contextlib.contextmanager
    def unverified(self) -> Iterator[None]:
        """No spot-checks on this session's steps meanwhile (beam search: its rows are reordered every step)."""
        self.session.verify_steps = False
        try:
            yield
        finally:
            self.session.verify_steps = True

    def rewind(self, length: int) -> None:
        """Make the servers hold only the first `length` tokens of `token_ids` (the next feed overwrites the rest;
        speculative decoding drops its rejected drafts so)."""
        if self.token_ids is None or length >= self.token_ids.shape[1]:
            return
        self.session.rewind(length + self.offset)
        self.token_ids = self.token_ids[:, :length].clone()

    # ---- a step of an engine round (`gateway.serving.rounds`): the caller runs the LM head over many sessions' rows
    def round_input(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first half of `feed` without beams or padding: the servers are rewound to what `input_ids` [batch, n]
        shares with what they hold; returns the hidden states to send [batch, new, hidden] (`round_step`)."""
        return self._prepare(input_ids.cpu(), None, None)[0]

    async def round_step(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The second half, on the client's loop: `hidden` (from `round_input(input_ids)`) through the servers
        (failover inside); returns the last position's states [batch, hidden] for the caller's LM head. Many
        sessions' steps at once, one message per server: `astep_sessions`."""
        try:
            outcome: Union[torch.Tensor, BaseException] = await self.session.astep(hidden)
        except BaseException as e:  # noqa: BLE001 - settled (and raised again) by round_finish
            outcome = e
        return self.round_finish(input_ids, outcome)

    def round_finish(self, input_ids: torch.Tensor, outcome: Union[torch.Tensor, BaseException]) -> torch.Tensor:
        """A round step's end: the held ids follow the servers' position; the last states [batch, hidden], or the
        step's error (a retraction in token positions)."""
        self.token_ids = input_ids.cpu()[:, :max(self.session.position - self.offset, 0)].clone()
        self.left_padding = None
        if isinstance(outcome, OutputsRetracted) and self.offset:
            raise self._in_tokens(outcome, self.offset) from outcome
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome[:, -1]

    def _prepare(self, input_ids: torch.Tensor, hypo_ids: Optional[List[int]], left_padding: Optional[List[int]]
                 ) -> Tuple[torch.Tensor, int, Optional[List[int]]]:
        """(hidden states to send [batch, new, hidden], tokens reused, beam parents): the servers rewound to what
        `input_ids` shares with what they hold."""
        offset = self.offset  # shallow prompts (`swarm.client.model.ptune`) hold the first positions
        new_ids, reuse, hypo_ids = self._rewind(input_ids, hypo_ids, left_padding)
        hidden = _embed(self.head, new_ids)
        if offset and self.session.position == 0:
            assert self.ptune is not None
            with torch.no_grad():  # the prompts [batch, pre_seq_len, hidden] in front of hidden [batch, n, hidden]
                hidden = torch.cat([self.ptune.input_prompts(hidden.shape[0]).to(hidden.dtype), hidden], dim=1)
        return hidden, reuse, hypo_ids

    def _rewind(self, input_ids: torch.Tensor, hypo_ids: Optional[List[int]], left_padding: Optional[List[int]]
                ) -> Tuple[torch.Tensor, int, Optional[List[int]]]:
        """`_prepare` up to the embedding: (the ids to send [batch, new], tokens reused, beam parents), the servers
        rewound to what `input_ids` shares with what they hold."""
        offset = self.offset
        if offset and left_padding:
            raise ValueError("left-padded batches cannot be combined with shallow prompt tuning (ptune)")
        reuse, hypo_ids = self.reusable_prefix(input_ids, hypo_ids, left_padding)
        if self.recompute is not None and self.recompute(reuse + offset, input_ids.shape[1] + offset):
            reuse, hypo_ids = 0, None  # (Phi-3's LongRoPE switching factors: everything again, as transformers)
        if reuse + offset < self.session.position:
            self.session.rewind(reuse + offset)
        if self.prefix_salt is not None and self.session.batch_size is None and not offset and \
                input_ids.shape[0] == 1 and not left_padding and hypo_ids is None:
            self.session.prefix = P.PrefixDecl(salt=self.prefix_salt, tokens=input_ids[0].tolist())
            # only the last positions' outputs are used (`_feed`, `round_finish`): the adopted ones stay on the servers
            self.session.adopted_outputs = False
        return input_ids[:, reuse:], reuse, hypo_ids

    def _feed(self, input_ids: torch.Tensor, pick, hypo_ids: Optional[List[int]],
              left_padding: Optional[List[int]], num_logits: int = 1) -> Tuple[torch.Tensor, Any]:
        offset = self.offset
        input_ids = input_ids.cpu()  # the held ids live on the host (a GPU client's callers may pass theirs)
        hidden, reuse, hypo_ids = self._prepare(input_ids, hypo_ids, left_padding)
        new_ids = input_ids[:, reuse:]
        if num_logits > 1:  # (more than the last position's: the adopted ones too, should the step adopt them)
            self.session.adopted_outputs = True
        pool = client_pool()
        # A decode step's head (one token, or a speculative step's few, after held ones) is expected by concurrent
        # sessions' heads, which wait for it (`TaskPool` docstring); a prompt's head (the first token) waits for no
        # one: it is not held up by a round it is not part of yet
        decode = new_ids.shape[1] == 1 or (reuse > 0 and new_ids.shape[1] <= PUSH_MAX_TOKENS)
        head = ("head", id(self.head)) if decode else ("prompt head", id(self.head))
        if decode and not getattr(self.session, "verifies", False):  # a spot-checked step may be slow: no waits
            pool.gatherer.expect(head, id(self))
        try:
            out = self.session.step(hidden, hypo_ids=hypo_ids, left_padding=left_padding if reuse == 0 else None)
        except OutputsRetracted as e:
            pool.gatherer.unexpect(head, id(self))
            if not offset:
                raise
            raise self._in_tokens(e, offset) from e
        except BaseException:
            pool.gatherer.unexpect(head, id(self))  # no head item follows: nobody waits for it
            raise
        finally:  # what the servers hold (less after a failure or `swarm.client.transport.verify.OutputsRetracted`)
            self.token_ids = input_ids[:, :max(self.session.position - offset, 0)].clone()
            self.left_padding = left_padding
        if num_logits > 1:  # [batch * n, hidden] rows for the head; pick sees logits [batch, n, vocab]
            if num_logits > out.shape[1]:
                raise ValueError(f"num_logits={num_logits} but only {out.shape[1]} positions were sent")
            batch = out.shape[0]
            last = out[:, -num_logits:].reshape(batch * num_logits, out.shape[-1])
            inner = pick
            pick = None if inner is None else (lambda rows: inner(rows.view(batch, num_logits, -1)))
        else:
            last = out[:, -1]  # [batch, hidden]
        logits, picked = pool.call_batchable(PRIORITY_DECODE, head, self.head.head_rows, (last, pick),
                                             source=id(self))
        if isinstance(picked, BaseException):  # this session's own error (say, a user's logits processor)
            raise picked
        if num_logits > 1:
            logits = logits.view(out.shape[0], num_logits, -1)
        return logits, picked

    def close(self) -> None:
        self.session.close()
        client_pool().gatherer.forget(id(self))  # concurrent sessions' heads stop waiting for this one

    def __enter__(self) -> "ModelSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


RoundOutcome = Union[torch.Tensor, BaseException]


def _embed(head: ClientHead, new_ids: torch.Tensor) -> torch.Tensor:
    """[batch, n] -> [batch, n, hidden]: small lookups on this thread (serial kernels, no OpenMP team here), larger
    ones on the client's compute thread."""
    if new_ids.numel() * head.hidden_size < SMALL_EMBED_ELEMENTS:
        return head.embed(new_ids)
    return client_pool().call(PRIORITY_DECODE, head.embed, new_ids)


def round_inputs(steps: Sequence[Tuple[Any, torch.Tensor]]) -> List[Union[torch.Tensor, BaseException]]:
    """`round_input` of many sessions at once, (session, input_ids [batch, n]) each: each one's hidden states to
    send [batch, new, hidden], or its own error (a session of another kind: its own `round_input`). The sessions
    that share a head and send as many new tokens (an engine round's decode steps: one each) are embedded in ONE
    lookup, not one per session (issue 46); the rows are `round_input`'s (an embedding, and a family's embedding
    norm, are per position)."""
    out: List[Union[torch.Tensor, BaseException, None]] = [None] * len(steps)
    together: dict = {}  # (head, new tokens) -> [(index, new ids [batch, new])]
    for k, (session, input_ids) in enumerate(steps):
        try:
            if not isinstance(session, ModelSession) or session.offset:  # (shallow prompts in front): its own way
                out[k] = session.round_input(input_ids)
                continue
            new_ids = session._rewind(input_ids.cpu(), None, None)[0]
            together.setdefault((id(session.head), new_ids.shape[1]), []).append((k, new_ids))
        except BaseException as e:  # noqa: BLE001 - this session's own error
            out[k] = e
    for group in together.values():
        head = steps[group[0][0]][0].head
        try:
            ids = [new_ids for _, new_ids in group]
            hidden = _embed(head, torch.cat(ids) if len(ids) > 1 else ids[0])  # [sum batch, new, hidden]
            for (k, _), part in zip(group, torch.split(hidden, [new_ids.shape[0] for new_ids in ids])):
                out[k] = part
        except BaseException as e:  # noqa: BLE001 - the lookup failed (never seen): each session's error
            for k, _ in group:
                out[k] = e
    return cast(List[Union[torch.Tensor, BaseException]], out)


async def astep_sessions(steps: Sequence[Tuple[ModelSession, torch.Tensor, torch.Tensor]],
                         done: Callable[[int, RoundOutcome], None]) -> None:
    """Many model sessions' round steps at once, on the client's loop: (session, input_ids [batch, n], hidden from
    `round_input`) each; the sessions that share a server travel in one message to it
    (`swarm.client.transport.rounds.astep_round`). `done(index, outcome)` is called as soon as each step ends, with
    its last states [batch, hidden] (`round_step`'s) or its error: a slow step (a failover) holds up no other."""
    def finished(index: int, outcome: RoundOutcome) -> None:
        session, input_ids, _ = steps[index]
        try:
            result: RoundOutcome = session.round_finish(input_ids, outcome)
        except BaseException as e:  # noqa: BLE001 - the step's own error, handed to its owner
            result = e
        done(index, result)

    await astep_round([(session.session, hidden, None) for session, _, hidden in steps], on_outcome=finished)
