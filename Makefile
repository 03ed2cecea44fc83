PYTHON ?= python3
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
DEMO_STEPS ?= 100

.PHONY: setup test demo score-example bench

setup:
	PYTHON=$(PYTHON) bash .ci/setup

# The test command (README): set-up, lint, then the whole suite.
test: setup
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q

# The main job (README): set-up, then a short run of the summarization recipe on the offline
# defaults (vendored XSum sample, BERT2BERT warm-started from the embedded MiniLM): CE + soft
# BERTScore loss, a before/after table of held-out F_BERT and ROUGE, and the path of the plot.
demo: setup
	$(PYTHON) recipes/finetune.py --config recipes/configs/xsum-bert2bert.yaml \
		--output_dir runs/demo --set loss.weight=1.0 --set loss.matching=softmax \
		--set train.steps=$(DEMO_STEPS) --set train.eval_every=$(DEMO_STEPS) \
		--set train.save_every=0 --set data.max_test=30 --set data.max_validation=20 \
		--set train.learning_rate=2e-4 --set train.lr_warmup_steps=20

# Score the shipped STS-B example pairs from the command line.
score-example: setup
	$(PYTHON) -m bsloss score -c bsloss/examples/candidates.txt -r bsloss/examples/references.txt --rescale --per-line

bench: setup
	$(PYTHON) benchmarks/throughput.py --mode both --repeats 3
