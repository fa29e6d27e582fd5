# `make run` and `make test` each set up a fresh machine, then run the demo / the test suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test proto clean

$(STAMP): pyproject.toml
	# A GPU machine keeps the CUDA torch it has (the venv sees system packages); a CPU machine gets the CPU build.
	@if $(PY) -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then \
		$(PY) -m venv --system-site-packages $(VENV); \
	else \
		$(PY) -m venv $(VENV) && $(BIN)/pip install -q torch==2.13.0; \
	fi
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/tandem generate --model tiny-moe --prompt-token-ids 1,2,3,4,5 --max-tokens 16

test: $(STAMP)
	$(BIN)/python -m pytest -q

proto: $(STAMP)
	$(BIN)/python -m tandem.rpc.regenerate

clean:
	rm -rf $(VENV)
