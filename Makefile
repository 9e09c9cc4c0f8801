# The two commands of the README: `make demo` and `make test`.
# Each sets up its own virtual environment (.venv) on a fresh machine and
# installs what it needs, no more: one stamp file per set of extras.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEPS   := pyproject.toml setup.py constraints.txt

# Installs go through uv, which resolves and downloads in parallel: the three environments of
# make test take about a minute where pip took 7.5. uv comes from PyPI with pip, once, into
# an environment of its own (.venv-uv); UV=/path/to/uv uses one you have. constraints.txt pins
# this project's own environments (not the package's extras).
UV_VENV := .venv-uv
UV      ?= $(UV_VENV)/bin/uv
UV_DEP  := $(filter $(UV_VENV)/bin/uv,$(UV))
# uv reads no pip configuration: pip's find-links (a folder of wheels, such as the CPU build of
# torch that this project's machines keep) go on to it, and it never downloads a Python
FIND_LINKS := $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
export UV_PYTHON_DOWNLOADS := never
# uv writes no bytecode by default, and where PYTHONDONTWRITEBYTECODE is set (these machines and
# CI set it) Python never writes it either: every new process compiled PyTorch, JAX, PyTensor and
# PyMC from source again (a fresh clone's make test took 15 minutes where the same tests in
# environments with bytecode took 9). uv compiles it at install, on every core.
export UV_COMPILE_BYTECODE := 1
# For the same reason each test target first compiles this package and the tests' modules for its
# environment's Python (an editable install is never compiled; the files stay in __pycache__,
# which git ignores): a two-node job of the suite took 4.9 CPU-seconds from source, 3.7 from
# bytecode, and most of the suite is such jobs and scripts. $(call BYTECODE,<venv's python>)
BYTECODE = PYTHONDONTWRITEBYTECODE= $(1) -m compileall -q -j0 synkhronos tests
# $(INSTALL) <venv's python> <requirements...>
INSTALL = $(UV) pip install -q -c constraints.txt $(FIND_LINKS:%=--find-links %) --python

.PHONY: demo demo-mpi test test-main test-pymc test-pymc6 test-pymc6-zoo test-pymc6-rest test-pymc5 test-slow test-all test-nodes bench bench-pymc docs compat venv clean

$(UV_VENV)/bin/uv:
	$(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install -q -c constraints.txt uv

# pip in it too (--seed), for what you add by hand; the seed (pip, and on Python 3.11 setuptools,
# which PyTensor's C linker imports in every process that compiles a function) comes without
# bytecode: compiled here (see BYTECODE)
$(VENV)/bin/python: | $(UV_DEP)
	$(UV) venv -q --seed --python $(PYTHON) $(VENV)
	PYTHONDONTWRITEBYTECODE= $@ -m compileall -q -j0 $(VENV)/lib

# the headline demo: scikit-learn (its data), matplotlib (its plot), tqdm
$(VENV)/.demo: $(VENV)/bin/python $(DEPS)
	$(INSTALL) $(PY) -e '.[demo]'
	touch $@

# the demo under mpirun: mpi4py and the Open MPI wheel
$(VENV)/.demo-mpi: $(VENV)/bin/python $(DEPS)
	$(INSTALL) $(PY) -e '.[demo,mpi-wheel]'
	touch $@

# the whole suite runs the demos and builds the docs too
$(VENV)/.test: $(VENV)/bin/python $(DEPS)
	$(INSTALL) $(PY) -e '.[test,demo,docs]'
	touch $@

$(VENV)/.docs: $(VENV)/bin/python $(DEPS)
	$(INSTALL) $(PY) -e '.[docs]'
	touch $@

$(VENV)/.bench: $(VENV)/bin/python $(DEPS)
	$(INSTALL) $(PY) -e '.[bench]'
	touch $@

venv: $(VENV)/.test

demo: $(VENV)/.demo
	$(PY) demos/train_digits.py

# synkhronos.pymc in an environment of its own: PyMC pins the PyTensor it takes (PyMC 6 takes
# PyTensor 3 and Python 3.12; on Python 3.11 PyMC 5.28 takes PyTensor 2.38), which the main
# environment keeps free. The newest Python found (as for make compat), else $(PYTHON).
PYMC_VENV   := .venv-pymc
PYMC_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12.*/bin/python3.12) $(PYTHON))

$(PYMC_VENV)/bin/python: | $(UV_DEP)
	$(UV) venv -q --python $(PYMC_PYTHON) $(PYMC_VENV)

$(PYMC_VENV)/.installed: $(PYMC_VENV)/bin/python $(DEPS)
	$(INSTALL) $(PYMC_VENV)/bin/python -e '.[pymc-samplers]' pytest pytest-timeout scipy matplotlib
	touch $@

