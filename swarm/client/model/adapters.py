"""Which LoRA adapter a client call runs with: the client model's `active_adapter` unless the call names one.

Block servers started with `--adapters` serve LoRA adapters over their blocks (`swarm.modeling.lora`).
`from_pretrained(..., active_adapter=NAME)` (or setting `model.active_adapter`) runs every session and forward pass
of the model with that adapter; `inference_session(max_length, adapter=NAME)` picks one per session (None: the base
model). Routing then uses only servers that hold it (`swarm.client.transport.routing`) and fails with a `SessionError` /
`RoutingError` naming the adapter when no chain has it. `served_adapters()` lists the adapters the swarm serves over
every block.
"""
from __future__ import annotations

from typing import Any, List, Optional

from swarm.client.transport.manager import SwarmManager
from swarm.modeling.lora_files import check_adapter_name


class _Active:
    """The default of an `adapter` argument: the model's `active_adapter`."""

    def __repr__(self) -> str:
        return "ACTIVE_ADAPTER"


ACTIVE_ADAPTER: Any = _Active()


class AdapterChoice:
    """The client model's part: its `active_adapter`, and what a call's `adapter` argument means."""

    manager: SwarmManager
    _active_adapter: Optional[str] = None

    @property
    def active_adapter(self) -> Optional[str]:
        """The LoRA adapter sessions and forward passes use unless told otherwise (None: the base model)."""
        return self._active_adapter

    @active_adapter.setter
    def active_adapter(self, name: Optional[str]) -> None:
        self._active_adapter = None if name is None else check_adapter_name(name)

    def _adapter(self, adapter: Any) -> Optional[str]:
        """A call's `adapter` argument (ACTIVE_ADAPTER: the model's) as an adapter name or None."""
        if adapter is ACTIVE_ADAPTER:
            return self._active_adapter
        return None if adapter is None else check_adapter_name(adapter)

    def served_adapters(self, force: bool = False) -> List[str]:
        """The LoRA adapters that servers (of an allowed quant type) serve over every block, by name."""
        return self.manager.served_adapters(force=force)
