# The two commands of README.md: `make train` and `make test` (each sets up .venv first).
# `make lint` and `make docs` are what CI runs before the tests.
PY := .venv/bin/python
ARGS ?=

.PHONY: setup train test lint format docs
# OPS="shm cpu_adam async_io": also compile those DeepSpeed ops now (scripts/build_ops.py)
OPS ?=
setup:
	bash scripts/setup.sh
	$(if $(OPS),$(PY) scripts/build_ops.py $(OPS))

train: setup
	$(PY) train.py $(ARGS)

test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests $(ARGS)

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

format: setup
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir site
