# kiln — the user's entry points. `make sft` runs the pipeline on its offline default (MODEL=tiny);
# `make test` runs the whole test suite and checks that the CUDA build still compiles.

MODEL ?= tiny
EPOCHS ?= 2
RUN ?= $(MODEL)
CARGO ?= cargo
KILN := target/release/kiln

# Build with burn's CUDA backend where a GPU driver or toolkit is present, else CPU only.
ifneq ($(shell command -v nvcc 2>/dev/null || ls /usr/lib/x86_64-linux-gnu/libcuda.so* 2>/dev/null | head -n1),)
FEATURES ?= --features cuda
endif

SAMPLES := datasets/samples

.PHONY: sft build samples test bench clean

build:
	$(CARGO) build --release $(FEATURES)

# The stages implemented so far: pull (Hub sources; none for the offline default) and ingest
# (normalized, decontaminated conversations). Later stages join as they land (see README's stage table).
sft: build
	@test -f $(SAMPLES)/terminal.parquet || $(KILN) synth --out $(SAMPLES)
	$(KILN) ingest --dataset terminal-synth,toolbench-synth \
		--decontaminate $(SAMPLES)/replay.jsonl --decontaminate $(SAMPLES)/terminal_heldout.jsonl \
		--out runs/$(RUN)/data

# Regenerate the committed synthetic samples (deterministic: the result must equal what is committed).
samples:
	$(CARGO) run --release -- synth --out $(SAMPLES)

test:
	$(CARGO) test --all-targets
	$(CARGO) check --all-targets --features cuda

bench:
	@echo "no benchmarks yet: the trainer issue adds them"; exit 1

clean:
	$(CARGO) clean
	rm -rf runs
