# The two commands of README.md: `make train` and `make test` (each sets up .venv first).
PY := .venv/bin/python
ARGS ?=

.PHONY: setup train test
setup:
	bash scripts/setup.sh

train: setup
	$(PY) train.py $(ARGS)

test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests $(ARGS)
