"""Private swarms: a shared secret (the swarm key) that every member holds, and what it authenticates.

hivemind's bundled p2p daemon has no libp2p private-network (PSK) option, so membership is proven above libp2p,
where libp2p already authenticates each connection's peer id (TLS/Noise):

- DHT RPCs (ping, store, find) carry an HMAC of the whole request made with the swarm key, a timestamp and a
  nonce (`SwarmKeyAuthorizer`, plugged into hivemind's `authorizer` hook); responses carry an HMAC bound to the
  request's nonce. A peer without the key gets no answer from members and members ignore its answers, so it
  can neither join the DHT (bootstrapping fails), nor announce blocks, nor read the servers' records.
- Block RPCs (sessions, forward, push, info) carry a membership proof, `HMAC(key, "member" || peer id)`, in the
  `uid` field of their first request; a server accepts it only for the connection's authenticated peer id
  (`SwarmKey.is_member`), so a proof overheard or copied is useless to another peer.

`SwarmKeySettings` adds `--swarm_key_file` / `--swarm_key` (env `SWARMGATE_SWARM_KEY_FILE`, `SWARMGATE_SWARM_KEY`)
to a process's typed config. A key file holds the secret as text (at least 16 characters; a libp2p `swarm.key`
file works as is); make one with `python -c "import secrets; print(secrets.token_hex(32))" > swarm.key`.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from pathlib import Path
from typing import Any, Optional, Union

from hivemind.p2p import PeerID
from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.timed_storage import TimedStorage, get_dht_time
from pydantic import Field, SecretStr, model_validator

from swarm.runtime.config import ProcessConfig

MIN_SECRET_CHARS = 16
_DOMAIN = b"swarmgate swarm key v1\x00"
MAX_CLOCK_SKEW = 60.0  # seconds a signed DHT request stays valid (hivemind's own authorizer uses the same bound)


class SwarmKey:
    """The swarm's shared secret (only a hash of it is kept); makes and checks the MACs that prove membership."""

    def __init__(self, secret: Union[str, bytes]):
        raw = secret.encode() if isinstance(secret, str) else secret
        raw = raw.strip()
        if len(raw) < MIN_SECRET_CHARS:
            raise ValueError(f"a swarm key must have at least {MIN_SECRET_CHARS} characters")
        self._key = hashlib.sha256(_DOMAIN + raw).digest()

    @classmethod
    def from_file(cls, path: Union[str, Path]) -> "SwarmKey":
        try:
            return cls(Path(path).read_bytes())
        except OSError as e:
            raise ValueError(f"cannot read the swarm key file {str(path)!r}: {e.strerror or e}") from None

    @property
    def fingerprint(self) -> str:
        """A short public name of the key (logs, /status): equal fingerprints, same key; reveals nothing."""
        return hashlib.sha256(b"fingerprint\x00" + self._key).hexdigest()[:12]

    def mac(self, purpose: bytes, data: bytes) -> bytes:
        return hmac.new(self._key, purpose + b"\x00" + data, hashlib.sha256).digest()

    def member_proof(self, peer_id: Union[PeerID, str]) -> str:
        """What a member sends with its block RPCs: a MAC of its own peer id (hex)."""
        return self.mac(b"member", _peer_bytes(peer_id)).hex()

    def is_member(self, peer_id: Union[PeerID, str], proof: str) -> bool:
        """Whether `proof` was made with this key for `peer_id` (constant-time comparison)."""
        return hmac.compare_digest(self.member_proof(peer_id).encode(), proof.encode("utf-8", "replace"))


def _peer_bytes(peer_id: Union[PeerID, str]) -> bytes:
    return (peer_id.to_base58() if isinstance(peer_id, PeerID) else str(peer_id)).encode()


def proof_for(key: Optional[SwarmKey], peer_id: Union[PeerID, str]) -> str:
    """The membership proof to send (empty in an open swarm)."""
    return key.member_proof(peer_id) if key is not None else ""


