# The two commands of the quick start are `make run` and `make test`; both set up what is missing.
PRESET ?= release
BUILD := build/$(PRESET)
HEADROOM := $(BUILD)/headroom
ARGS ?=
FUZZ_SECONDS ?= 30
PREFIX ?= /usr/local

.PHONY: setup configure build run test bench fuzz format clean reference install build-cuda test-cuda

setup:
	@scripts/setup

configure: setup
	@cmake --preset $(PRESET) >/dev/null

# Everything: the executable, every test and every benchmark.
build: configure
	@cmake --build --preset $(PRESET)

# Trains the default model (bytes-tiny) on the default corpus (Debian's fortunes). Builds the
# headroom executable only (about 70 of the build's steps), not the tests and benchmarks.
run: configure
	@cmake --build --preset $(PRESET) --target headroom
	$(HEADROOM) train $(ARGS)

# Builds what ctest runs (all_tests: the test programs and the executable, no benchmarks).
test: configure
	@cmake --build --preset $(PRESET) --target all_tests
	ctest --preset $(PRESET)

# Installs the executable, the engine (static libraries, headers, a CMake package for
# find_package(headroom)) and the data files into PREFIX (docs/notes/install.md).
install: configure
	@cmake --build --preset $(PRESET) --target headroom
	cmake --install $(BUILD) --prefix $(PREFIX)

# The CUDA build (build/cuda: nvcc from /usr/local/cuda, sm_80 and sm_90; docs/notes/cuda.md):
# the executable and the CUDA tests. It compiles and links without a GPU; the tests skip, saying
# why, when none is present.
build-cuda: setup
	@cmake --preset cuda >/dev/null
	@cmake --build --preset cuda --target cuda_all_tests

test-cuda: build-cuda
	ctest --preset cuda

bench: configure
	@cmake --build --preset $(PRESET) --target gemm_bench
	$(BUILD)/gemm_bench

# Builds the libFuzzer targets of the file readers with clang (build/fuzz) and runs each for
# FUZZ_SECONDS seconds; fails on a crash (docs/notes/fuzzing.md).
fuzz: setup
	@cmake --preset fuzz >/dev/null
	@cmake --build --preset fuzz
	FUZZ_SECONDS=$(FUZZ_SECONDS) fuzz/run.sh

format:
	clang-format -i $$(git ls-files '*.h' '*.cc')

# Regenerates the golden fixtures with PyTorch (needs Debian's python3-torch).
reference:
	/usr/bin/python3 tools/reference/gpt2_reference.py
	/usr/bin/python3 tools/reference/llama_reference.py

clean:
	rm -rf build
