"""vLLM plugin entry point: registers KVBrokerConnector by name."""


def register() -> None:
    """Called by vLLM's `vllm.general_plugins` loader in every process."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    name = "KVBrokerConnector"
    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, "connector.connector", name)
