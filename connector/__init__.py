"""The vLLM connector of kvbroker.

``kv_connector: "KVBrokerConnector"`` with ``kv_connector_module_path: "connector"``
loads it from here; the ``vllm.general_plugins`` entry point (`connector.plugin`)
registers the same name, so ``kv_connector: "KVBrokerConnector"`` alone works too.
The class is imported lazily: importing this package (as the plugin loader does in
every vLLM process) must not pull in vLLM or torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVBrokerConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVBrokerConnector":
        from .connector import KVBrokerConnector

        return KVBrokerConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
