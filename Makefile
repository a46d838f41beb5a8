# Two commands for a fresh machine (see README.md):
#   make demo   set up .venv and train the demo model with every strategy on 2 CPU processes
#   make test   set up .venv and run lint + the whole test suite
#
# On a CPU-only machine the CPU build of torch is pinned (a bare `torch` pulls a multi-GB CUDA build).
# On a GPU machine: `make test TORCH_SPEC=torch` (or any CUDA build you prefer).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# pip extras installed with the package; `make test EXTRAS=test,mpi` adds mpi4py (needs Open MPI installed).
EXTRAS ?= test
# LitData (tests/test_pipeline_data.py) without its dependencies: it requires torchvision, whose PyPI wheel pins the
# newest torch (a CUDA build) over the pinned one; its pure-Python dependencies are in the `test` extra.
LITDATA_SPEC ?= litdata==0.2.76
BIN := $(VENV)/bin
comma := ,
empty :=
space := $(empty) $(empty)
# The stamp names the extras and the torch spec, so another `TORCH_SPEC` (e.g. `make test TORCH_SPEC=torch`)
# reinstalls torch instead of reusing the build already there; the same spec again installs nothing.
sanitize = $(subst $(space),_,$(subst /,_,$(subst :,_,$(subst <,_,$(subst >,_,$(subst =,_,$(subst $(comma),-,$(1))))))))
STAMP := $(VENV)/.installed-$(call sanitize,$(EXTRAS))-torch-$(call sanitize,$(TORCH_SPEC))

# The compatibility pass (`make compat`): the tests marked `compat` (every strategy one short fit equal to one device,
# the demo's tiny preset, checkpoint save and resume) in a venv of its own per torch release: the declared floor and the
# newest installable. PyPI's builds (CUDA builds, which run on the CPU); `make test` keeps the pinned one.
COMPAT_TORCH ?= 2.11.0 2.14.1

.PHONY: setup demo test lint bench gpu-check compat clean
.PRECIOUS: .venv-torch-%/.installed

setup: $(STAMP)

# --force-reinstall: pip keeps an installed torch that already satisfies the spec (a CPU build satisfies `torch`).
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --force-reinstall --no-deps "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	$(BIN)/python -m pip install --quiet --no-deps "$(LITDATA_SPEC)"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m lightning_parallel.demos.main

# mypy checks the package against the installed torch/Lightning ([tool.mypy] in pyproject.toml), so a renamed
# private name or an `@override` of a method that no longer exists fails here.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q -ra --durations=30

# The `medium` preset (~35 minutes on 2 CPU cores, estimated: ~25 before the six user-callback fits per repeat were
# added): gpt-20m, ours and every anchor interleaved, with and without a plain user callback, 3 repeats.
bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all --preset medium

# On a borrowed machine with one CUDA GPU (or more): runs with the python and packages already there (`$(PYTHON)`,
# default python3; no venv, no pip, no network), inside GPU_CHECK_BUDGET seconds (default 480), and leaves only
# gpu_check.md and gpu_check.json in GPU_CHECK_OUT (every checkpoint it writes is deleted). The same as
# `PYTHONPATH=. python3 -m benchmarks.gpu_check --out DIR --budget-s 480`; the CPU stand-in: add `--device cpu`.
GPU_CHECK_OUT ?= benchmarks/out/gpu_check
GPU_CHECK_BUDGET ?= 480
gpu-check:
	PYTHONPATH=. $(PYTHON) -m benchmarks.gpu_check --out $(GPU_CHECK_OUT) --budget-s $(GPU_CHECK_BUDGET)

compat: $(addprefix compat-,$(COMPAT_TORCH))

# One venv per release (.venv-torch-X), installed once (stamp): torch first, then the package and the test extra. The
# launchers' extras (mpi, ray, torchft) are not installed there, so their tests skip even under CI's
# LIGHTNING_PARALLEL_REQUIRE_LAUNCHERS=1 (the full suite on the pinned torch requires them).
compat-%: .venv-torch-%/.installed
	.venv-torch-$*/bin/python -c "import torch; assert torch.__version__.split('+')[0] == '$*', torch.__version__"
	LIGHTNING_PARALLEL_REQUIRE_LAUNCHERS= .venv-torch-$*/bin/python -m pytest -q -ra -m compat --durations=10 -p no:cacheprovider

.venv-torch-%/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv .venv-torch-$*
	.venv-torch-$*/bin/python -m pip install --quiet --upgrade pip
	.venv-torch-$*/bin/python -m pip install --quiet "torch==$*"
	.venv-torch-$*/bin/python -m pip install --quiet -e ".[test]"
	touch $@

clean:
	rm -rf $(VENV) .venv-torch-* .pytest_cache .ruff_cache
