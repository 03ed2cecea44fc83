PYTHON ?= python3
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
DEMO_STEPS ?= 20
DEMO_TEST ?= 20
DEMO_VALIDATION ?= 10
DEMO_EVAL_EVERY ?= 10
# the CE-converged start the recipe needs: the efficacy study's committed stage-1 adapter (seed 0)
DEMO_START ?= recipes/results/study/stage1-seed0/best
# the demo imports this checkout's bsloss; a fresh folder per run (a second run into one folder is refused: --overwrite replaces it)
DEMO_DIR ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)

.PHONY: setup test demo score-example bench

setup:
	PYTHON=$(PYTHON) bash .ci/setup

# The test command (README): set-up, lint, then the whole suite.
test: setup
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q

# The main job (README): the recipe the efficacy study measured best (recipes/RESULTS.md), short:
# Gemma 3 270M (offline; converted once by the set-up) from a CE-converged LoRA adapter on
# Spanish->English verses, DEMO_STEPS steps of CE + the balanced soft BERTScore term on the
# model's own sampled answers; prints start vs fine-tuned F_BERT, BLEU and chrF on DEMO_TEST
# held-out verses, and the plot's path; held-out F_BERT and CE every DEMO_EVAL_EVERY steps on
# DEMO_VALIDATION dev verses, drawn in curves.png.
demo: setup
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) recipes/finetune.py \
		--config recipes/configs/bible-es-en-gemma-sampled.yaml --init_from $(DEMO_START) \
		--output_dir $(DEMO_DIR) --set train.steps=$(DEMO_STEPS) --set eval.before=true \
		--set data.max_test=$(DEMO_TEST) --set train.save_model=false \
		--set data.max_validation=$(DEMO_VALIDATION) --set train.eval_every=$(DEMO_EVAL_EVERY)

# Score the shipped STS-B example pairs from the command line.
score-example: setup
	$(PYTHON) -m bsloss score -c bsloss/examples/candidates.txt -r bsloss/examples/references.txt --rescale --per-line

bench: setup
	$(PYTHON) benchmarks/throughput.py --mode both --repeats 3
