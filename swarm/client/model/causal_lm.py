"""The Hugging Face-style client model: local embeddings, final norm and LM head; remote blocks.

`AutoDistributedModelForCausalLM.from_pretrained(name_or_path, initial_peers=[...])` reads only the embedding
(and its norm, where the family has one: BLOOM), final norm and LM head tensors of the checkpoint; the transformer
blocks run on the swarm (other keyword arguments are `ClientConfig` settings, e.g.
`allowed_quant_types=["none", "int8"]`: route only through servers of those weight formats; default: any).
`model(input_ids)` returns logits through plain forward passes. `model.inference_session(max_length=N)` opens a
`ModelSession` that remembers which tokens the servers' caches hold, so `model.generate(..., session=s)` across
several calls (a multi-turn chat) sends only new tokens, rewinding the servers when the new input diverges from
what they hold. Generation uses Hugging Face `GenerationConfig` and picks tokens through
`swarm.client.decoding.sampling` (the gateway's path too: Hugging Face logits processors, greedy or sampling) and
accepts a `streamer`; `num_beams > 1` runs transformers' beam search with the servers' caches reordered in place
(`swarm.client.decoding.beam`). Batches of prompts of different lengths are left-padded with an `attention_mask`
(`swarm.client.decoding.rows`). The model implements `swarm.client.api.ClientModel` (route check, coverage, bans,
sessions) for the gateway. Lifecycle: `with ... from_pretrained(...) as model:` or `model.close()` (`shutdown()`, the
older name) stops the model's DHT process and p2p daemon; a model dropped without either releases them when it is
garbage-collected (`weakref.finalize`).
LoRA adapters: `active_adapter`, or one per session (`swarm.client.model.adapters`).
"""
from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Union, cast

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from swarm.client.api import Coverage, PromptLogprob, ServerView
from swarm.client.decoding.hf_decoding import generate as hf_generate
from swarm.client.decoding.rows import left_padding
from swarm.client.model import ptune as tuning
from swarm.client.model.adapters import ACTIVE_ADAPTER, AdapterChoice
from swarm.client.model.head import ClientHead
from swarm.client.model.model_session import ModelSession
from swarm.client.transport.manager import ClientConfig, SwarmManager, needs_for
from swarm.client.transport.remote_autograd import RemoteBlocks
from swarm.client.transport.routing import RoutingError, quant_allowed
from swarm.client.transport.session import SessionError
from swarm.client.transport.status import SwarmStatusView
from swarm.client.transport.verify import VerifyStats, verifier_for
from swarm.modeling.checkpoint import Checkpoint
from swarm.modeling.families import FamilySpec, family_for
from swarm.modeling.layers import picks_by_length
from swarm.modeling.smallgemm import GemmGroup
from swarm.runtime import aio, malloc
from swarm.runtime.taskpool import PRIORITY_FORWARD, client_pool
from swarm.wire.dtypes import parse_dtype
from swarm.wire.records import dht_prefix_for

if TYPE_CHECKING:  # transformers.generation.utils pulls in torch.distributed, dynamo and sympy: about 80 MB of
    # resident memory that a gateway or a client that never asks for a dict or beams should not carry
    from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput

logger = logging.getLogger(__name__)


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [batch, seq, vocab]
    hidden_states: Optional[torch.Tensor] = None  # [batch, seq, hidden] after the final norm


