"""The Hugging Face-style client model: local embeddings, final norm and LM head; remote blocks.

`AutoDistributedModelForCausalLM.from_pretrained(name_or_path, initial_peers=[...])` reads only the embedding,
final norm and LM head tensors of the checkpoint; the transformer blocks run on the swarm (other keyword arguments
are `ClientConfig` settings, e.g. `allowed_quant_types=["none", "int8"]`: route only through servers of those
weight formats; default: any). `model(input_ids)`
returns logits through plain forward passes. `model.inference_session(max_length=N)` opens a `ModelSession`
that remembers which tokens the servers' caches hold, so `model.generate(..., session=s)` across several calls
(a multi-turn chat) sends only new tokens, rewinding the servers when the new input diverges from what they
hold. Generation uses Hugging Face `GenerationConfig` and picks tokens through `swarm.client.generation` (the
gateway's path too: Hugging Face logits processors, greedy or sampling) and accepts a `streamer`.
The model implements `swarm.client.api.ClientModel` (route check, coverage, bans, sessions) for the gateway.
LoRA adapters: `active_adapter`, or one per session (`swarm.client.adapters`).
"""
from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar, Union, cast

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import MaxTimeCriteria, StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from swarm.client.adapters import ACTIVE_ADAPTER, AdapterChoice
from swarm.client.api import Coverage, PromptLogprob, ServerView
from swarm.client.generation import SamplingParams, build_processors, process_and_pick_scores
from swarm.client.manager import ClientConfig, SwarmManager
from swarm.client.routing import quant_allowed
from swarm.client.rowpad import RowPadding
from swarm.client.session import InferenceSession, SessionError
from swarm.client.verify import OutputsRetracted
from swarm.modeling.checkpoint import Checkpoint
from swarm.modeling.families import FamilySpec, family_for
from swarm.runtime import aio, malloc
from swarm.runtime.taskpool import PRIORITY_DECODE, PRIORITY_FORWARD, client_pool
from swarm.wire.dtypes import parse_dtype
from swarm.wire.records import dht_prefix_for

logger = logging.getLogger(__name__)

# embeddings of fewer elements than this run in the caller's thread: below torch's parallel grain size (32768),
# the lookup is serial and starts no OpenMP team there (`swarm.runtime.threads`)
SMALL_EMBED_ELEMENTS = 32768

T = TypeVar("T")


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [batch, seq, vocab]
    hidden_states: Optional[torch.Tensor] = None  # [batch, seq, hidden] after the final norm


