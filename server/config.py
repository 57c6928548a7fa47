"""The typed configuration of a block server (`swarmgate server` flags, `configs/server.yaml`, environment).

`ServerConfig` is built by `swarm.runtime.config` from command-line flags, a YAML file's `server` section and
`SWARMGATE_*` environment variables; its validators reject inconsistent settings before anything starts.
"""
from __future__ import annotations

import ipaddress
from typing import List, Literal, Optional

from pydantic import Field, field_validator, model_validator

from server.placement.throughput import parse_throughput_mode
from swarm.modeling.disk_cache import parse_size
from swarm.modeling.families import FAMILIES
from swarm.modeling.lora_files import ADAPTERS_HELP, AdapterSource
from swarm.modeling.quantize import QUANT_TYPE_HELP
from swarm.modeling.smallgemm import valid_packed_rows
from swarm.modeling.tensor_parallel import distinct_devices, parse_devices
from swarm.runtime.aio import parse_event_loop
from swarm.runtime.config import parse_device, parse_span
from swarm.runtime.relays import RelaySettings
from swarm.runtime.swarm_key import SwarmKeySettings
from swarm.wire.compression import COMPRESSION_HELP, Compression
from swarm.wire.dtypes import DTYPES
from swarm.wire.quant import parse_quant_type

PREFILL_BATCH_TOKENS_CPU = 128  # `--prefill_batch_tokens` defaults (see its help)
PREFILL_BATCH_TOKENS_CUDA = 256


