# Two entry points that work on a fresh machine with only python3 and pip:
#   make demo   runs the main job: trains the seed tutorial model with strategy="autopart" on 2 CPU processes
#   make test   runs the test suite (ruff, mypy, pytest)
# Both create and reuse a local virtual environment in .venv (an installed torch is reused, never replaced).

PYTHON ?= python3
VENV_FLAGS ?= --system-site-packages
TORCH_VERSION ?= 2.13.0
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.autopart-installed
PYTEST_ARGS ?=
# make test-torch TORCH=2.11.0: the whole suite in .venv-torch$(TORCH) on that torch (PyPI's build if it must).
TORCH  ?= 2.11.0
# make test-lightning LIGHTNING=2.5.6: the whole suite in .venv-lightning$(LIGHTNING) on that Lightning (the floor).
LIGHTNING ?= 2.5.6
LIGHTNING_VERSION ?=

.PHONY: demo plan-demo test test-torch test-lightning test-gpu lint typecheck pytest docs docs-images bench clean

$(STAMP): pyproject.toml scripts/ensure_torch.py
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	TORCH_VERSION=$(TORCH_VERSION) AUTOPART_TORCH_FROM_PYPI=$(AUTOPART_TORCH_FROM_PYPI) $(BIN)/python scripts/ensure_torch.py
	$(BIN)/python -m pip install -q -e '.[test,dev,plot,docs,ray]' $(if $(LIGHTNING_VERSION),lightning==$(LIGHTNING_VERSION))
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m examples.tutorial --devices 2 --max-steps 40 --device-memory 12MB --hidden 256

plan-demo: $(STAMP)
	$(BIN)/autopart plan --model examples.tutorial.Net --model.init_args.hidden 5000 --model.init_args.layers 100 \
		--devices 8 --device-memory 40GB --batch-size 512 --profile estimate --device-spec a100-40gb \
		-o out/tutorial-plan.json
	$(BIN)/autopart show out/tutorial-plan.json --timeline out/tutorial-timeline.png --memory out/tutorial-memory.png

lint: $(STAMP)
	$(BIN)/ruff check lightning_autopart tests examples bench scripts

typecheck: $(STAMP)
	$(BIN)/mypy

# Without PYTEST_ARGS: the one-process tier on UNIT_WORKERS workers (pytest-xdist; its tests are independent and
# mostly bound by the interpreter), then the tiers that start processes on PROCESS_WORKERS workers, a test file
# per worker (its module fixtures launch a job once): one at a time they left half of 2 cores idle (ranks wait
# on each other and on launchers). Last, one test at a time, the files marked `alone`: they check how soon
# ranks exit after a fault or a signal, or how busy the CPUs are, which a job beside them would change.
# With PYTEST_ARGS: one plain pytest run of what they name.
UNIT_WORKERS ?= 2
PROCESS_WORKERS ?= 2
pytest: $(STAMP)
ifeq ($(strip $(PYTEST_ARGS)),)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(UNIT_WORKERS) tests/unit
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(PROCESS_WORKERS) --dist loadfile -m "not alone" \
		--ignore=tests/unit
	$(BIN)/python -m pytest -q -p no:cacheprovider -m alone --ignore=tests/unit
else
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)
endif

# The docs site in out/site; --strict fails on a broken link or anchor, or a page left out of the nav.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d out/site

# The docs' plan pictures (committed): the tutorial plan of `make plan-demo`, drawn into docs/img/.
docs-images: $(STAMP)
	$(BIN)/python scripts/docs_images.py

test: lint typecheck docs pytest

# Another torch: a venv of its own (no system site packages, so the system's torch is not seen), same checks.
test-torch:
	$(MAKE) test VENV=.venv-torch$(TORCH) TORCH_VERSION=$(TORCH) VENV_FLAGS= AUTOPART_TORCH_FROM_PYPI=1

# Another Lightning: a venv of its own, the default torch, same checks.
test-lightning:
	$(MAKE) test VENV=.venv-lightning$(LIGHTNING) LIGHTNING_VERSION=$(LIGHTNING)

# The GPU tier (tests marked gpu; skipped without CUDA) and the one-GPU benchmark.
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m gpu tests/gpu $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/plan_speed.py
	$(BIN)/python bench/heuristics.py

clean:
	rm -rf $(VENV) out .mypy_cache .ruff_cache .pytest_cache
