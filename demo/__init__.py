"""`make demo`: prefill and decode on real vLLM servers on the CPU, through the broker and the gateway.

    python -m demo               a broker, a gateway, one prefill and two decode vLLM
                                 servers; a stream of requests; a decode server and the
                                 broker killed mid-run; a summary (see `demo.run`)
    python -m demo.tiny_model DIR   the tiny random-weight model the servers serve

`demo.servers` and `demo.tiny_model` also start the servers of the end-to-end tests.
Not shipped in the wheel: it starts vLLM servers and needs httpx and vLLM.
"""
