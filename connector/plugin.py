"""vLLM plugin entry point: registers KVBrokerConnector by name.

vLLM calls every ``vllm.general_plugins`` entry point once per process (front end,
engine core, workers), and a plugin that raises is only logged; so `register` must be
idempotent and cheap: it records the module path and class name, and vLLM imports
them only when a kv_transfer_config names the connector.
"""

from __future__ import annotations

NAME = "KVBrokerConnector"
MODULE = "connector.connector"


def register() -> None:
    """Register ``KVBrokerConnector`` with vLLM's connector factory, once per process."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, MODULE, NAME)
