"""`kvbroker gateway`: one OpenAI-compatible HTTP address in front of prefill and decode
vLLM servers. A client of the broker (status, cancel; `protocols.ask`) and an HTTP proxy;
it imports nothing of the broker itself."""
