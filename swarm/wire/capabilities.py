"""What a peer's release can do: its release string, the protocol versions it speaks, its named capabilities.

A volunteer swarm runs several releases at once. Every server's DHT record (`swarm.wire.records.ServerInfo`) says
which release it runs (`version`, this package's version from `pyproject.toml`), the protocol versions it speaks
(`min_protocol`..`protocol`) and the named capabilities it supports (`capabilities`): each feature added to the
wire after the first release gets a name here, so that a client sends a field only to a server that announces it
and routing avoids servers that lack what a request needs (`swarm.client.transport.coverage`). Which request field
belongs to which capability: `FIELD_CAPABILITIES` (`needed_capabilities`: what one message needs).
`docs/compatibility.md` has the rule for adding a field.

A record without `capabilities` comes from the first release (0.1.0, `compat/previous_release`), which announced no
capabilities but supports every one named in `FIRST_RELEASE_CAPABILITIES`. Names this release does not know (a
newer server's) are ignored; a malformed version or a record that speaks no protocol version in common with this
peer is read as "unknown" (`record_problem`) and skipped by routing.
"""
from __future__ import annotations

import functools
import re
import sys
from pathlib import Path
from typing import Final, FrozenSet, Mapping, Optional, Tuple

from packaging.version import InvalidVersion, Version
from pydantic import BaseModel

PROTOCOL_VERSION: Final = 1  # the newest message version this release speaks (`swarm.wire.protocol.Message.v`)
MIN_PROTOCOL_VERSION: Final = 1  # the oldest one it still speaks (and answers in)

# every feature added to the wire since the first message set, by name (what a server announces)
CAPABILITIES: Mapping[str, str] = {
    "adapters": "LoRA adapters in sessions and forward passes (OpenSession.adapter, ForwardRequest.adapter)",
    "beam_reorder": "beam search's cache reorder (RowEdits.hypo_ids, reorder_id)",
    "compression": "compressed hidden states (OpenSession.compression; float16, blockwise8 tensors)",
    "deep_prompts": "deep prompts (OpenSession.prompts, TrainForward/TrainBackward.prompts)",
    "dht_traffic": "the rpc_dht_traffic report",
    "left_padding": "left-padded batches (RowEdits.left_padding, ForwardRequest.left_padding)",
    "limits": "announced RPC limits (ServerInfo.limits, ServerStats.limits)",
    "prefix_cache": "prompt prefixes kept and adopted (OpenSession.prefix, rpc_prefix_cache)",
    "prefix_outputs": "adopted prefix positions' outputs kept by the server, sent only when asked for "
                      "(OpenSession.prefix_outputs, rpc_prefix_outputs: PrefixOutputsRequest)",
    "push": "server-to-server push (rpc_push, Step.push_chain, OpenSession.push_token)",
    "relay": "servers behind a NAT served through a relay (ServerInfo.reachable) and the dial-back check",
    "rope_length": "a step's rope length (RowEdits.rope_length, ForwardRequest.rope_length)",
    "round_push": "a round's rows pushed server to server, one message per next server (RoundRow.push_chain, "
                  "rpc_round_push: RoundPush; RoundRowResult.pushed, RoundResult.pushed)",
    "rounds": "many sessions' steps in one message per server (rpc_round: RoundStep, RoundResult; rpc_round_stats)",
    "session_channels": "many session parts' streams in one stream per client (rpc_sessions: frames of "
                        "swarm.wire.channel)",
    "tensor_parallel": "blocks split across devices (ServerInfo.tensor_parallel)",
    "train_adapters": "training through a LoRA adapter (TrainForward/TrainBackward.adapter)",
    "training": "training passes (rpc_train_forward, rpc_train_backward)",
}
OWN_CAPABILITIES: Tuple[str, ...] = tuple(sorted(CAPABILITIES))  # what this release's servers announce
# the first release (0.1.0) announced no capabilities and supports all of these: a record without the field (named
# one by one: a capability added since, such as "rounds", is never one of them)
FIRST_RELEASE_CAPABILITIES: FrozenSet[str] = frozenset({
    "adapters", "beam_reorder", "compression", "deep_prompts", "dht_traffic", "left_padding", "limits", "push",
    "relay", "rope_length", "tensor_parallel", "train_adapters", "training",
})
CAPABILITY_PATTERN = r"^[a-z][a-z0-9_]{0,31}$"
_NAME = re.compile(CAPABILITY_PATTERN)


