# The front door. Every target is one line that calls Python (through uv, which installs on first use).
RECIPE  ?= llama3_70b_pretrain_64gpu_h100_bf16
NODES   ?=
SET     ?=
FORMAT  ?= text
CLUSTER ?= local
# The GPU the run executes on (h100, h200; empty: h100): what plan, recipes, submit and new-recipe size memory and
# predict throughput for (overlapkit/sizing/hardware.py). The recipes are H100's; an H200 node has the same shape.
GPU     ?=
DRYRUN  ?=
PREFLIGHT ?=
RUN     ?=
FROM    ?= llama3_70b_pretrain_64gpu_h100_bf16
NAME    ?=
ARGS    ?=
# make new-recipe shape/layout variables (empty: the FROM recipe's, or the name's N and dtype); ARGS= takes the rest.
HIDDEN  ?=
LAYERS  ?=
HEADS   ?=
QUERY_GROUPS ?=
FFN     ?=
SEQ     ?=
GPUS    ?=
DTYPE   ?=
EXPERTS ?=
TOPK    ?=
EP      ?=
FORK_FLAGS = $(if $(HIDDEN),--hidden="$$HIDDEN") $(if $(LAYERS),--layers="$$LAYERS") $(if $(HEADS),--heads="$$HEADS") \
  $(if $(QUERY_GROUPS),--query-groups="$$QUERY_GROUPS") $(if $(FFN),--ffn="$$FFN") $(if $(SEQ),--seq="$$SEQ") \
  $(if $(GPUS),--gpus="$$GPUS") $(if $(DTYPE),--dtype="$$DTYPE") $(if $(EXPERTS),--experts="$$EXPERTS") \
  $(if $(TOPK),--topk="$$TOPK") $(if $(EP),--ep="$$EP")
CUTS    ?=
# Pretraining runs (docs/pretraining.md): the data spec, the run's identity, chained segments, Nsight.
DATA    ?=
RUN_NAME ?=
SEGMENTS ?=
NSYS    ?=
NSYS_RANKS ?=
# The PyTorch profiler instead of Nsight (clusters without nsys): TORCH_PROFILE=<start>:<end>, TORCH_PROFILE_RANKS=0,8.
TORCH_PROFILE ?=
TORCH_PROFILE_RANKS ?=
# make overlap-report: a profile (an .sqlite / .nsys-rep export, or a directory of them) with RECIPE=, or RUN=; PNG= the timeline.
PROFILE ?=
PNG     ?=
RUN_FLAGS = --data="$$DATA" --run-name="$$RUN_NAME" --segments="$$SEGMENTS" --nsys="$$NSYS" --nsys-ranks="$$NSYS_RANKS" \
  --torch-profile="$$TORCH_PROFILE" --torch-profile-ranks="$$TORCH_PROFILE_RANKS" \
  --gpu="$$GPU"
# make prep-data: JSONL file or directory → Megatron .bin/.idx + OUT/data.toml
IN      ?=
TOKENIZER ?=
OUT     ?=
KEY     ?= text
WORKERS ?= 1
FORCE   ?=
# make nightly / nightly-report / nightly-schedule / parse-log (launch/nightly.py, docs/nightly.md)
RECIPES ?=
NIGHT   ?=
LOG     ?=
ITERS   ?= 60
MIN_DP  ?= 2
JOB_DIR ?=
AT      ?=
# make stack-diff (docs/upgrading.md): the candidate pins, e.g. STACK="megatron-bridge==0.6.0 megatron-core==0.19.0".
STACK   ?=
# make calibrate: directories holding the run directories to fit on (empty: runs/ and the cluster's job_dir).
RUNS    ?=
# make test: pytest's own arguments (through PYTEST_ADDOPTS, split as a shell would); a path in them runs that path
# only, none runs pyproject's testpaths (tests/: the whole suite, where the docs' targets are judged at the end).
PYTEST_ARGS ?=
# Every variable above is data, never make or shell syntax: taken as typed (make expands nothing in it: $(shell ...),
# $HOME stay text), exported, and named by the commands below as "$$VAR" (the shell hands its bytes over as one
# argument, --flag=value, so even "--help" is a value). Our checks then answer whatever it holds (launch/args.py).
DATA_VARS := RECIPE NODES SET FORMAT CLUSTER GPU DRYRUN PREFLIGHT RUN FROM NAME ARGS HIDDEN LAYERS HEADS QUERY_GROUPS \
  FFN SEQ GPUS DTYPE EXPERTS TOPK EP CUTS DATA RUN_NAME SEGMENTS NSYS NSYS_RANKS TORCH_PROFILE TORCH_PROFILE_RANKS IN TOKENIZER OUT KEY WORKERS FORCE \
  RECIPES NIGHT LOG ITERS MIN_DP JOB_DIR AT PYTEST_ARGS PROFILE PNG RUNS STACK
