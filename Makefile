# Two commands from a fresh clone (Python >= 3.11 on PATH as python3, or PYTHON=...):
#   make demo   set up .venv and run the tour of every technique on 8 fake CPU devices
#   make test   set up .venv and run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench venv clean

# The venv's own pip (Python >= 3.11 ships pip >= 22: editable pyproject installs);
# --no-compile: Python writes the .pyc of what it imports on first use, instead of pip
# compiling every module of jax and its dependencies up front (about 10 s of the set-up).
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), f"jaxpar needs Python >= 3.11, found {sys.version.split()[0]}; run make PYTHON=python3.11 ..."'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-compile -e '.[test]'
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/jaxpar tour

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist worksteal --durations=15

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
