"""A swarm manager's long-lived objects, one per server: its round streams (`rounds.RoundStream`) and session
channels (`channel.SessionChannel`). `PerPeer.get` makes one on first use and again once the last one is no longer
usable; `close_all` closes them (the manager's shutdown does, from any thread)."""
from __future__ import annotations

import weakref
from typing import Callable, Dict, Generic, Optional, TypeVar

from swarm.client.transport.manager import SwarmManager

T = TypeVar("T")


class PerPeer(Generic[T]):
    """`make(manager, peer_id)` -> a new one; `usable(one)`: whether it may still be handed out; `close(one)`."""

    def __init__(self, make: Callable[[SwarmManager, str], T], usable: Callable[[T], bool],
                 close: Callable[[T], None]):
        self._make, self._usable, self._close = make, usable, close
        self._by_manager: "weakref.WeakKeyDictionary[SwarmManager, Dict[str, T]]" = weakref.WeakKeyDictionary()

    def get(self, manager: SwarmManager, peer_id: str) -> T:
        held = self._by_manager.get(manager)
        if held is None:
            held = self._by_manager[manager] = {}
            manager.on_shutdown.append(lambda: self.close_all(manager))
        one = held.get(peer_id)
        if one is None or not self._usable(one):
            one = held[peer_id] = self._make(manager, peer_id)
        return one

    def peek(self, manager: SwarmManager, peer_id: str) -> Optional[T]:
        """The usable one for `peer_id` if there is one (none is made)."""
        one = self._by_manager.get(manager, {}).get(peer_id)
        return one if one is not None and self._usable(one) else None

    def current(self, manager: SwarmManager) -> Dict[str, T]:
        """The manager's ones now, by server (a copy)."""
        return dict(self._by_manager.get(manager, {}))

    def drop(self, manager: SwarmManager, peer_id: str, one: T) -> None:
        """Forget `one` (it ended), unless another has replaced it already."""
        held = self._by_manager.get(manager)
        if held is not None and held.get(peer_id) is one:
            del held[peer_id]

    def close_all(self, manager: SwarmManager) -> None:
        for one in list(self._by_manager.pop(manager, {}).values()):
            self._close(one)