@functools.lru_cache(maxsize=1)
def release() -> str:
    """This package's release: `pyproject.toml`'s version in a source checkout (editable installs may carry stale
    metadata), else the installed distribution's (`importlib.metadata`)."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file() and sys.version_info >= (3, 11):
        import tomllib

        try:
            project = tomllib.loads(pyproject.read_text()).get("project", {})
            if project.get("name") == "swarmgate" and isinstance(project.get("version"), str):
                return project["version"]
        except (OSError, ValueError):
            pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("swarmgate")
    except PackageNotFoundError:
        return "0+unknown"


def parse_release(text: str) -> Optional[Version]:
    """A release string as a comparable version; None if it is empty or malformed."""
    try:
        return Version(text) if text else None
    except InvalidVersion:
        return None


def known_capabilities(announced: Optional[Tuple[str, ...]]) -> FrozenSet[str]:
    """What a record's `capabilities` means to this release: None (a first-release record) is
    `FIRST_RELEASE_CAPABILITIES`; names this release does not know are dropped."""
    if announced is None:
        return FIRST_RELEASE_CAPABILITIES
    return frozenset(name for name in announced if name in CAPABILITIES)


def unknown_capabilities(announced: Optional[Tuple[str, ...]]) -> Tuple[str, ...]:
    return tuple(name for name in announced or () if name not in CAPABILITIES)


def valid_name(name: str) -> bool:
    return bool(_NAME.match(name))


def protocol_problem(min_protocol: int, protocol: int) -> Optional[str]:
    """Why a peer speaking versions [min_protocol, protocol] cannot talk with this one (None: they share one)."""
    if min_protocol > protocol:
        return f"announces protocol versions {min_protocol}..{protocol} (an empty range)"
    if min_protocol > PROTOCOL_VERSION:
        return (f"speaks protocol versions {min_protocol}..{protocol} only; this peer speaks "
                f"{MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION} (a future protocol)")
    if protocol < MIN_PROTOCOL_VERSION:
        return f"speaks protocol versions up to {protocol}; this peer needs {MIN_PROTOCOL_VERSION} or later"
    return None


# every request field of `swarm.wire.protocol` that belongs to a feature named in `CAPABILITIES`, by message type
# and field name: a client sets it (to anything but its default) only for a server that announces that name
# (`needed_capabilities`, `swarm.wire.protocol.check_capabilities`); the fields of a request not listed here are
# the first message set's, which every server reads (`CORE_FIELDS`; tests/swarm/client/test_capability_routing.py
# checks that each request field is in one of the two)
FIELD_CAPABILITIES: Mapping[str, str] = {
    "OpenSession.adapter": "adapters",
    "OpenSession.prompts": "deep_prompts",
    "OpenSession.push_token": "push",
    "OpenSession.compression": "compression",
    "OpenSession.prefix": "prefix_cache",
    "OpenSession.prefix_outputs": "prefix_outputs",
    "Step.hypo_ids": "beam_reorder",
    "Step.reorder_id": "beam_reorder",
    "Step.left_padding": "left_padding",
    "Step.rope_length": "rope_length",
    "Step.push_chain": "push",
    "PushStep.hypo_ids": "beam_reorder",
    "PushStep.reorder_id": "beam_reorder",
    "PushStep.left_padding": "left_padding",
    "PushStep.rope_length": "rope_length",
    "ForwardRequest.adapter": "adapters",
    "ForwardRequest.left_padding": "left_padding",
    "ForwardRequest.rope_length": "rope_length",
    "TrainForward.prompts": "deep_prompts",
    "TrainForward.adapter": "train_adapters",
    "TrainBackward.prompts": "deep_prompts",
    "TrainBackward.adapter": "train_adapters",
}
# what a request of each type needs whatever its fields (its RPC): a server without it has no such handler
MESSAGE_CAPABILITIES: Mapping[str, str] = {"PushStep": "push", "TrainForward": "training", "TrainBackward": "training",
                                           "RoundStep": "rounds", "PrefixOutputsRequest": "prefix_outputs",
                                           "RoundPush": "round_push"}
CORE_FIELDS: FrozenSet[str] = frozenset({
    "OpenSession.session_id", "OpenSession.start", "OpenSession.end", "OpenSession.max_length",
    "OpenSession.batch_size", "Step.start_position", "Step.step_id", "PushStep.stream_key", "PushStep.push_token",
    "PushStep.start_position", "PushStep.step_id", "PushStep.push_chain", "ForwardRequest.start",
    "ForwardRequest.end", "TrainForward.start", "TrainForward.end", "TrainBackward.start", "TrainBackward.end",
    "RoundStep.round_id", "RoundStep.attach", "RoundStep.rows", "RoundPush.rows", "PrefixOutputsRequest.stream_key",
    "PrefixOutputsRequest.positions",
})


def needed_capabilities(message: BaseModel) -> FrozenSet[str]:
    """The capabilities a server needs to take `message`: its RPC's, and those of its fields that are set (to
    anything but their defaults; `FIELD_CAPABILITIES`)."""
    always, fields = _capability_fields(type(message))
    return always.union(capability for name, capability, default in fields if getattr(message, name) != default)


@functools.lru_cache(maxsize=None)
def _capability_fields(cls: "type[BaseModel]") -> Tuple[FrozenSet[str], Tuple[Tuple[str, str, object], ...]]:
    """A message type's capabilities whatever its fields, and (field, capability, default) of its fields that need
    one: read once per type (a step is checked before every send, on the decode path)."""
    kind = cls.__name__
    always = frozenset({MESSAGE_CAPABILITIES[kind]} if kind in MESSAGE_CAPABILITIES else ())
    fields = tuple((name, FIELD_CAPABILITIES[f"{kind}.{name}"], field.get_default(call_default_factory=True))
                   for name, field in cls.model_fields.items() if f"{kind}.{name}" in FIELD_CAPABILITIES)
    return always, fields