# PyMC 5.28 with PyTensor 2.38 (Python 3.11), the other PyMC users have: the model zoo and the row
# split on PyTensor 2, without the JAX and Rust samplers (PyTensor's default backend in each process);
# test_pymc.py's recipes (samplers, demo, bench) run on PyMC 6 only
PYMC5_VENV   := .venv-pymc5
PYMC5_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.11.*/bin/python3.11) $(PYTHON))

$(PYMC5_VENV)/bin/python: | $(UV_DEP)
	$(UV) venv -q --python $(PYMC5_PYTHON) $(PYMC5_VENV)

$(PYMC5_VENV)/.installed: $(PYMC5_VENV)/bin/python $(DEPS)
	$(INSTALL) $(PYMC5_VENV)/bin/python -e '.[pymc]' 'pymc>=5.28,<6' pytest pytest-timeout scipy
	touch $@

# make test runs every behaviour once; the slower variants of its scenarios (marked slow: more
# processes or nodes, the full random sequences, PyMC's zoo on 1 and 3 processes, numpyro, demos
# and benchmarks end to end) run in make test-slow, the long several-machines scenarios (marked
# long) in make test-nodes: the three run every test (make test-all). A pytest that selects no
# test exits with 5, which fails the target, as any failure does.
# The main suite and the PyMC parts run side by side (TEST_JOBS=1: one after the other): the
# main suite waits much of its time (subprocesses starting, mpirun, deadlines), the PyMC parts
# compute, each in one pytest process that waits too (for its forked workers, which compile
# while the master does not). PyMC 6's part, the longest, runs as two (its zoo, and the rest),
# so that the two cores stay busy to the end: alone, one PyMC part's process keeps 0.8 of a
# core busy. Each one's output shows when it ends.
TEST_JOBS ?= 4
test: $(VENV)/.test $(PYMC_VENV)/.installed $(PYMC5_VENV)/.installed
	$(MAKE) --no-print-directory -j$(TEST_JOBS) -Otarget test-main test-pymc6-zoo test-pymc6-rest test-pymc5

# the linter and the type checker first (pyproject.toml's [tool.ruff] and [tool.mypy]), then the
# suite in TEST_WORKERS pytest processes (pytest-xdist; 0: in this one). Most of its time is spent
# waiting (processes starting, mpirun, deadlines): alone on the 2-core machine it takes 11.5
# minutes in one process at 110 % CPU, 6.6 in four. Each test's leak checks look at its own
# process's children and names only, so the tests may share the machine. test_xla_rewrites.py
# runs in the PyMC environments, the only users of those rewrites.
TEST_WORKERS ?= 3
# OpenBLAS's idle threads spin for a tenth of a second before they sleep, which on a machine
# with more processes than cores takes the cores from the other tests (tests/conftest.py says
# more; it sets the same, but in PyMC 6's environment a pytest plugin loads numpy before it)
test-main test-pymc6-zoo test-pymc6-rest test-pymc5 test-slow test-nodes: export OPENBLAS_THREAD_TIMEOUT ?= 4
test-main: $(VENV)/.test
	$(call BYTECODE,$(PY))
	$(PY) -m ruff check synkhronos
	$(PY) -m mypy
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not long and not slow" \
		--ignore tests/test_xla_rewrites.py tests

PYMC_TESTS  := tests/test_pymc.py tests/test_pymc_zoo.py tests/test_xla_rewrites.py
# the XLA rewrites in both: they change a share's density graph, and PyTensor 2 and 3 differ
# (on PyTensor 2, pt.isfinite, which one of them called, does not exist)
PYMC5_TESTS := tests/test_pymc_zoo.py tests/test_row_split.py tests/test_xla_rewrites.py

# make test's part: the zoo on 2 processes, one sampler (nutpie) besides PyMC's own NUTS, JAX mode
# on 2 processes; make test-slow runs the rest, and Function.as_op on PyMC's PyTensor (make test
# runs it in the main environment)
test-pymc: test-pymc6 test-pymc5

# PyMC 6's part in two pytest processes (make test runs them side by side): the zoo, and the rest
test-pymc6: test-pymc6-zoo test-pymc6-rest

