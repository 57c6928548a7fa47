"""The gateway's settings: one typed model filled from CLI flags, a YAML file and `SWARMGATE_*` variables.

`GatewayConfig` follows the pattern of `server.server.ServerConfig`: `swarm.runtime.config.build_parser` turns it
into the `swarmgate gateway MODEL ...` command line and `swarm.runtime.config.load_config` merges the sources
(CLI > YAML `--config` > environment > defaults). See `configs/gateway.yaml` for a documented example.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, List, Literal, Optional, Tuple

from pydantic import Field, PrivateAttr, field_validator, model_validator

from swarm.client.api import MAX_DRAFT_TOKENS, normalize_quant_types
from swarm.modeling.smallgemm import valid_packed_rows
from swarm.runtime.aio import parse_event_loop
from swarm.runtime.config import parse_device
from swarm.runtime.swarm_key import SwarmKeySettings
from swarm.wire.compression import COMPRESSION_HELP, Compression
from swarm.wire.dtypes import QUANT_TYPES, parse_dtype


class GatewayConfig(SwarmKeySettings):
    model: List[str] = Field(
        description="model(s) served by the swarm: bundled name, local checkpoint directory or hub id; several "
                    "(MODEL --model OTHER --model ..., a YAML list, SWARMGATE_MODEL=a,b) make one gateway serve each, "
                    "requests choosing by their `model` field; `all`: every model the swarm's servers announce, "
                    "found at start")
    revision: Optional[str] = Field(default=None, description="a hub model's branch, tag or commit (default: main)")
    token: Optional[str] = Field(default=None, description="a gated or private hub model's access token (default: "
                                                           "huggingface_hub's own, HF_TOKEN or the stored login)")
    initial_peers: List[str] = Field(default_factory=list, description="multiaddrs of DHT peers of the swarm")
    dht_prefix: Optional[str] = Field(default=None, description="DHT key prefix (default: from the model name; one "
                                                                "model only)")
    host: str = Field(default="127.0.0.1", description="address the HTTP server listens on")
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port (0: any free port)")
    served_model_name: Optional[str] = Field(
        default=None, description="model id clients send and /v1/models lists (default: the model's name; one model "
                                  "only)")
    api_keys: List[str] = Field(default_factory=list,
                                description="accepted bearer keys (any of them; empty, with no --api_key_file: no "
                                            "authentication)")
    api_key_file: Optional[str] = Field(
        default=None, description="file of accepted bearer keys, one a line ('#' starts a comment), added to "
                                  "--api_keys (keeps keys off the command line)")
    database_url: Optional[str] = Field(
        default=None, description="the state store (stored responses, API keys of `swarmgate keys`, usage, rate-limit "
                                  "windows): sqlite:///PATH (default: gateway.sqlite3 under the cache directory, "
                                  "~/.cache/swarmgate; safe for several gateways of one machine) or "
                                  "redis://HOST:PORT/DB (gateways on several machines)")
    protect_probes: bool = Field(
        default=False, description="require an API key for /health and /metrics too (default: they stay public, "
                                   "for load balancers and Prometheus)")
    max_concurrent: int = Field(default=32, gt=0,
                                description="generations running at once (each holds a session in the swarm)")
    max_queue: int = Field(default=64, ge=0, description="requests waiting for a slot before 429 is returned")
    queue_timeout: float = Field(default=120.0, gt=0, description="seconds a request may wait for a slot (then 503)")
    retry_after: int = Field(default=2, ge=0, description="Retry-After seconds sent with 429")
    generation_timeout: float = Field(default=600.0, gt=0, description="seconds one request may generate")
    step_timeout: float = Field(default=120.0, gt=0, description="seconds one inference step may take in the swarm")
    rpc_timeout: float = Field(default=60.0, gt=0, description="seconds for a swarm info or forward call")
    default_max_tokens: int = Field(default=512, gt=0,
                                    description="max_tokens when a request gives none (clipped to the context)")
    max_context: Optional[int] = Field(default=None, gt=0,
                                       description="context length (default: the model's max_position_embeddings)")
    max_n: int = Field(default=8, gt=0, description="largest n (choices per request)")
    sse_keepalive: float = Field(default=5.0, gt=0, description="seconds between SSE keep-alive comments")
    cors_origins: List[str] = Field(default_factory=list, description="origins allowed by CORS ('*' for any)")
    engine_round: bool = Field(
        default=True, description="decode every generation's steps together in one engine round (one LM head, one "
                                  "pick, one hand-over of events per round; gateway.serving.rounds); "
                                  "--no-engine_round: each request decodes on its own worker thread")
    push: bool = Field(
        default=True, description="servers hand decode steps (a session's, a round's rows) straight to the next server "
                                  "of the chain, k + 1 network hops for k servers instead of 2k; --no-push: the "
                                  "gateway relays every hop")
    session_pool: bool = Field(
        default=True, description="keep each conversation's inference session open between requests, so that a new "
                                  "turn sends only its new tokens (n=1 requests; --no-session_pool: a fresh session "
                                  "per request)")
    pool_max_sessions: int = Field(default=16, ge=0,
                                   description="most idle sessions kept in the pool (least recently used closed first)")
    pool_max_tokens: int = Field(
        default=8192, gt=0, description="most KV cache tokens the pooled sessions may reserve on a server, summed "
                                        "(each reserves its max_length); keep it well below the servers' cache")
    pool_ttl: float = Field(default=120.0, gt=0,
                            description="seconds an idle pooled session is kept; keep it below the servers' "
                                        "--step_timeout (300 s by default), after which they drop idle sessions")
    pool_headroom: int = Field(
        default=512, ge=0, description="tokens a pooled session reserves beyond prompt + max_tokens so that the "
                                       "next turns of the conversation fit in it (capped by the context length)")
    prefix_sharing: Literal["per_key", "global", "off"] = Field(
        default="per_key", description="which conversations may adopt the prompt prefixes the servers keep "
                                       "(server --prefix_cache): per_key, those of the same API key (the default: a "
                                       "shared cache tells, through the time to first token, which prompts others "
                                       "sent); global, all of them; off, none (prompts are not declared)")
    responses_store_max: int = Field(
        default=1000, ge=0,
        description="most responses of the Responses API kept for previous_response_id and GET /v1/responses/{id} "
                    "(`store: true`, the default) in the state store (--database_url), shared by the gateways that "
                    "use it; the oldest is dropped first (0: nothing is stored)")
    responses_store_ttl: float = Field(
        default=3600.0, gt=0, description="seconds a stored response is kept (then previous_response_id naming it is "
                                          "a 400 and GET a 404)")
    compression: Optional[Compression] = Field(default=None, description=COMPRESSION_HELP + " of this gateway's "
                                                                                           "sessions (default: each "
                                                                                           "server's --compression)")
    allowed_quant_types: Optional[List[str]] = Field(
        default=None, description=f"route only through servers announcing one of these weight formats "
                                  f"({', '.join(QUANT_TYPES)}); default: any (a mixed swarm works)")
    head_packed_rows: List[int] = Field(
        default_factory=list,
        description="concurrent streams' LM-head rows to pack the head's weight for (MKL's packed GEMM, "
                    "swarm.modeling.smallgemm; float32 on the CPU): faster heads at that many streams, each pack one "
                    "more copy of the head in memory (113 MB for SmolLM2); default none: the rows are padded where "
                    "that was timed faster")
    verify_rate: float = Field(
        default=0.0, ge=0, le=1,
        description="spot-check servers' outputs (swarm.client.transport.verify): the chance, per decode step and "
                    "per span, that "
                    "a span's outputs are re-run on an independent server and compared; every server is also checked "
                    "the first time it is used, and a server outvoted by two others is distrusted for the gateway's "
                    "life (0: off, no checks at all)")
    verify_holdback: int = Field(
        default=8, ge=1,
        description="with --verify_rate: tokens a streamed choice may run ahead of its last full check before every "
                    "span is checked; text is sent only once checked, so it never has to be taken back (the bounded "
                    "delay of a stream; a non-streamed response is checked once, at its end)")
    speculative: Literal["off", "ngram", "draft_model"] = Field(
        default="off", description="speculative decoding by default: drafts verified by the swarm in one step per "
                                   "[token + drafts] (ngram: prompt lookup; draft_model: --draft_model run on the "
                                   "gateway); requests may choose with their `speculative` field")
    draft_model: Optional[str] = Field(
        default=None, description="local checkpoint directory of a small model of the same tokenizer, for "
                                  "speculative draft_model (loaded at start)")
    num_draft_tokens: int = Field(default=4, ge=1, le=MAX_DRAFT_TOKENS,
                                  description="most tokens drafted per step (adapted to the acceptance rate below it)")
    torch_dtype: str = Field(default="float32", description="dtype of the local embeddings and LM head")
    device: str = Field(default="cpu", description="where the local embeddings, norm and LM head run (cpu, cuda, "
                                                   "cuda:N); token ids and logits stay on the CPU")
    num_threads: Optional[int] = Field(default=None, gt=0, description="torch intra-op threads")
    event_loop: str = Field(default="auto", description="the event loops of the HTTP API and of the swarm client: "
                                                        "auto (uvloop where installed), uvloop or asyncio")
    log_level: str = Field(default="INFO", description="logging level")

    @field_validator("model", mode="before")
    @classmethod
    def _model_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # one model, as YAML `model: NAME` or a single argument

    @field_validator("model")
    @classmethod
    def _valid_models(cls, value: List[str]) -> List[str]:
        if not value or any(not m.strip() for m in value):
            raise ValueError("give at least one model, none of them empty")
        if "all" in value and len(value) > 1:
            raise ValueError("'all' (every model the swarm serves) stands alone, not beside named models")
        names = [_name_of(m) for m in value]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"models named twice: {', '.join(twice)} (each model id must be distinct)")
        return value

    @model_validator(mode="after")
    def _one_model_settings(self):
        for name in ("served_model_name", "dht_prefix"):
            if (len(self.model) > 1 or self.discover) and getattr(self, name) is not None:
                raise ValueError(f"{name} names one model's id or prefix: it cannot be used with several models")
        return self

    @field_validator("speculative", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads an unquoted `off` as false

    @field_validator("torch_dtype")
    @classmethod
    def _valid_dtype(cls, value: str) -> str:
        parse_dtype(value)  # ValueError naming the choices
        return value

    @field_validator("device")
    @classmethod
    def _valid_device(cls, value: str) -> str:
        return parse_device(value)

    @field_validator("event_loop")
    @classmethod
    def _valid_event_loop(cls, value: str) -> str:
        return parse_event_loop(value)

    @field_validator("head_packed_rows")
    @classmethod
    def _valid_packed_rows(cls, value: List[int]) -> List[int]:
        return valid_packed_rows(value)

    @field_validator("allowed_quant_types", mode="before")
    @classmethod
    def _valid_quant_types(cls, value: Any) -> Optional[List[str]]:
        normalized = normalize_quant_types(value)  # ValueError naming the bad value and the choices
        return None if normalized is None else list(normalized)

    @field_validator("api_keys")
    @classmethod
    def _no_empty_keys(cls, value: List[str]) -> List[str]:
        if any(not key for key in value):
            raise ValueError("API keys must not be empty")
        return value

    _file_keys: Tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _draft_model_given(self):
        if self.speculative == "draft_model" and not self.draft_model:
            raise ValueError("speculative draft_model needs --draft_model (a local checkpoint directory)")
        return self

    @model_validator(mode="after")
    def _read_key_file(self):
        if self.api_key_file is not None:
            try:
                lines = Path(self.api_key_file).read_text().splitlines()
            except OSError as e:
                raise ValueError(f"cannot read api_key_file {self.api_key_file!r}: {e.strerror or e}") from None
            keys = tuple(k for k in (line.split("#", 1)[0].strip() for line in lines) if k)
            if not keys:
                raise ValueError(f"api_key_file {self.api_key_file!r} holds no key")
            self._file_keys = keys
        return self

    @property
    def accepted_api_keys(self) -> Tuple[str, ...]:
        """Every key that authenticates a request: `api_keys` and those of `api_key_file` (empty: no auth)."""
        return (*self.api_keys, *self._file_keys)

    @property
    def discover(self) -> bool:
        """`--model all`: the models are the ones the swarm's servers announce (`gateway.api.models.discover`)."""
        return self.model == ["all"]

    @property
    def model_path(self) -> str:
        """The first (with one model: the) model's bundled name, directory or hub id."""
        return self.model[0]

    @property
    def model_name(self) -> str:
        """The id clients use for the first model: `served_model_name`, else the last part of its path or repo id."""
        return self.served_model_name or _name_of(self.model[0])

    @property
    def model_names(self) -> List[str]:
        """Every served model's id, in the order given."""
        return [self.model_name, *(_name_of(m) for m in self.model[1:])]

    def for_model(self, path: str) -> "GatewayConfig":
        """These settings for one of the models (`model` = [path]): what that model's own state is built from."""
        if path not in self.model:
            raise ValueError(f"{path!r} is not one of this gateway's models")
        return self.model_copy(update={"model": [path]})


def _name_of(path: str) -> str:
    """A model's default id: the last part of its path or repo id."""
    return path.rstrip("/").split("/")[-1] or path