class SwarmKeyAuthorizer(AuthorizerBase):
    """hivemind's DHT authorizer for a private swarm: every DHT request and response is MACed with the swarm key.

    A request's MAC covers its serialized bytes with `auth.time` and a fresh `auth.nonce` set (and the signature
    field empty); a request older than `MAX_CLOCK_SKEW` or with a nonce seen before is refused. A response's MAC
    covers its bytes with the request's nonce, so a response cannot be replayed for another request.
    """

    def __init__(self, key: SwarmKey):
        self.key = key
        self._recent_nonces: TimedStorage = TimedStorage()

    async def sign_request(self, request: AuthorizedRequestBase, service_public_key: Any) -> None:
        auth = request.auth
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(16)
        auth.signature = b""
        auth.signature = self.key.mac(b"dht-request", request.SerializeToString())

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        auth = request.auth
        signature, auth.signature = auth.signature, b""
        expected = self.key.mac(b"dht-request", request.SerializeToString())
        if not hmac.compare_digest(signature, expected):
            return False
        now = get_dht_time()
        if abs(auth.time - now) > MAX_CLOCK_SKEW:
            return False
        with self._recent_nonces.freeze():
            if auth.nonce in self._recent_nonces:
                return False
        self._recent_nonces.store(auth.nonce, None, now + 3 * MAX_CLOCK_SKEW)
        return True

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        auth = response.auth
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = self.key.mac(b"dht-response", response.SerializeToString())

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        auth = response.auth
        if not request.auth.nonce or auth.nonce != request.auth.nonce:
            return False
        signature, auth.signature = auth.signature, b""
        expected = self.key.mac(b"dht-response", response.SerializeToString())
        return hmac.compare_digest(signature, expected)


logger = logging.getLogger(__name__)
BOOTSTRAP_ATTEMPTS = 2  # joins tried before a failed bootstrap is an error (none of the initial peers answered)
# hivemind's DHT caching off: by default a peer caches every value it finds and pushes it to the nearest peer that
# lacks it, and serves its cached copies to others' finds. Every read here asks for the latest values
# (`swarm.wire.records`), so a cache never answers one, and each cached copy was sent again with every find of
# that key: a read's bytes grew with the number of readers (x N at N servers).
NO_DHT_CACHE = {"cache_locally": False, "cache_nearest": 0}

NOT_A_MEMBER = "this is a private swarm: the request carries no valid proof of its swarm key"


def join_dht(key: Optional[SwarmKey], **kwargs: Any) -> Any:
    """`hivemind.DHT(start=True, **kwargs)` as a member of the swarm of `key` (None: an open swarm), run as a
    `swarm.runtime.dht_process.DHTProcess` (a child process that never outlives, nor hangs, its parent), without
    DHT caching (`NO_DHT_CACHE`, unless `kwargs` say otherwise). A failed
    bootstrap says what to check: in a private swarm, members do not answer a peer without the same key."""
    from swarm.runtime.dht_process import DHTProcess

    for attempt in range(1, BOOTSTRAP_ATTEMPTS + 1):
        try:
            return DHTProcess(start=True, **{**NO_DHT_CACHE, **kwargs}, **dht_kwargs(key))
        except RuntimeError as e:
            if "bootstrap failed" not in str(e):
                raise
            if attempt < BOOTSTRAP_ATTEMPTS:  # a busy peer may miss one ping's 3 s (hivemind's wait_timeout)
                logger.warning(f"joining the DHT failed ({e}); trying again ({attempt}/{BOOTSTRAP_ATTEMPTS})")
                continue
            held = f"this peer's key has fingerprint {key.fingerprint}" if key else "this peer has no swarm key"
            raise RuntimeError(f"{e} Check the initial peers' addresses; if the swarm is private, every member "
                               f"needs its key (--swarm_key_file): {held}.") from None
    raise AssertionError("unreachable")


def dht_kwargs(key: Optional[SwarmKey]) -> dict:
    """Extra `hivemind.DHT(...)` arguments for a member of a private swarm (none for an open swarm)."""
    return {} if key is None else {"authorizer": SwarmKeyAuthorizer(key)}


class SwarmKeySettings(ProcessConfig):
    """The swarm key settings shared by every process's config (server, gateway, bootstrap peer)."""

    swarm_key_file: Optional[str] = Field(
        default=None, description="file holding the private swarm's shared secret: only peers with the same key can "
                                  "join the DHT, announce blocks or open sessions (default: an open swarm)")
    swarm_key: Optional[SecretStr] = Field(
        default=None, description="the swarm key itself (prefer --swarm_key_file or the SWARMGATE_SWARM_KEY "
                                  "environment variable: command lines are visible to other users)")

    @model_validator(mode="after")
    def _loadable_key(self):
        if self.swarm_key_file is not None and self.swarm_key is not None:
            raise ValueError("give the swarm key once: swarm_key_file or swarm_key, not both")
        self.load_swarm_key()  # a missing file or a short key is a configuration error, before anything starts
        return self

    def load_swarm_key(self) -> Optional[SwarmKey]:
        if self.swarm_key_file is not None:
            return SwarmKey.from_file(self.swarm_key_file)
        if self.swarm_key is not None:
            return SwarmKey(self.swarm_key.get_secret_value())
        return None