# A command-line variable that is neither data nor the plumbing below (UV, PY) would be ignored: a typo (RECIPIE=)
# would plan the default recipe. launch/makevars.py answers (it knows make's own variables and our environment
# ones), naming the nearest; an environment variable is never checked. Read before the line below marks DATA_VARS.
MAKE_OWN := UV PY
UNKNOWN_VARS := $(filter-out $(DATA_VARS) $(MAKE_OWN),$(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),$(v))))
$(foreach v,$(DATA_VARS),$(eval override $(v) := $$(value $(v))))
export $(DATA_VARS)
export OVERLAPKIT_DATA_VARS := $(DATA_VARS)
UV      ?= tools/uv.sh
PY      := $(UV) run --frozen --quiet python
ifneq ($(strip $(UNKNOWN_VARS)),)
VARS_ANSWER := $(shell $(PY) -m launch make-vars --known='$(DATA_VARS) $(MAKE_OWN)' --given='$(subst ','\'',$(UNKNOWN_VARS))')
ifneq ($(VARS_ANSWER),ok)
$(error $(or $(VARS_ANSWER),unknown variables $(UNKNOWN_VARS): not variables of this Makefile))
endif
endif
# make's own pid: if make dies (even by kill -9), its Python child is not told; it watches this pid and stops
# (a submission in progress is marked failed, never left half-done). See overlapkit/cluster/submit.py.
export OVERLAPKIT_MAKE_PID := $(shell echo $$PPID)

.DEFAULT_GOAL := help
.PHONY: help setup test lint recipes plan stack-diff calibrate overlap-report plan-server-stop docs bench gpu-check new-recipe submit status logs cancel sbatch run-local prep-data slurm-up slurm-down

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  make %-20s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: ## install the pinned stack into .venv (uv sync --frozen)
	@$(UV) sync --frozen

test: ## run the test suite (two pytest workers, one a CPU); PYTEST_ARGS= a path, -k, --random-order, -n 0 (one)
	@PYTEST_ADDOPTS="$${PYTEST_ADDOPTS:-} $$PYTEST_ARGS" $(PY) -m pytest

lint: ## ruff check + format check
	@$(UV) run --frozen --quiet ruff check . && $(UV) run --frozen --quiet ruff format --check .

recipes: ## list every recipe: model, GPUs, dtype, layout, overlap summary
	@$(PY) -m launch recipes --gpu="$$GPU" --cluster="$$CLUSTER"

plan: ## the main job: build RECIPE, apply SET/NODES, resolve + audit the overlap stack, write runs/<dir>
	@$(PY) -m launch plan --nodes="$$NODES" --set="$$SET" --format="$$FORMAT" --cluster="$$CLUSTER" $(RUN_FLAGS) -- "$$RECIPE"

overlap-report: ## exposed communication per overlap class from a profile: RUN=<run dir> or PROFILE= RECIPE= (SET=, NODES=, GPU=, FORMAT=json, PNG=, FORCE=1)
	@$(PY) -m launch overlap-report --run="$$RUN" --profile="$$PROFILE" --recipe="$$RECIPE" --nodes="$$NODES" --set="$$SET" --gpu="$$GPU" --format="$$FORMAT" --png="$$PNG" --force="$$FORCE"

stack-diff: ## what a candidate STACK= (Bridge/Core/TE pins) changes in every recipe (RECIPES=, SET=, FORMAT=json): built once with uv, planned under both
	@$(PY) -m launch stack-diff --stack="$$STACK" --recipes="$$RECIPES" --set="$$SET" --format="$$FORMAT"

calibrate: ## fit the throughput model on CLUSTER's finished runs (RUNS= dirs); plan/recipes/nightly then use it
	@$(PY) -m launch calibrate --cluster="$$CLUSTER" --runs="$$RUNS"

plan-server-stop: ## stop this checkout's plan server (keeps Bridge loaded between commands: docs/plan.md; OVERLAPKIT_PLAN_SERVER=0|1)
	@$(PY) -m launch plan-server-stop

new-recipe: ## fork FROM into recipes/NAME.py: layout search, audit, memory (LAYERS= HIDDEN= HEADS= QUERY_GROUPS= FFN= SEQ= GPUS= DTYPE=, MoE: EXPERTS= TOPK= EP=, ARGS=)
	@$(PY) -m launch new-recipe --from="$$FROM" --name="$$NAME" --gpu="$$GPU" --cluster="$$CLUSTER" $(FORK_FLAGS) --args="$$ARGS"

docs: ## regenerate every figure README.md and docs/ show from the code (tools/docs.py); make test fails until you do
	@$(PY) tools/docs.py

bench: ## first/second `make plan` and `make recipes` vs bare `import megatron.bridge`; the overlap report on 8 x 200k kernels vs a plain sweep; a plan with and without the stack's start-up checks; stack-diff's candidate environment built, then reused
	@$(PY) bench/plan_all.py
	@$(PY) bench/overlap_report.py
	@$(PY) bench/startup_checks.py
	@$(PY) bench/stack_env.py

