# Quick start: `make train` (set up, then train and evaluate) and `make test` (set up, then test).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
KERNELS := $(VENV)/.kernels
DATA   := ../shared/data/criteo/criteo_10k_encoded_train.csv
CONFIG ?= $(if $(wildcard $(DATA)),configs/criteo_10k.toml,configs/synthetic.toml)

.PHONY: setup train test bench-quick clean

setup: $(STAMP) $(KERNELS)

# torch is pinned to the CPU build that lies on this machine's disk; installing it first means
# no other requirement can pull a different (CUDA) torch.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# The native CPU kernels are compiled here, once per machine and kernel source (a minute on two
# cores), so that a first training run does not wait for the compiler.
$(KERNELS): $(STAMP) $(wildcard recscale/*/csrc/*.cpp)
	$(BIN)/recscale kernels build
	touch $(KERNELS)

train: setup
	@if [ "$(CONFIG)" = "configs/criteo_10k.toml" ]; then \
	  echo "recscale: training on the real Criteo 10k sample ($(DATA)) with $(CONFIG)"; \
	else \
	  echo "recscale: ../shared/data not found; training on the built-in synthetic dataset with $(CONFIG)"; \
	fi
	$(BIN)/recscale train --config $(CONFIG) --summary-json runs/summary.json

test: setup
	$(BIN)/python -m pytest -q

bench-quick: setup
	$(BIN)/python benchmarks/embedding_op.py --quick

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