class ModelSession:
    """An inference session plus the token ids `[batch, n]` whose states the servers hold."""

    def __init__(self, model: "DistributedModelForCausalLM", max_length: int, adapter: Optional[str] = None):
        self.model = model
        self.session = InferenceSession(model.manager, max_length, adapter=adapter)
        self.token_ids: Optional[torch.Tensor] = None

    @property
    def max_length(self) -> int:
        return self.session.max_length

    @property
    def position(self) -> int:
        return self.session.position

    def reusable_prefix(self, input_ids: torch.Tensor) -> int:
        """How many leading tokens of `input_ids` the servers already hold (at most len - 1: the last token
        is always sent again, as its logits are needed)."""
        if self.token_ids is None or self.token_ids.shape[0] != input_ids.shape[0]:
            return 0
        n = min(self.token_ids.shape[1], input_ids.shape[1] - 1)
        if n <= 0:
            return 0
        same = (self.token_ids[:, :n] == input_ids[:, :n]).all(dim=0)
        mismatch = (~same).nonzero()
        return int(mismatch[0]) if len(mismatch) else n

    def open(self, batch_size: int = 1) -> "ModelSession":
        """Route and open the servers' sessions now (else the first `feed` does it); errors surface here."""
        self.session.open(batch_size)
        return self

    def feed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Make the servers hold exactly `input_ids` [batch, n]; returns the last position's logits [batch, vocab].

        The LM head runs on the process's compute thread (`swarm.runtime.taskpool.client_pool`): the heads of concurrent
        sessions' steps become one pass there. So does the embedding, unless it is a few rows (a decode step:
        a lookup too small to be worth a hand-over)."""
        return self._feed(input_ids, None)[0]

    def feed_and_pick(self, input_ids: torch.Tensor, pick: Callable[[torch.Tensor], T]) -> Tuple[torch.Tensor, T]:
        """`feed`, then `pick(logits)` (the next tokens [batch], or the gateway's per-row choices) in the same
        compute-thread task as the LM head: returns (logits [batch, vocab], what pick returned)."""
        return self._feed(input_ids, pick)

    def _feed(self, input_ids: torch.Tensor, pick) -> Tuple[torch.Tensor, Any]:
        reuse = self.reusable_prefix(input_ids)
        if reuse < self.session.position:
            self.session.rewind(reuse)
        new_ids = input_ids[:, reuse:]
        pool = client_pool()
        if new_ids.numel() * self.model.config.hidden_size < SMALL_EMBED_ELEMENTS:
            hidden = self.model.embed(new_ids)  # [batch, n, hidden]: serial kernels, no OpenMP team here
        else:
            hidden = pool.call(PRIORITY_DECODE, self.model.embed, new_ids)
        try:
            out = self.session.step(hidden)
        finally:  # what the servers hold (less after a failure or `OutputsRetracted`)
            self.token_ids = input_ids[:, :self.session.position].clone()
        logits, picked = pool.call_batchable(PRIORITY_DECODE, ("head", id(self.model)), self.model.head_rows,
                                             (out[:, -1], pick), source=id(self))
        if isinstance(picked, BaseException):  # this session's own error (say, a user's logits processor)
            raise picked
        return logits, picked

    def close(self) -> None:
        self.session.close()
        client_pool().gatherer.forget(id(self))  # concurrent sessions' heads stop waiting for this one

    def __enter__(self) -> "ModelSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DistributedModelForCausalLM(AdapterChoice, nn.Module):
    def __init__(self, config, family: FamilySpec, manager: SwarmManager, embed_tokens: nn.Embedding,
                 norm: nn.Module, lm_head: nn.Linear, generation_config: GenerationConfig):
        super().__init__()
        self.config, self.family, self.manager = config, family, manager
        self.embed_tokens, self.norm, self.lm_head = embed_tokens, norm, lm_head
        self.generation_config = generation_config
        self.row_padding: Optional[RowPadding] = None  # set by from_pretrained(pad_head_rows=True)
        self.name_or_path: str = ""  # set by from_pretrained

    # ---- loading ------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str, *, torch_dtype: Union[str, torch.dtype] = torch.float32,
                        cache_dir: Optional[str] = None, dht=None, device: Union[str, torch.device] = "cpu",
                        pad_head_rows: bool = True, active_adapter: Optional[str] = None,
                        **client_kwargs) -> "DistributedModelForCausalLM":
        """`pad_head_rows`: on the CPU, run concurrent sessions' LM heads padded to the row count measured fastest
        (`swarm.client.rowpad`: about 10% more aggregate tokens/s with 8 sessions here, for ~0.5 s at load and a few
        MB). `active_adapter`: the LoRA adapter (served by the swarm) to generate with; None: the base model."""
        client_config = ClientConfig(**client_kwargs)
        checkpoint = Checkpoint(name_or_path, cache_dir=cache_dir)
        config = checkpoint.load_config()
        family = family_for(config)
        dtype = parse_dtype(torch_dtype) if isinstance(torch_dtype, str) else torch_dtype
        head_key = family.head_key
        wanted = {family.embed_key, head_key, family.norm_key + "weight", family.norm_key + "bias"}
        tensors = checkpoint.load_tensors(lambda name: name in wanted, dtype)
        if family.embed_key not in tensors:
            raise ValueError(f"{name_or_path}: no {family.embed_key} in the checkpoint")
        # the checkpoint's tensors as they are: no randomly initialised copies (113 MB each for SmolLM2) first
        embed = nn.Embedding.from_pretrained(tensors[family.embed_key], freeze=True)
        norm_cls = family.import_class(family.norm_class)
        norm = norm_cls(config.hidden_size, eps=getattr(config, "rms_norm_eps", 1e-6)).to(dtype)
        norm.load_state_dict({k[len(family.norm_key):]: v for k, v in tensors.items()
                              if k.startswith(family.norm_key)})
        lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device="meta")
        if head_key in tensors and not getattr(config, "tie_word_embeddings", False):
            lm_head.weight = nn.Parameter(tensors[head_key], requires_grad=False)
        else:
            lm_head.weight = embed.weight  # tied
        try:
            generation_config = GenerationConfig.from_pretrained(checkpoint.config_dir, cache_dir=cache_dir)
        except (OSError, ValueError):
            generation_config = GenerationConfig.from_model_config(config)
        prefix = client_config.dht_prefix or dht_prefix_for(name_or_path)
        manager = SwarmManager(client_config, prefix, config.num_hidden_layers, dht=dht)
        model = cls(config, family, manager, embed, norm, lm_head, generation_config).to(device).eval()
        model.requires_grad_(False)
        model.name_or_path = name_or_path
        model.active_adapter = active_adapter
        if pad_head_rows:
            model.row_padding = RowPadding()
            model.row_padding.calibrate(model.lm_head.weight, model.lm_head.bias)  # CPU only: which batches to pad
            malloc.trim()  # what the timing runs freed
        return model

    # ---- pieces -------------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        """Where the embeddings, norm and head run (`from_pretrained(device=...)`); token ids and logits stay on
        the CPU, hidden states cross to the servers from either."""
        return self.embed_tokens.weight.device

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids.to(self.device))  # [batch, seq] -> [batch, seq, hidden]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[batch, seq, hidden] (or [rows, hidden]) from the last block -> logits [batch, seq, vocab] (or [rows,
        vocab]), float32, on the CPU. Rows of concurrent sessions may be padded to the count the BLAS runs
        fastest (`swarm.client.rowpad`)."""
        normed = self.norm(hidden.to(self.device, self.dtype))
        if self.row_padding is not None and normed.ndim == 2:
            return self.row_padding.linear(normed, self.lm_head.weight, self.lm_head.bias).float().cpu()
        return self.lm_head(normed).float().cpu()

    def head_rows(self, items: list) -> list:
        """LM head for several sessions' last states in one pass, then each session's token choice.

        items: (last states [b_i, hidden], pick or None) each; returns (logits [b_i, vocab], pick(logits) or
        None) each."""
        rows = [x for x, _ in items]
        with torch.no_grad():
            logits = self.head(torch.cat(rows) if len(rows) > 1 else rows[0])  # [sum b_i, vocab]
        parts = torch.split(logits, [x.shape[0] for x in rows])
        return [(part, _try(pick, part)) for part, (_, pick) in zip(parts, items)]

    def inference_session(self, max_length: int, adapter: Any = ACTIVE_ADAPTER) -> ModelSession:
        """A session of up to `max_length` tokens with LoRA `adapter` (default: `active_adapter`; None: the base)."""
        return ModelSession(self, max_length, adapter=self._adapter(adapter))

    # ---- the swarm, as a front end sees it (swarm.client.api.ClientModel) ---------------------------------
    def check_route(self, cache_tokens: int = 0, adapter: Any = ACTIVE_ADAPTER) -> None:
        """Raise `RoutingError` unless a chain over every block with cache for `cache_tokens` can be routed now."""
        self.manager.make_inference_chain(0, None, cache_tokens_needed=cache_tokens, adapter=self._adapter(adapter))

    def coverage(self, force: bool = False) -> Coverage:
        """Blocks served by servers of an allowed quant type, and every online server seen with its format."""
        spans = self.manager.update(force=force)
        allowed_types = self.manager.config.allowed_quant_types
        views = tuple(ServerView(s.peer_id, s.start, s.end, s.info.quant_type, quant_allowed(s, allowed_types))
                      for s in spans)
        covered: set[int] = set()
        for view in views:
            if view.allowed:
                covered.update(range(view.start, view.end))
        num_blocks = self.manager.num_blocks
        return Coverage([i for i in range(num_blocks) if i not in covered], num_blocks,
                        sum(view.allowed for view in views), views,
                        None if allowed_types is None else tuple(allowed_types))

    def banned_peers(self) -> List[str]:
        """Servers this client avoids for now, after they failed."""
        return list(self.manager.banned())

    def unban(self, peer_id: str) -> None:
        self.manager.mark_ok(peer_id)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                adapter: Any = ACTIVE_ADAPTER) -> CausalLMOutput:
        """Logits for every position of `input_ids` [batch, seq] through the swarm (no cache), with `adapter`."""
        _reject_padding(attention_mask)
        pool = client_pool()
        hidden = pool.call(PRIORITY_FORWARD, self.embed, input_ids)
        hidden = aio.run(self._forward_chain(hidden, self._adapter(adapter)))
        normed = pool.call(PRIORITY_FORWARD, torch.no_grad()(lambda: self.norm(hidden.to(self.device, self.dtype))))
        logits = pool.call(PRIORITY_FORWARD, torch.no_grad()(lambda: self.lm_head(normed).float().cpu()))
        return CausalLMOutput(logits=logits, hidden_states=normed.cpu())

    def prompt_logprobs(self, input_ids: Sequence[int], top_k: int, adapter: Any = ACTIVE_ADAPTER
                        ) -> List[PromptLogprob]:
        """Each prompt token after the first scored given the tokens before it: log_softmax of the float32 logits of
        one forward pass (`forward`, no cache) over all but the last token; with the `top_k` best tokens there."""
        ids = torch.tensor([list(input_ids)], dtype=torch.long)
        if ids.shape[1] < 2:
            return []
        logits = self.forward(ids[:, :-1], adapter=adapter).logits[0]  # [n - 1, vocab], float32 on the CPU
        targets = ids[0, 1:]

        @torch.no_grad()
        def score() -> List[PromptLogprob]:
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
            if top_k > 0:
                values, indices = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
                tops = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
            else:
                tops = [[] for _ in chosen]
            return [PromptLogprob(int(t), lp, top) for t, lp, top in zip(targets.tolist(), chosen, tops)]

        return client_pool().call(PRIORITY_FORWARD, score)

    async def _forward_chain(self, hidden: torch.Tensor, adapter: Optional[str] = None) -> torch.Tensor:
        import asyncio

        last_error: Optional[BaseException] = None
        for _ in range(self.manager.config.max_retries + 1):
            hops = await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(self.manager.make_forward_chain, adapter=adapter))
            x = hidden
            try:
                for hop in hops:
                    x = await self.manager.forward(hop, x, adapter)
                return x
            except Exception as e:  # a failed server: ban it and route again
                last_error = e
                self.manager.ban(hop.peer_id)
        raise SessionError(f"forward pass failed after {self.manager.config.max_retries + 1} tries: {last_error}")

    # ---- generation ---------------------------------------------------------------------------------------
    def _generation_config(self, generation_config: Optional[GenerationConfig], kwargs: dict) -> GenerationConfig:
        config = copy.deepcopy(generation_config or self.generation_config)
        # as transformers: unset fields come from the model's config, then from transformers' global defaults (say,
        # top_k=50 when sampling)
        config.update(**self.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
        defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
        if defaults is not None:
            config.update(**defaults(), defaults_only=True)
        unused = config.update(**kwargs)
        if unused:
            raise TypeError(f"generate() got unexpected arguments: {sorted(unused)}")
        config.validate()  # transformers' own checks (say, greedy with num_return_sequences > 1)
        return config

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, *, session: Optional[ModelSession] = None,
                 attention_mask: Optional[torch.Tensor] = None, generation_config: Optional[GenerationConfig] = None,
                 logits_processor: Optional[LogitsProcessorList] = None,
                 stopping_criteria: Optional[StoppingCriteriaList] = None, streamer=None, tokenizer=None,
                 **kwargs) -> Union[torch.Tensor, GenerateDecoderOnlyOutput]:
        """Like `transformers` generate: returns [batch * num_return_sequences, prompt + new] token ids, or with
        `return_dict_in_generate=True` a `GenerateDecoderOnlyOutput` (`sequences`, and `scores` / `logits` when
        `output_scores` / `output_logits`; no `past_key_values`: the cache lives on the servers). Every setting of
        the `GenerationConfig` is applied or is an error naming it. `stop_strings` need `tokenizer=`."""
        if input_ids is None or input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError("input_ids must be a non-empty [batch, seq] tensor")
        _reject_padding(attention_mask)
        config = self._generation_config(generation_config, kwargs)
        if config.num_beams not in (None, 1):
            raise NotImplementedError("beam search is not supported yet; use num_beams=1")
        if config.num_return_sequences not in (None, 1):  # validate() rejected it without sampling, as transformers
            input_ids = input_ids.repeat_interleave(int(config.num_return_sequences), dim=0)
        prompt_len = input_ids.shape[1]
        max_new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt_len
        params = SamplingParams.from_generation_config(config, max(max_new, 0))
        processors = build_processors(params, prompt_len, custom=logits_processor)
        criteria = self._stopping_criteria(config, stopping_criteria, tokenizer)
        want_scores, want_logits = bool(config.output_scores), bool(config.output_logits)
        as_dict = bool(config.return_dict_in_generate)
        scores: List[torch.Tensor] = []
        raw_logits: List[torch.Tensor] = []

        def result(ids: torch.Tensor) -> Union[torch.Tensor, GenerateDecoderOnlyOutput]:
            if not as_dict:
                return ids
            return GenerateDecoderOnlyOutput(sequences=cast(torch.LongTensor, ids),
                                             scores=cast(Any, tuple(scores)) if want_scores else None,
                                             logits=cast(Any, tuple(raw_logits)) if want_logits else None)

        if max_new <= 0:
            return result(input_ids)
        eos = config.eos_token_id
        eos_ids = torch.tensor([eos] if isinstance(eos, int) else (eos or []), dtype=torch.long)
        pad = config.pad_token_id if config.pad_token_id is not None else (int(eos_ids[0]) if len(eos_ids) else 0)

        own_session = session is None
        if session is None:
            session = self.inference_session(max_length=prompt_len + max_new)
        elif prompt_len + max_new - 1 > session.max_length:
            raise SessionError(f"prompt ({prompt_len}) + max_new_tokens ({max_new}) exceeds the session's max_length "
                               f"{session.max_length}")
        if streamer is not None:
            streamer.put(input_ids.cpu())
        ids, finished = input_ids, torch.zeros(input_ids.shape[0], dtype=torch.bool)
        try:
            while ids.shape[1] < prompt_len + max_new:
                # logits [batch, vocab], next tokens [batch], processed scores [batch, vocab]: on the head's thread
                try:
                    logits, (next_tokens, step_scores) = session.feed_and_pick(
                        ids, functools.partial(process_and_pick_scores, processors, ids, greedy=params.greedy))
                except OutputsRetracted as retracted:  # a lying server was caught: pick its tokens again
                    ids, finished = retracted.retract(ids, prompt_len, eos_ids, scores, raw_logits)
                    continue
                if want_scores:
                    scores.append(step_scores)
                if want_logits:
                    raw_logits.append(logits.float())
                next_tokens = torch.where(finished, torch.full_like(next_tokens, pad), next_tokens)
                ids = torch.cat([ids, next_tokens[:, None]], dim=1)
                if streamer is not None:
                    streamer.put(next_tokens.cpu())
                if len(eos_ids):
                    finished |= torch.isin(next_tokens, eos_ids)
                if len(criteria):
                    finished |= criteria(cast(torch.LongTensor, ids), step_scores).to(finished.device)
                if finished.all():
                    break
        finally:
            if streamer is not None:
                streamer.end()
            if own_session:
                session.close()
        return result(ids)

    @staticmethod
    def _stopping_criteria(config: GenerationConfig, custom: Optional[StoppingCriteriaList],
                           tokenizer) -> StoppingCriteriaList:
        """transformers' stopping criteria for `max_time` and `stop_strings` (max length and end-of-sequence tokens
        are the loop's own), merged with a user's `stopping_criteria` as transformers merges them."""
        criteria = StoppingCriteriaList()
        if config.max_time is not None:
            criteria.append(MaxTimeCriteria(max_time=config.max_time))
        if config.stop_strings is not None:
            if tokenizer is None:
                raise ValueError("generate(): `stop_strings` needs the model's tokenizer: pass `tokenizer=` to "
                                 "generate")
            criteria.append(StopStringCriteria(stop_strings=config.stop_strings, tokenizer=tokenizer))
        for extra in custom or []:
            same = [i for i, c in enumerate(criteria) if type(c) is type(extra)]
            if same:
                criteria[same[0]] = extra
            else:
                criteria.append(extra)
        return criteria

    def shutdown(self) -> None:
        self.manager.shutdown()


def _try(pick, logits: torch.Tensor):
    """pick(logits), its error as the result (one session's failure must not fail the batch), or None."""
    if pick is None:
        return None
    try:
        return pick(logits)
    except Exception as e:
        return e


def _reject_padding(attention_mask: Optional[torch.Tensor]) -> None:
    if attention_mask is not None and not bool(attention_mask.all()):
        raise NotImplementedError("padded batches are not supported: send sequences of equal length")


class AutoDistributedModelForCausalLM:
    """Picks the client model for a checkpoint's family (all supported families share one class today)."""

    @staticmethod
    def from_pretrained(name_or_path: str, **kwargs) -> DistributedModelForCausalLM:
        return DistributedModelForCausalLM.from_pretrained(name_or_path, **kwargs)
