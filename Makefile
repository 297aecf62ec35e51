# The two commands of the quick start are `make run` and `make test`; both set up what is missing.
PRESET ?= release
BUILD := build/$(PRESET)
HEADROOM := $(BUILD)/headroom
ARGS ?=
FUZZ_SECONDS ?= 30

.PHONY: setup build run test bench fuzz format clean reference

setup:
	@scripts/setup

build: setup
	@cmake --preset $(PRESET) >/dev/null
	@cmake --build --preset $(PRESET)

# Trains the default model (gpt2-tiny) on the default corpus (Debian's fortunes).
run: build
	$(HEADROOM) train $(ARGS)

test: build
	ctest --preset $(PRESET)

bench: build
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