class DistributedModelForCausalLM(AdapterChoice, SwarmStatusView, nn.Module):
    def __init__(self, config, family: FamilySpec, manager: SwarmManager, embed_tokens: nn.Embedding,
                 norm: nn.Module, lm_head: nn.Linear, generation_config: GenerationConfig,
                 embed_norm: Optional[nn.Module] = None):
        super().__init__()
        self.config, self.family, self.manager = config, family, manager
        self.embed_tokens, self.norm, self.lm_head = embed_tokens, norm, lm_head
        self.embed_norm = embed_norm  # the family's norm of the embeddings (BLOOM's word_embeddings_layernorm)
        self.generation_config = generation_config
        # the local layers as a session uses them (the same modules, not copies)
        self.local = ClientHead(embed_tokens, norm, lm_head, int(config.hidden_size), embed_norm)
        self.name_or_path: str = ""  # set by from_pretrained
        self.ptune: Optional[tuning.PromptTuning] = None  # from_pretrained(tuning_mode=..., pre_seq_len=...)
        self.remote_blocks: Optional[RemoteBlocks] = None  # the differentiable blocks, made on first use
        self.last_speculation: Any = None  # the last speculative generate's `DraftLength` (acceptance counts)
        # a model dropped without close() still releases its DHT process and p2pd when it is collected; the
        # finalizer holds the manager, never the model (at exit the DHT process's own atexit stops it)
        self._finalizer = weakref.finalize(self, SwarmManager.shutdown, manager)
        self._finalizer.atexit = False

    # ---- loading ------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str, *, torch_dtype: Union[str, torch.dtype] = torch.float32,
                        cache_dir: Optional[str] = None, dht=None, device: Union[str, torch.device] = "cpu",
                        pad_head_rows: bool = True, head_packed_rows: Sequence[int] = (),
                        active_adapter: Optional[str] = None,
                        tuning_mode: Optional[str] = None, pre_seq_len: int = 0,
                        revision: Optional[str] = None, token: Optional[str] = None,
                        **client_kwargs) -> "DistributedModelForCausalLM":
        """`tuning_mode` "ptune" / "deep_ptune" with `pre_seq_len`: trainable soft prompts (`swarm.client.model.ptune`).
        `pad_head_rows`: with a float32 head on the CPU, run concurrent sessions' LM heads padded to the row count
        measured fastest (`swarm.modeling.smallgemm`: about 10% more aggregate tokens/s with 8 sessions here, for
        ~0.5 s at load and a few MB); `head_packed_rows`: row counts to pack the head's weight for there (MKL's packed
        GEMM: one more copy of the head each, faster than padding). `active_adapter`: the LoRA adapter (served by
        the swarm) to generate with; None: the base model. `revision`, `token`: a hub model's branch / tag / commit
        and access token (default: main, and huggingface_hub's own token: HF_TOKEN or the stored login). A checkpoint
        published quantized (MXFP4, block-scaled FP8) loads its embeddings and head dequantized
        (`swarm.modeling.checkpoint_quant`)."""
        client_config = ClientConfig(**client_kwargs)
        checkpoint = Checkpoint(name_or_path, cache_dir=cache_dir, revision=revision, token=token)
        config = checkpoint.load_config()
        family = family_for(config)
        checkpoint.expect_prefix(family.base_prefix)
        dtype = parse_dtype(torch_dtype) if isinstance(torch_dtype, str) else torch_dtype
        head_key = family.head_key
        norm_keys = [key for key in (family.norm_key, family.embed_norm_key) if key]
        wanted = {family.embed_key, head_key, *(key + part for key in norm_keys for part in ("weight", "bias"))}
        tensors = checkpoint.load_tensors(lambda name: name in wanted, dtype)
        if family.embed_key not in tensors:
            raise ValueError(f"{name_or_path}: no {family.embed_key} in the checkpoint")
        # the checkpoint's tensors as they are: no randomly initialised copies (113 MB each for SmolLM2) first
        embed = nn.Embedding.from_pretrained(tensors[family.embed_key], freeze=True)
        norm = family.load_norm(config, family.norm_key, tensors).to(dtype)
        embed_norm = None  # BLOOM's word_embeddings_layernorm
        if family.embed_norm_key is not None:
            embed_norm = family.load_norm(config, family.embed_norm_key, tensors).to(dtype)
        lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device="meta")
        if head_key in tensors and not getattr(config, "tie_word_embeddings", False):
            lm_head.weight = nn.Parameter(tensors[head_key], requires_grad=False)
        else:
            lm_head.weight = embed.weight  # tied
        if family.client_parts is not None:  # (Gemma's embedding scale and final soft-cap)
            embed, lm_head = family.client_parts(config, embed, lm_head)
        try:
            generation_config = GenerationConfig.from_pretrained(checkpoint.config_dir, cache_dir=cache_dir,
                                                                 revision=revision or "main", token=token)
        except (OSError, ValueError):
            generation_config = GenerationConfig.from_model_config(config)
        prefix = client_config.dht_prefix or dht_prefix_for(name_or_path)
        manager = SwarmManager(client_config, prefix, config.num_hidden_layers, dht=dht)
        model = cls(config, family, manager, embed, norm, lm_head, generation_config, embed_norm).to(device).eval()
        model.requires_grad_(False)
        model.name_or_path = name_or_path
        model.active_adapter = active_adapter
        if tuning_mode is not None:
            model.ptune = tuning.make_prompt_tuning(model, tuning_mode, pre_seq_len)
        weight = model.lm_head.weight
        if (pad_head_rows or head_packed_rows) and weight.device.type == "cpu" and weight.dtype == torch.float32 \
                and family.client_parts is None:  # (a family's own head computes more than the product)
            group = GemmGroup(head_packed_rows)  # the head runs on the client's one compute thread
            model.local.gemm = group.gemm(weight.detach(), None if model.lm_head.bias is None
                                         else model.lm_head.bias.detach())
            if pad_head_rows:
                group.calibrate()  # which row counts (no pack takes) run faster padded
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

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[batch, seq] -> [batch, seq, hidden] (`swarm.client.model.head.ClientHead.embed`)."""
        return self.local.embed(input_ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[batch, seq, hidden] -> logits [batch, seq, vocab], float32 on the CPU (`ClientHead.head`)."""
        return self.local.head(hidden)

    def inference_session(self, max_length: int, adapter: Any = ACTIVE_ADAPTER) -> ModelSession:
        """A session of up to `max_length` tokens with LoRA `adapter` (default: `active_adapter`; None: the base)."""
        recompute = self.family.recompute_cache
        return ModelSession(self.local, self.manager, max_length,
                            adapter=self._adapter(adapter), ptune=self.ptune,
                            recompute=None if recompute is None else functools.partial(recompute, self.config),
                            rope_lengths=picks_by_length(self.config))

    # ---- the swarm, as a front end sees it (swarm.client.api.ClientModel) ---------------------------------
    def check_route(self, cache_tokens: int = 0, adapter: Any = ACTIVE_ADAPTER) -> None:
        """Raise `RoutingError` unless a chain over every block with cache for `cache_tokens` can be routed now, or
        soon: when blocks whose only servers could not be reached wait for them to be tried again, a session waits
        for them (`SwarmManager.sole_retry_wait`), so this passes. Only servers with what this model's sessions need
        count (LongRoPE's `rope_length`: `InferenceSession.needs`)."""
        try:
            self.manager.make_inference_chain(0, None, cache_tokens_needed=cache_tokens,
                                              adapter=self._adapter(adapter),
                                              needs=needs_for(rope_length=picks_by_length(self.config)))
        except RoutingError:
            if self.manager.sole_retry_wait() is None:
                raise

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

    def observe_routes(self, observer) -> None:
        """`observer(timing)` for each inference chain built (`swarm.client.transport.manager.RouteTiming`)."""
        self.manager.on_route = observer

    def verify_stats(self) -> Optional[VerifyStats]:
        """The spot-checks' counters and the distrusted servers (`swarm.client.transport.verify`); None when
        verification is off."""
        verifier = verifier_for(self.manager)
        return None if verifier is None else verifier.stats

    def forward(self, input_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                inputs_embeds: Optional[torch.Tensor] = None, adapter: Any = ACTIVE_ADAPTER) -> CausalLMOutput:
        """Logits for every position of `input_ids` [batch, seq] (or `inputs_embeds` [batch, seq, hidden]) through
        the swarm (no cache), with LoRA `adapter`. `attention_mask` (left padding): padding keys are never attended;
        positions are not shifted, as in transformers' forward without `position_ids`. Differentiable
        (`swarm.client.model.ptune.trainable_forward`, no padding; through the adapter's frozen deltas) when prompts,
        trainable modules or inputs that require grad are involved, so that `loss.backward()` works."""
        if tuning.needs_autograd(self, inputs_embeds):
            if attention_mask is not None and not bool(attention_mask.all()):
                raise ValueError("training passes do not take padded batches (attention_mask with zeros)")
            return CausalLMOutput(*tuning.trainable_forward(self, input_ids, inputs_embeds, self._adapter(adapter)))
        if input_ids is None:
            raise ValueError("input_ids are needed (inputs_embeds only for differentiable passes)")
        padding = left_padding(attention_mask, input_ids)
        pool = client_pool()
        hidden = pool.call(PRIORITY_FORWARD, self.embed, input_ids)
        hidden = aio.run(self._forward_chain(hidden, self._adapter(adapter), padding))
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

    async def _forward_chain(self, hidden: torch.Tensor, adapter: Optional[str] = None,
                             padding: Optional[List[int]] = None) -> torch.Tensor:
        import asyncio

        last_error: Optional[BaseException] = None
        loop, tries = asyncio.get_running_loop(), 0
        while tries <= self.manager.config.max_retries:
            hops = await loop.run_in_executor(
                None, functools.partial(self.manager.make_forward_chain, adapter=adapter,
                                        needs=needs_for(left_padding=padding is not None)))
            x = hidden
            try:
                for hop in hops:
                    x = await self.manager.forward(hop, x, adapter, padding)
                return x
            except Exception as e:  # a failed server is banned and the pass routed again; one that left is not
                last_error = e  # banned and costs no try (`SwarmManager.settle_failures`)
                if hop.peer_id not in await loop.run_in_executor(None, self.manager.settle_failures,
                                                                 [(hop.peer_id, None)]):
                    tries += 1
        raise SessionError(f"forward pass failed after {tries} tries: {last_error}")

    # ---- generation ---------------------------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor, *, session: Optional[ModelSession] = None,
                 attention_mask: Optional[torch.Tensor] = None, generation_config: Optional[GenerationConfig] = None,
                 logits_processor: Optional[LogitsProcessorList] = None,
                 stopping_criteria: Optional[StoppingCriteriaList] = None, streamer=None, tokenizer=None,
                 **kwargs) -> Union[torch.Tensor, GenerateDecoderOnlyOutput, GenerateBeamDecoderOnlyOutput]:
        """Like `transformers` generate: returns [batch * num_return_sequences, prompt + new] token ids, or with
        `return_dict_in_generate=True` a `GenerateDecoderOnlyOutput` (`sequences`, and `scores` / `logits` when
        `output_scores` / `output_logits`; no `past_key_values`: the cache lives on the servers), with
        `num_beams > 1` transformers' beam search (`swarm.client.decoding.beam`, a `GenerateBeamDecoderOnlyOutput`).
        Every setting of the `GenerationConfig` is applied or is an error naming it. `stop_strings` need `tokenizer=`.
        `attention_mask` [batch, seq]: prompts of different lengths, left-padded. `speculative="ngram"` /
        `"draft_model"` (with `draft_model=` a local checkpoint) or a `SpeculativeConfig`, `num_draft_tokens=k`
        (or transformers' `prompt_lookup_num_tokens=k`: n-gram drafts): speculative decoding
        (`swarm.client.decoding.speculative`; one row without padding, no beams: other calls decode plainly)."""
        if input_ids is not None and input_ids.device.type != "cpu":
            # the decode loop keeps token ids on the host (its picks and the sessions' histories are there); the
            # sequences go back to the caller's device, as transformers' generate returns them
            out = self.generate(input_ids.cpu(), session=session, attention_mask=attention_mask,
                                generation_config=generation_config, logits_processor=logits_processor,
                                stopping_criteria=stopping_criteria, streamer=streamer, tokenizer=tokenizer, **kwargs)
            if isinstance(out, torch.Tensor):
                return out.to(input_ids.device)
            out.sequences = cast(torch.LongTensor, out.sequences.to(input_ids.device))
            return out
        return hf_generate(self, input_ids, session=session, attention_mask=attention_mask,
                           generation_config=generation_config, logits_processor=logits_processor,
                           stopping_criteria=stopping_criteria, streamer=streamer, tokenizer=tokenizer, **kwargs)

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop this model's DHT process and p2p daemon (the swarm's servers keep running). Once: later calls, and
        the finalizer, do nothing. `with from_pretrained(...) as model:` calls it at the block's end; a model
        dropped without it is closed when it is garbage-collected."""
        self._finalizer()

    shutdown = close  # the older name

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "DistributedModelForCausalLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AutoDistributedModelForCausalLM:
    """Picks the client model for a checkpoint's family (all supported families share one class today)."""

    @staticmethod
    def from_pretrained(name_or_path: str, **kwargs) -> DistributedModelForCausalLM:
        return DistributedModelForCausalLM.from_pretrained(name_or_path, **kwargs)
