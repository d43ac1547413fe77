# tf_sfctr developer commands. `make demo` and `make test` work on a fresh
# machine: they create .venv with the pinned stack, build the op library and
# reuse both when already there.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
CXX ?= g++
CORE_SRCS := $(wildcard ops/core/*.cc)
OP_SRCS := $(wildcard ops/*.cc ops/kernels/*.cc) $(CORE_SRCS)
PY_SRCS := setup.py $(wildcard tf_sfctr/*.py keras_layers/*.py)

.PHONY: all venv build test test-core test-core-sanitize test-py lint demo bench bench-tiny bench-core clean

all: build

# Fall back to python3 when python3.11 is not on PATH.
ifeq (, $(shell command -v $(PYTHON) 2> /dev/null))
PYTHON := python3
endif

$(VENV)/.installed: constraints.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade "pip<25"
	$(PIP) install --quiet -c constraints.txt -r requirements-dev.txt
	touch $@

# Horovod (distributed tests, horovodrun) is built from source against the
# installed TensorFlow, with Gloo only; its bundled gloo needs cmake < 4.
$(VENV)/.horovod: $(VENV)/.installed
	$(PIP) install --quiet -c constraints.txt "cmake<4"
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 \
	  HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
	  MAKEFLAGS=-j2 $(PIP) install --quiet --no-build-isolation -c constraints.txt horovod==0.28.1
	touch $@

venv: $(VENV)/.installed $(VENV)/.horovod

tf_sfctr/_sfctr_ops.so: $(VENV)/.installed $(VENV)/.horovod $(OP_SRCS) $(wildcard ops/core/*.h ops/kernels/*.h) setup.py
	$(PIP) install --quiet --no-build-isolation --no-deps -e .
	touch $@

build: tf_sfctr/_sfctr_ops.so

# The TF-free core has its own unit tests (no TensorFlow needed).
build/core_test: $(CORE_SRCS) $(wildcard ops/core/*.h ops/core/tests/*)
	mkdir -p build
	$(CXX) -std=c++17 -O2 -ffp-contract=off -Wall -Wextra -pthread -o $@ ops/core/tests/core_test.cc $(CORE_SRCS)

test-core: build/core_test
	./build/core_test

# The same tests under AddressSanitizer + UndefinedBehaviorSanitizer and under
# ThreadSanitizer (the store's fetch and commit run on two threads); any
# report fails the run.
SAN_FLAGS := -std=c++17 -O1 -g -fno-omit-frame-pointer -ffp-contract=off -Wall -Wextra -pthread
build/core_test_asan: $(CORE_SRCS) $(wildcard ops/core/*.h ops/core/tests/*)
	mkdir -p build
	$(CXX) $(SAN_FLAGS) -fsanitize=address,undefined -fno-sanitize-recover=all -o $@ \
	  ops/core/tests/core_test.cc $(CORE_SRCS)

build/core_test_tsan: $(CORE_SRCS) $(wildcard ops/core/*.h ops/core/tests/*)
	mkdir -p build
	$(CXX) $(SAN_FLAGS) -fsanitize=thread -o $@ ops/core/tests/core_test.cc $(CORE_SRCS)

# Without address randomization (setarch -R, this process only, where it
# exists): GCC 12's sanitizers abort at start on kernels whose
# vm.mmap_rnd_bits is 32 (google/sanitizers#1716).
NO_ASLR := $(shell command -v setarch >/dev/null 2>&1 && setarch $$(uname -m) -R true 2>/dev/null && echo setarch $$(uname -m) -R)

test-core-sanitize: build/core_test_asan build/core_test_tsan
	ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 $(NO_ASLR) ./build/core_test_asan
	TSAN_OPTIONS=halt_on_error=1 $(NO_ASLR) ./build/core_test_tsan

test-py: build
	$(PY) -m pytest -q --durations=25 tests

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check tf_sfctr keras_layers tests bench examples setup.py

test: test-core test-core-sanitize lint test-py

demo: build
	$(PY) examples/movielens.py

# Benchmarks (not tests): side-by-side ratios, written to bench/RESULTS.md.
# The peers are optional extras installed here, not for the tests.
$(VENV)/.bench: $(VENV)/.installed
	# --no-deps: both would otherwise pull the full tensorflow wheel over
	# tensorflow-cpu.
	$(PIP) install --quiet --no-deps -c constraints.txt tf_keras==2.16.0 \
	  tensorflow-recommenders-addons==0.8.1
	touch $@

bench: build $(VENV)/.bench
	$(PY) bench/run_all.py --out bench/RESULTS.md

bench-tiny: build
	$(PY) bench/run_all.py --tiny

clean:
	rm -rf build tf_sfctr/_sfctr_ops.so tf_sfctr/_build_info.json *.egg-info

# The C++ cache path alone (no TensorFlow): prepare + write-back per batch.
build/prepare_bench: $(CORE_SRCS) $(wildcard ops/core/*.h) bench/core/prepare_bench.cc
	mkdir -p build
	$(CXX) -std=c++17 -O3 -Wall -Wextra -pthread -o $@ bench/core/prepare_bench.cc $(CORE_SRCS)

bench-core: build/prepare_bench
	./build/prepare_bench
