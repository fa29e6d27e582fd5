# `make run` and `make test` each set up a fresh machine, then run the demo / the test suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.runtime
STAMP := $(VENV)/.installed

.PHONY: setup run test proto clean image

# the runtime dependencies only: what `make run` needs
$(RUNTIME): pyproject.toml
	# A GPU machine keeps the CUDA torch it has (the venv sees system packages); a CPU machine gets the CPU build.
	@if $(PY) -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then \
		$(PY) -m venv --system-site-packages $(VENV); \
	else \
		$(PY) -m venv $(VENV) && $(BIN)/pip install -q torch==2.13.0; \
	fi
	$(BIN)/pip install -q -e .
	touch $(RUNTIME)

# plus the test extra (the HF oracle, Triton's interpreter, the openai client, deploy checks)
$(STAMP): $(RUNTIME)
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

# router + 1 prefill + 1 decode worker (separate processes), one request through them, then a clean shutdown
PORT ?= 50051
MODEL ?= models/tandem-tiny
run: $(RUNTIME)
	@$(BIN)/tandem serve --model $(MODEL) --port $(PORT) --metrics-port 0 --http-port 0 & pid=$$!; \
	trap 'kill -TERM $$pid 2>/dev/null; wait $$pid' EXIT; \
	$(BIN)/tandem request --address 127.0.0.1:$(PORT) --chat --prompt "Hello! What can you do?" --max-tokens 48 \
		--wait 300

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The serving image (Dockerfile) with podman or docker, whichever is installed; the tag the manifests name.
# TORCH_VARIANT=cuda: CUDA torch and the [gpu] extra. IMAGE_FLAGS: more build flags (--build-arg BASE_IMAGE=...,
# --build-context wheels=DIR, --network host, ...); ENGINE: the engine command when both or a wrapper are wanted.
TORCH_VARIANT ?= cpu
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= tandem:$(VERSION)-$(TORCH_VARIANT)
ENGINE ?= $(notdir $(firstword $(shell command -v podman docker 2>/dev/null)))
image:
	@test -n "$(ENGINE)" || { echo "make image: neither podman nor docker is installed" >&2; exit 1; }
	$(ENGINE) build --build-arg TORCH_VARIANT=$(TORCH_VARIANT) $(IMAGE_FLAGS) -t $(IMAGE) .
	@echo "built $(IMAGE)"

proto: $(STAMP)
	$(BIN)/python -m tandem.rpc.regenerate

clean:
	rm -rf $(VENV)
