PYTHON ?= python3
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
DEMO_STEPS ?= 30
DEMO_TEST ?= 20
DEMO_VALIDATION ?= 10
DEMO_EVAL_EVERY ?= 10
# the demo imports this checkout's bsloss; a fresh folder per run (a second run into one folder is refused: --overwrite replaces it)
DEMO_DIR ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)

.PHONY: setup test demo score-example bench

setup:
	PYTHON=$(PYTHON) bash .ci/setup

# The test command (README): set-up, lint, then the whole suite.
test: setup
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q

# The main job (README): fine-tune Gemma 3 270M (offline; converted once by the set-up) on the
# vendored XSum sample with CE + soft BERTScore through the vocabulary bridge, and print zero-shot
# vs fine-tuned F_BERT and ROUGE on held-out articles, and the plot's path; held-out F_BERT and
# CE every DEMO_EVAL_EVERY steps on DEMO_VALIDATION validation articles, drawn in curves.png.
demo: setup
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) recipes/finetune.py --config recipes/configs/xsum-gemma.yaml --output_dir $(DEMO_DIR) \
		--set loss.weight=1.0 --set loss.matching=softmax --set train.steps=$(DEMO_STEPS) \
		--set train.lr_warmup_steps=3 --set data.max_test=$(DEMO_TEST) --set train.save_model=false \
		--set data.max_validation=$(DEMO_VALIDATION) --set train.eval_every=$(DEMO_EVAL_EVERY)

# Score the shipped STS-B example pairs from the command line.
score-example: setup
	$(PYTHON) -m bsloss score -c bsloss/examples/candidates.txt -r bsloss/examples/references.txt --rescale --per-line

bench: setup
	$(PYTHON) benchmarks/throughput.py --mode both --repeats 3
