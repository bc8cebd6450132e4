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

.PHONY: sft build inspect samples test bench clean

build:
	$(CARGO) build --release $(FEATURES)

# The stages implemented so far: pull (Hub sources; none for the offline default), ingest (normalized,
# decontaminated conversations) and prepare (native template, assistant-only masks, token shards).
# Later stages join as they land (see the README's stage table).
sft: build
	@test -f $(SAMPLES)/terminal.parquet || $(KILN) synth --out $(SAMPLES)
	$(KILN) ingest --dataset terminal-synth,toolbench-synth \
		--decontaminate $(SAMPLES)/replay.jsonl --decontaminate $(SAMPLES)/terminal_heldout.jsonl \
		--out runs/$(RUN)/data
	$(KILN) prepare --model $(MODEL) --data runs/$(RUN)/data/conversations.jsonl --out runs/$(RUN)/data \
		--seq-len 2048 --date 2026-01-01
	$(KILN) inspect --run runs/$(RUN)

# The dataset inspection report of a prepared run (runs/$(RUN)/report/index.html).
inspect: build
	$(KILN) inspect --run runs/$(RUN)

# Regenerate the committed synthetic samples and the tiny model's tokenizer (both deterministic: the
# result must equal what is committed; tests check it).
samples: build
	$(KILN) synth --out $(SAMPLES)
	$(KILN) --quiet ingest --dataset terminal-synth,toolbench-synth --out runs/samples
	$(KILN) tokenizer --data runs/samples/conversations.jsonl --out configs/models/tiny

test:
	$(CARGO) test --all-targets
	$(CARGO) check --all-targets --features cuda

# Benchmarks (figures go to docs/BENCHMARKS.md): prepare throughput, kiln vs transformers.
bench: build
	KILN=$(KILN) tests/bench/prepare.sh

clean:
	$(CARGO) clean
	rm -rf runs
