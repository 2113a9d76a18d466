"""A model-free simulated prefill worker and decode worker, for demos, benchmarks and tests.

They run the real data plane with no model: real paged KV caches in torch, a real
broker, real TCP. The prefill worker writes each prompt's KV from a seed, saves it
synchronously into a staging lease, reuses its blocks at once and offers the transfer;
the decode worker receives into its pool, scatters into its own cache and checks every
byte against the content recomputed from the seed. See `sim.demo`.

    python -m sim.decode  --broker tcp://127.0.0.1:7100 --instance d0
    python -m sim.prefill --broker tcp://127.0.0.1:7100 --instance p0 --prompts 300
    python -m sim.demo
"""
