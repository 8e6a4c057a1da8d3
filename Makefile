# The two commands of README.md: `make train` and `make test` (each sets up .venv first).
# `make lint` and `make docs` are what CI runs before the tests.
PY := .venv/bin/python
ARGS ?=

.PHONY: env setup train test test-quick lint format docs
# env: .venv with everything lmrepo needs. setup: that, Slurm's daemons for the suite's two-node
# cluster (as root), and DeepSpeed's CPU ops compiled side by side once for this machine
# (scripts/build_ops.py; kept for every later checkout): OPS=none skips them.
OPS ?= shm cpu_adam async_io fused_adam
env:
	bash scripts/setup.sh

setup: env
	bash scripts/install_slurm.sh
	$(if $(filter-out none,$(OPS)),$(PY) scripts/build_ops.py $(filter-out none,$(OPS)))

train: env
	$(PY) train.py $(ARGS)

test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests $(ARGS)

# A contributor's loop: the in-process files and one real case of each engine (tests/conftest.py's QUICK_FILES).
test-quick: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=10 -m quick tests $(ARGS)

lint: env
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

format: env
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

docs: env
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir site
