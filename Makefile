PYTHON ?= python3
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test demo lint bench

setup:
	PYTHON=$(PYTHON) bash .ci/setup

# The test command (README): set-up, lint, then the whole suite.
test: setup
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q

# The main job (README): set-up, then BERTScore of the shipped example files.
demo: setup
	$(PYTHON) -m bsloss score -c bsloss/examples/candidates.txt -r bsloss/examples/references.txt --rescale --per-line

bench: setup
	$(PYTHON) benchmarks/throughput.py --mode both --repeats 3
