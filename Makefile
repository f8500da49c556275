# Every target installs what it needs first, so each works on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NATIVE_STAMP := $(VENV)/.native-installed
NATIVE_SOURCES := native/pyproject.toml native/CMakeLists.txt $(wildcard native/cpp/*) $(wildcard native/src/gradwire_native/*)

.PHONY: install demo test bench lab lint sanitize clean

install: $(STAMP) $(NATIVE_STAMP)

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

# the native data path (native/: C++17, nanobind), built with the system's compiler by the backend [dev] installed;
# rebuilt when its sources change (incrementally: native/build keeps CMake's tree)
$(NATIVE_STAMP): $(STAMP) $(NATIVE_SOURCES)
	$(PY) -m pip install --quiet -c constraints.txt --no-build-isolation --no-deps --force-reinstall ./native
	touch $(NATIVE_STAMP)

demo: install
	$(PY) examples/digits_demo.py

# GRADWIRE_EXPECT_NATIVE: a missing extension fails the suite here instead of skipping its tests
test: install
	GRADWIRE_EXPECT_NATIVE=1 $(PY) -m pytest -q --durations=25

bench: install
	$(VENV)/bin/gradwire bench -n 4 -s 4 --sizes 4,16,64

# the lab's harnesses (benchmarks/: the floor, partitions, large models, accuracy, PS mode, failover, scaling), e.g.
# make lab ARGS="--floor -n 4 -s 4 --sizes 64"; with no ARGS, `python -m benchmarks --help`
ARGS ?= --help
lab: install
	$(PY) -m benchmarks $(ARGS)

lint: install
	$(VENV)/bin/ruff check src benchmarks tests examples
	$(VENV)/bin/ruff format --check src benchmarks tests examples

# the native suite and the native worker's jobs against a build with AddressSanitizer and UndefinedBehaviorSanitizer
# (any report fails it); the sanitizers' runtimes are preloaded into Python, whose own allocations are not leak-checked
SANITIZE := build/sanitize
sanitize: install
	cmake -S native -B $(SANITIZE) -DGRADWIRE_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
		-DPython_EXECUTABLE=$(abspath $(PY)) >/dev/null
	cmake --build $(SANITIZE) -j2
	mkdir -p $(SANITIZE)/pkg/gradwire_native
	cp native/src/gradwire_native/__init__.py $(SANITIZE)/_core*.so $(SANITIZE)/pkg/gradwire_native/
	# the sanitizers' reports go to files (pytest captures stderr, and a process they abort never shows it)
	rm -f $(SANITIZE)/report.*
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
		ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:log_path=$(abspath $(SANITIZE))/report \
		UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:log_path=$(abspath $(SANITIZE))/report \
		PYTHONPATH=$(SANITIZE)/pkg GRADWIRE_SANITIZED=1 $(PY) -m pytest -q -p no:cacheprovider tests/native \
		tests/benchmarks/test_native_floor.py \
		tests/cluster/test_native_worker.py tests/cluster/test_native_server.py tests/faults/test_failover.py \
		-k "not wheel and (not test_failover or native)"; \
		status=$$?; cat $(SANITIZE)/report.* 2>/dev/null; exit $$status

clean:
	rm -rf $(VENV) build native/build src/*.egg-info