class ServerConfig(SwarmKeySettings, RelaySettings):
    model: str = Field(description="model to serve: bundled name, local checkpoint directory or hub repo id")
    new_swarm: bool = Field(default=False, description="start a new swarm (no initial peers)")
    initial_peers: List[str] = Field(default_factory=list, description="multiaddrs of peers to join")
    host_maddrs: List[str] = Field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"],
                                   description="multiaddrs to listen on")
    announce_maddrs: List[str] = Field(default_factory=list, description="multiaddrs to announce to others")
    port: Optional[int] = Field(default=None, description="shortcut: listen on /ip4/0.0.0.0/tcp/PORT")
    public_ip: Optional[str] = Field(default=None, description="this machine's public IPv4 address (e.g. a home "
                                                               "router's, with the port forwarded to this machine): "
                                                               "announce /ip4/PUBLIC_IP/tcp/PORT for each fixed "
                                                               "listening port (needs --port or a port in "
                                                               "--host_maddrs)")
    compression: Compression = Field(default="none", description=COMPRESSION_HELP + "; what this server sends "
                                                                                    "to sessions whose client does "
                                                                                    "not ask for one")
    no_auto_relay: bool = Field(default=False, description="when other peers cannot dial this server, do not serve "
                                                           "through a relay: exit instead")
    skip_reachability_check: bool = Field(default=False, description="do not ask peers to dial this server back at "
                                                                     "start: assume it is directly reachable")
    relay_check_period: float = Field(default=5.0, ge=0, description="behind a NAT (served through a relay): "
                                                                      "seconds between checks that the relay still "
                                                                      "holds this server's slot; a lost slot is "
                                                                      "renewed once a relay answers (0: never check)")
    identity_path: Optional[str] = Field(default=None, description="private key file for a fixed peer id")
    block_indices: Optional[str] = Field(default=None, description="serve blocks start:end (pinned: no rebalancing)")
    num_blocks: Optional[int] = Field(default=None, gt=0,
                                      description="serve this many blocks (default: as many as fit in free memory)")
    device: str = Field(default="cpu", description="torch device (cpu, cuda, cuda:1, ...)")
    tensor_parallel_devices: List[str] = Field(
        default_factory=list,
        description="split every block of the span across these devices (tensor parallelism), e.g. cuda:0 cuda:1: "
                    "attention by key/value head groups, the MLP by intermediate columns, each session's KV cache by "
                    "key/value heads; the cache budget and block count use the free memory of all of them; the "
                    "span's inputs and outputs live on the first (--device is then unused). Families: "
                    + ", ".join(sorted(n for n, s in FAMILIES.items() if s.tensor_parallel)) + " (not "
                    + ", ".join(sorted(n for n, s in FAMILIES.items() if not s.tensor_parallel)) + "); the device "
                    "count must divide the key/value heads and the intermediate size (nf4: each device's widths "
                    "divisible by 64), else the server stops at start naming the reason. cpu may repeat (cpu cpu: "
                    "the same code path on one CPU, for tests), a GPU may not. A split span runs eagerly: no CUDA "
                    "graphs, KV arena or packed products")
    torch_dtype: str = Field(default="auto", description="auto, float32, float16 or bfloat16")
    quant_type: str = Field(default="auto", description=QUANT_TYPE_HELP)
    adapters: List[str] = Field(default_factory=list, description=ADAPTERS_HELP)
    packed_rows: List[int] = Field(
        default_factory=lambda: [8],
        description="with float32 blocks on the CPU: decode batch sizes (sessions' rows in one step) to pack every "
                    "projection's weight for with MKL's packed GEMM (swarm.modeling.smallgemm), each one more copy "
                    "of the span's weights in memory (packed during the first such batches), used for batches of 3 "
                    "rows up to that many (on the 2-core test "
                    "machine a pass of 8 sessions through 15 SmolLM2 blocks takes 21-22 ms instead of 27; 16 "
                    "sessions: 35 ms instead of 36 with a pack for 16); give the flag no value for none")
    cuda_graphs: bool = Field(default=True, description="on CUDA devices, replay decode steps of up to 16 sessions "
                                                         "as CUDA graphs (float and nf4 weights, adapters, padded "
                                                         "rows, ALiBi; not int8 nor Mixtral: server.compute.graphs)")
    kv_arena: bool = Field(default=True, description="on the CPU, keep one-row sessions' KV caches as slots of shared "
                                                   "tensors, so that a decode batch attends with one call per block "
                                                   "(server.compute.kv_arena)")
    decode_gather_ms: float = Field(default=20.0, ge=0, le=1000,
                                    description="longest wait (ms) for the decode steps of other active sessions to "
                                                "join a batch (at most half a batch's compute time; a group that "
                                                "drifted a whole pass behind waits up to one round to merge; 0: "
                                                "never wait)")
    attn_cache_tokens: Optional[int] = Field(
        default=None, gt=0, description="KV cache budget in tokens (batch x length); default: up to 16384, less if "
                                        "memory is short")
    max_length: int = Field(default=8192, gt=0, description="longest session (tokens) accepted")
    prefix_cache: Literal["on", "off"] = Field(
        default="on", description="keep the KV of prompt prefixes in pages inside the cache budget after their "
                                  "sessions end, for new sessions that start with the same tokens (same salt and "
                                  "adapter) to adopt (server.compute.prefix_cache); evicted least recently used "
                                  "before a session waits")
    prefix_page_tokens: int = Field(default=64, gt=0, le=4096, description="tokens per prefix-cache page (a "
                                                                           "prefix is shared in whole pages)")
    prefix_wait: float = Field(default=30.0, ge=0, le=600, description="longest wait (s) of a new session for the "
                                                                       "prefix pages another session is computing "
                                                                       "now, to adopt them instead of computing them "
                                                                       "too (single-flight); a claim older than this "
                                                                       "is not waited for; 0: never wait")
    prefill_batch_tokens: Optional[int] = Field(
        default=None, gt=0, le=65536,
        description="most tokens of several sessions' prefill chunks computed in one pass: a pass takes the queued "
                    "chunks in arrival order up to this many (the first always goes; the rest wait for the next "
                    "pass, after the decode steps of running sessions), and its sessions get their outputs when it "
                    "ends. Default: " + str(PREFILL_BATCH_TOKENS_CPU) + " on the CPU (a pass costs nearly its "
                    "tokens' compute, so passes of a few sessions give the first of them their outputs sooner; "
                    "smaller ones lose batching and let more decode steps in between: docs/benchmarks.md, "
                    "bench_prefix), " + str(PREFILL_BATCH_TOKENS_CUDA) + " on CUDA (the pass size of earlier "
                    "releases, the default prefill chunk: not measured on a GPU yet; a GPU computes a bigger pass in "
                    "little more time, so a larger budget may suit it)")
    max_sessions_per_peer: int = Field(default=128, gt=0, description="most inference sessions one peer (client or "
                                                                       "gateway) may hold open on this server")
    max_streams: int = Field(default=512, gt=0, description="most inference streams open at once, all peers "
                             "together (a session in a session channel counts as one; the channel itself does not)")
    max_message_bytes: int = Field(default=64 << 20, gt=0, description="largest RPC message accepted (metadata and "
                                                                      "tensors, bytes); clients send long inputs in "
                                                                      "chunks")
    max_step_tokens: int = Field(default=16384, gt=0, description="most tokens (batch x sequence) in one inference "
                                                                  "step or forward call: a longer prompt must come "
                                                                  "in chunks")
    max_queued_steps: int = Field(default=64, gt=0, description="steps of one session waiting to run; more: the "
                                                                "server stops reading that stream until it catches up")
    alloc_timeout: float = Field(default=5.0, ge=0, description="seconds a new session waits for cache")
    step_timeout: float = Field(default=300.0, gt=0, description="seconds an idle session is kept open")
    update_period: float = Field(default=120.0, gt=0, description="seconds between DHT record refreshes")
    expiration: Optional[float] = Field(default=None, description="record lifetime (default 2x update_period)")
    throughput: str = Field(default="auto", description="decode steps/s per block to announce: auto (cached "
                                                       "measurement, or measure once), eval (measure again) or a "
                                                       "number")
    balance_period: float = Field(default=120.0, gt=0, description="mean seconds between checks whether moving to "
                                                                   "other blocks would help the swarm (randomized)")
    balance_quality: float = Field(default=0.75, gt=0, le=1, description="move only if the swarm's weakest block "
                                                                         "would get more than 1/this times faster")
    hole_check_period: float = Field(default=5.0, ge=0, description="without pinned blocks: mean seconds between "
                                                                     "checks for blocks nobody serves (a hole), "
                                                                     "stretched by servers/100 in larger swarms; "
                                                                     "the servers that could fill one take turns "
                                                                     "(0: only the balance checks)")
    drain_timeout: float = Field(default=60.0, ge=0, description="seconds running sessions get to finish before "
                                                                 "the server moves to other blocks")
    dht_prefix: Optional[str] = Field(default=None, description="DHT key prefix (default: from the model name)")
    cache_dir: Optional[str] = Field(default=None, description="download cache for hub checkpoints")
    revision: Optional[str] = Field(default=None, description="hub checkpoints: the branch, tag or commit to serve "
                                                              "(default: the repo's main branch)")
    token: Optional[str] = Field(default=None, description="hub checkpoints: the access token for a gated or private "
                                                           "repo (default: huggingface_hub's own, the HF_TOKEN "
                                                           "environment variable or the stored `hf auth login`)")
    max_disk_space: Optional[str] = Field(default=None, description="size limit of the download cache (e.g. 50GB); "
                                                                     "least recently used files are evicted")
    num_threads: Optional[int] = Field(default=None, gt=0, description="torch intra-op threads")
    event_loop: str = Field(default="auto", description="the event loop of the server's RPCs: auto (uvloop where "
                                                        "installed), uvloop or asyncio")
    public_name: str = Field(default="", max_length=128,
                             description="a name for this server shown on swarm status pages (e.g. who runs it)")
    log_level: str = Field(default="INFO", description="logging level")

    @field_validator("public_ip")
    @classmethod
    def _valid_public_ip(cls, value):
        if value is not None:
            ipaddress.IPv4Address(value)  # ValueError names it
        return value

    @field_validator("block_indices")
    @classmethod
    def _valid_span(cls, value):
        if value is not None:
            parse_span(value)
        return value

    @field_validator("adapters")
    @classmethod
    def _valid_adapters(cls, value):
        names = [AdapterSource.parse(text).name for text in value]  # AdapterError (a ValueError) names a bad one
        if len(set(names)) != len(names):
            raise ValueError(f"adapter names must differ, got {names}")
        return value

    @field_validator("packed_rows")
    @classmethod
    def _valid_packed_rows(cls, value):
        return valid_packed_rows(value)

    @field_validator("device")
    @classmethod
    def _valid_device(cls, value: str) -> str:
        return parse_device(value)

    @field_validator("event_loop")
    @classmethod
    def _valid_event_loop(cls, value: str) -> str:
        return parse_event_loop(value)

    @field_validator("tensor_parallel_devices")
    @classmethod
    def _valid_tensor_parallel(cls, value):
        if value:
            parse_devices(value)  # TensorParallelError (a ValueError) names the bad device
        return value

    @field_validator("torch_dtype")
    @classmethod
    def _valid_dtype(cls, value):
        if value != "auto" and value not in DTYPES:
            raise ValueError(f"must be auto, {', '.join(DTYPES)}")
        return value

    @field_validator("quant_type", mode="before")
    @classmethod
    def _valid_quant_type(cls, value):
        return parse_quant_type(value, allow_auto=True)

    @field_validator("throughput", mode="before")
    @classmethod
    def _valid_throughput(cls, value):
        mode = parse_throughput_mode(value)
        return mode if isinstance(mode, str) else repr(mode)

    @field_validator("max_disk_space", mode="before")
    @classmethod
    def _valid_size(cls, value):
        if value is not None:
            parse_size(value)
            return str(value)
        return value

    @property
    def prefill_pass_tokens(self) -> int:
        """`--prefill_batch_tokens`, or its default for the span's device."""
        if self.prefill_batch_tokens is not None:
            return self.prefill_batch_tokens
        return PREFILL_BATCH_TOKENS_CUDA if self.span_device.startswith("cuda") else PREFILL_BATCH_TOKENS_CPU

    @property
    def span_device(self) -> str:
        """Where the span's inputs and outputs live: the first tensor-parallel device, else --device."""
        return self.tensor_parallel_devices[0] if self.tensor_parallel_devices else self.device

    @property
    def devices(self) -> List[str]:
        """Every device the span's blocks use (a device named twice counted once)."""
        return distinct_devices(self.tensor_parallel_devices) if self.tensor_parallel_devices else [self.device]

    def listen_maddrs(self) -> List[str]:
        return [f"/ip4/0.0.0.0/tcp/{self.port}"] if self.port is not None else list(self.host_maddrs)

    def announced_maddrs(self) -> List[str]:
        """`--announce_maddrs`, or with `--public_ip` one address per fixed TCP port listened on."""
        if self.public_ip is None:
            return list(self.announce_maddrs)
        ports = [m.split("/tcp/")[1].split("/")[0] for m in self.listen_maddrs() if "/tcp/" in m]
        return list(self.announce_maddrs) + [f"/ip4/{self.public_ip}/tcp/{port}" for port in ports]

    @model_validator(mode="after")
    def _fixed_port_for_public_ip(self):
        if self.public_ip is not None:
            ports = [m.split("/tcp/")[1].split("/")[0] for m in self.listen_maddrs() if "/tcp/" in m]
            if not ports or "0" in ports:
                raise ValueError("--public_ip needs a fixed listening port (--port N, or --host_maddrs "
                                 "/ip4/0.0.0.0/tcp/N), forwarded to this machine by the router")
        return self

    @model_validator(mode="after")
    def _consistent_blocks(self):
        if self.block_indices is not None and self.num_blocks is not None:
            start, end = parse_span(self.block_indices)
            if end - start != self.num_blocks:
                raise ValueError(f"num_blocks {self.num_blocks} disagrees with block_indices {self.block_indices}")
        return self