test-pymc6-zoo: $(PYMC_VENV)/.installed
	$(call BYTECODE,$(PYMC_VENV)/bin/python)
	$(PYMC_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not slow" tests/test_pymc_zoo.py

test-pymc6-rest: $(PYMC_VENV)/.installed
	$(call BYTECODE,$(PYMC_VENV)/bin/python)
	$(PYMC_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not slow" $(filter-out tests/test_pymc_zoo.py,$(PYMC_TESTS))

test-pymc5: $(PYMC5_VENV)/.installed
	$(call BYTECODE,$(PYMC5_VENV)/bin/python)
	$(PYMC5_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not slow" $(PYMC5_TESTS)

# what make test leaves out as slow (marked slow), in each environment
test-slow: $(VENV)/.test $(PYMC_VENV)/.installed $(PYMC5_VENV)/.installed
	$(call BYTECODE,$(PY))
	$(call BYTECODE,$(PYMC_VENV)/bin/python)
	$(PY) -m pytest -q -m "slow and not long" tests
	$(PYMC_VENV)/bin/python -m pytest -q -p no:cacheprovider -m slow $(PYMC_TESTS)
	$(PYMC_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_as_op.py
	$(PYMC5_VENV)/bin/python -m pytest -q -p no:cacheprovider -m slow $(PYMC5_TESTS)

test-all: test test-slow test-nodes

# the several-machines suites (mpirun on this machine) with 300 random divergence sequences per
# process count instead of make test's 40, messages over 2 GiB (about 10 GiB of memory), and the
# long scenarios that make test leaves out (marked long): slower, run before a release
test-nodes: $(VENV)/.test
	$(call BYTECODE,$(PY))
	SYNK_DIVERGE_SEQUENCES=300 SYNK_LARGE_MESSAGES=1 $(PY) -m pytest -q tests/test_nodes.py tests/test_mpi_comm.py \
	  tests/test_multiverso_mpi.py tests/test_mv_frameworks.py tests/test_bench_smoke.py::test_nodes_bench_quick

MPIRUN := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 $(VENV)/bin/mpirun --oversubscribe --mca osc ^ucx

# the demo on 2 nodes of 1 process each (two copies under mpirun on this machine)
demo-mpi: $(VENV)/.demo-mpi
	$(MPIRUN) -np 2 --bind-to none $(PY) demos/train_digits.py --workers 1 --no-baseline

bench: $(VENV)/.bench
	$(PY) bench/run.py
	$(PY) bench/mv_bench.py
	$(MPIRUN) -np 2 $(PY) bench/mv_bench.py
	$(PY) bench/nodes_bench.py
	$(PY) bench/nodes_steps.py
	$(PY) bench/nodes_steps.py --processes 2

# synkhronos.pymc against PyMC, PyMC cores=2, nutpie and numpyro (in .venv-pymc), 20k and 200k rows
# by default (1M: ROWS=20000,200000,1000000, an hour or more on 2 cores): the logistic regression in
# every part, then the Poisson and StudentT likelihoods (eval and one NUTS chain)
ROWS ?= 20000,200000
bench-pymc: $(PYMC_VENV)/.installed
	$(PYMC_VENV)/bin/python bench/pymc_bench.py --rows $(ROWS)
	for l in poisson studentt; do \
	  $(PYMC_VENV)/bin/python bench/pymc_bench.py --rows $(ROWS) --likelihood $$l --what eval,nuts \
	    --cases numpyro,nutpie,synk || exit 1; \
	done

docs: $(VENV)/.docs
	$(PY) -m sphinx -W -b html docs docs/_build/html

# The supported range, tested: a representative part of the suite (the API, every
# output op and collective, synk.data, the parameter-server tables, porting) on the
# lowest PyTensor and NumPy that pyproject.toml allows, and on the newest.
COMPAT_LOW   := pytensor==2.30.0 numpy==1.26.4
# the oldest and the newest Python tested, where pyenv has them (else $(PYTHON)): the newest
# PyTensor and NumPy need the newest Python
COMPAT_LOW_PYTHON  ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10.*/bin/python3.10) $(PYTHON))
COMPAT_HIGH_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12.*/bin/python3.12) $(PYTHON))
COMPAT_TESTS := tests/test_function.py tests/test_correctness.py tests/test_data.py \
                tests/test_collectives.py tests/test_multiverso.py tests/test_port.py
COMPAT_VENVS := .venv-compat-low .venv-compat-high

.venv-compat-low/bin/python: | $(UV_DEP)
	$(UV) venv -q --python $(COMPAT_LOW_PYTHON) .venv-compat-low

.venv-compat-low/.installed: .venv-compat-low/bin/python $(DEPS)
	$(INSTALL) .venv-compat-low/bin/python -e . pytest pytest-timeout $(COMPAT_LOW)
	touch $@

.venv-compat-high/bin/python: | $(UV_DEP)
	$(UV) venv -q --python $(COMPAT_HIGH_PYTHON) .venv-compat-high

.venv-compat-high/.installed: .venv-compat-high/bin/python $(DEPS)
	$(INSTALL) .venv-compat-high/bin/python --upgrade -e . pytest pytest-timeout pytensor numpy
	touch $@

compat: $(COMPAT_VENVS:%=%/.installed)
	@for v in $(COMPAT_VENVS); do \
	  $$v/bin/python -c 'import numpy, pytensor, sys; print(sys.argv[1] + ": Python", sys.version.split()[0], "PyTensor", pytensor.__version__, "NumPy", numpy.__version__)' $$v; \
	  $$v/bin/python -m pytest -q -p no:cacheprovider $(COMPAT_TESTS) || exit 1; \
	done

clean:
	rm -rf $(VENV) $(UV_VENV) $(PYMC_VENV) $(PYMC5_VENV) $(COMPAT_VENVS) docs/_build bench/results *.egg-info