gpu-check: ## real 1-GPU training: each recipe's cut vs Bridge's own, side by side (CUDA; CUTS="llama3_8b", ARGS=--list on CPU)
	@$(PY) bench/gpu_cut.py --cuts="$$CUTS" --args="$$ARGS"

submit: ## submit RECIPE to CLUSTER via nemo_run (NODES=, SET=, DRYRUN=1 prints the sbatch, PREFLIGHT=1 checks only)
	@$(PY) -m launch submit --recipe="$$RECIPE" --cluster="$$CLUSTER" --nodes="$$NODES" --set="$$SET" --dryrun="$$DRYRUN" --preflight="$$PREFLIGHT" $(RUN_FLAGS)

status: ## one line per job of RUN= (state, preflight, first error; default: the latest run on CLUSTER; FORMAT=json)
	@$(PY) -m launch status --cluster="$$CLUSTER" --run="$$RUN" --format="$$FORMAT"

logs: ## print the job logs of RUN= (default: the latest run on CLUSTER)
	@$(PY) -m launch logs --cluster="$$CLUSTER" --run="$$RUN"

cancel: ## cancel RUN= (default: the latest run on CLUSTER)
	@$(PY) -m launch cancel --cluster="$$CLUSTER" --run="$$RUN"

sbatch: ## write a standalone sbatch script for RECIPE on CLUSTER (plain-sbatch path, no nemo_run)
	@$(PY) -m launch sbatch --recipe="$$RECIPE" --cluster="$$CLUSTER" --nodes="$$NODES" --set="$$SET" --preflight="$$PREFLIGHT" $(RUN_FLAGS)

run-local: ## run RECIPE on this 8-GPU node with torchrun (nemo_run LocalExecutor; NODES is 1)
	@$(PY) -m launch run-local --recipe="$$RECIPE" --set="$$SET" --dryrun="$$DRYRUN" --preflight="$$PREFLIGHT" $(RUN_FLAGS)

prep-data: ## tokenize IN (JSONL file or dir) with TOKENIZER (local HF dir) into OUT/*.bin/.idx + OUT/data.toml (KEY=, WORKERS=, FORCE=1)
	@$(PY) -m launch prep-data --in="$$IN" --tokenizer="$$TOKENIZER" --out="$$OUT" --key="$$KEY" --workers="$$WORKERS" --force="$$FORCE"

slurm-up: ## install and start the local multi-node dev Slurm (root; idempotent)
	bash slurm/local/start.sh

slurm-down: ## stop the local dev Slurm
	bash slurm/local/stop.sh

# Nightly regression (launch/nightly.py, docs/nightly.md).
.PHONY: nightly nightly-report bless parse-log nightly-schedule nightly-status nightly-unschedule

nightly: ## submit every recipe's nightly shape + a summary job (RECIPES=, DRYRUN=1, PREFLIGHT=1, STACK= a candidate's plan diff in the report)
	@$(PY) -m launch nightly --cluster="$$CLUSTER" --dryrun="$$DRYRUN" --preflight="$$PREFLIGHT" --recipes="$$RECIPES" --iters="$$ITERS" --min-dp="$$MIN_DP" --job-dir="$$JOB_DIR" --gpu="$$GPU" --stack="$$STACK"

nightly-report: ## classify a night vs goldens, write report.md + plots (NIGHT=, default latest)
	@$(PY) -m launch nightly-report --cluster="$$CLUSTER" --night="$$NIGHT" --job-dir="$$JOB_DIR"

bless: ## turn a reviewed nightly run (RUN=<run dir>) into nightly/goldens/<recipe>.json (FORCE=1: over one there)
	@$(PY) -m launch bless --run="$$RUN" --force="$$FORCE"

parse-log: ## parse a Bridge/Megatron training log (LOG=) to JSON
	@$(PY) -m launch parse-log -- "$$LOG"

nightly-schedule: ## run the nightly every day at AT (02:00, now+90, ISO date) through sbatch --begin (RECIPES=, PREFLIGHT=, DRYRUN=1)
	@$(PY) -m launch nightly-schedule --cluster="$$CLUSTER" --at="$$AT" --recipes="$$RECIPES" --preflight="$$PREFLIGHT" --iters="$$ITERS" --min-dp="$$MIN_DP" --job-dir="$$JOB_DIR" --dryrun="$$DRYRUN" --gpu="$$GPU"

nightly-status: ## the scheduled chain (next begin, late or broken?) and the last night's verdict
	@$(PY) -m launch nightly-status --cluster="$$CLUSTER" --job-dir="$$JOB_DIR"

nightly-unschedule: ## cancel the scheduled nightly chain of CLUSTER
	@$(PY) -m launch nightly-unschedule --cluster="$$CLUSTER" --job-dir="$$JOB_DIR"
