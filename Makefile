# The two commands of the README: `make demo` and `make test`.
# Each sets up its own virtual environment (.venv) on a fresh machine.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo demo-mpi test bench docs venv clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(VENV)/bin/python pyproject.toml setup.py
	$(PY) -m pip install -q -e '.[test,demo,docs]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) demos/train_digits.py

test: $(STAMP)
	$(PY) -m pytest -q tests

MPIRUN := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 $(VENV)/bin/mpirun --oversubscribe --mca osc ^ucx

# the demo on 2 nodes of 1 process each (two copies under mpirun on this machine)
demo-mpi: $(STAMP)
	$(MPIRUN) -np 2 --bind-to none $(PY) demos/train_digits.py --workers 1 --no-baseline

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/run.py
	$(PY) bench/mv_bench.py
	$(MPIRUN) -np 2 $(PY) bench/mv_bench.py
	$(PY) bench/nodes_bench.py

docs: $(STAMP)
	$(PY) -m pip install -q -e '.[docs]'
	$(PY) -m sphinx -W -b html docs docs/_build/html

clean:
	rm -rf $(VENV) docs/_build bench/results *.egg-info
