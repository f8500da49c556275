# Every target installs what it needs first, so each works on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# the versions tested with, torch 2.13.0's CPU build among them: constraints.txt (the package declares ranges)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[torch,demo,dev,metrics,cli,ray,jax,flax,keras,bench]'
	# TensorFlow's CPU build (the [tensorflow] extra names `tensorflow`, which is larger and the same module)
	$(PY) -m pip install --quiet -c constraints.txt tensorflow-cpu
	# the emulated network needs ip and tc (iproute2): install them where we can, never fail without them
	command -v tc >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get install -y -qq iproute2 >/dev/null 2>&1; } || echo "note: iproute2 not installed; netem tests will skip"
	touch $(STAMP)

demo: install
	$(PY) examples/digits_demo.py

test: install
	$(PY) -m pytest -q --durations=25

bench: install
	$(VENV)/bin/gradwire bench -n 4 -s 4 --sizes 4,16,64

lint: install
	$(VENV)/bin/ruff check src tests examples
	$(VENV)/bin/ruff format --check src tests examples

clean:
	rm -rf $(VENV) build src/*.egg-info
