# kiln — the user's entry points. `make sft` runs the pipeline on its offline default (MODEL=tiny);
# `make test` runs the whole test suite (on burn's fused CubeCL backend too, where a Vulkan driver is
# installed) and checks that the CUDA build still compiles.

MODEL ?= tiny
# Epochs: the model config's, else the pipeline's (pipelines/sft.toml: 2) unless given.
EPOCHS ?=
RUN ?= $(MODEL)
# Model-config keys for this run, space-separated KEY=VALUE (kiln sft --set): SET="train.lr=1e-5 data.seq_len=4096".
SET ?=
# A checkpoint folder to fine-tune instead of MODEL's own model (kiln sft --base): BASE=runs/tiny/best RUN=tiny-2.
BASE ?=
# A Hub repo to push the selected checkpoint to at the end (publish_repo, push = true; HF_TOKEN with write access).
PUSH ?=
CARGO ?= cargo
KILN := target/release/kiln
SFT = $(KILN) sft --model $(MODEL) --run $(RUN)$(if $(EPOCHS), --epochs $(EPOCHS))$(if $(BASE), --base '$(BASE)')$(if $(SET), $(foreach s,$(SET),--set '$(s)'))$(if $(PUSH), --set 'publish_repo=$(PUSH)' --set push=true)

# Build with burn's CUDA backend where a GPU driver or toolkit is present, else CPU only.
ifneq ($(shell command -v nvcc 2>/dev/null || ls /usr/lib/x86_64-linux-gnu/libcuda.so* 2>/dev/null | head -n1),)
FEATURES ?= --features cuda
endif

SAMPLES := datasets/samples

.PHONY: sft build plan inspect eval card chat samples test bench gpu-carry clean

build:
	$(CARGO) build --release $(FEATURES)

# The whole pipeline (pipelines/sft.toml): pull → prepare → inspect → train → export → eval → select → card
# (→ push, with PUSH=owner/name) into runs/$(RUN)/. Re-running skips finished stages and resumes an
# interrupted training. MODEL=tiny (the default) needs no network and no GPU; a GPU-sized MODEL stops at once
# on a machine without one.
sft: build
	@test -f $(SAMPLES)/terminal.parquet || $(KILN) synth --out $(SAMPLES)
	$(SFT)

# What `make sft` with the same settings would run and skip, and why (kiln sft --dry-run): nothing is run or
# written; the plan as JSON on stdout (`make -s plan > plan.json` leaves make's own echo out of it).
plan: build
	$(SFT) --dry-run

# The dataset inspection report of a prepared run (runs/$(RUN)/report/index.html).
inspect: build
	$(SFT) --until inspect

# Evaluate and select (everything before them runs first if it has not).
eval: build
	$(SFT) --until select

# The model card of a run (runs/$(RUN)/README.md).
card: build
	$(KILN) card --run runs/$(RUN)

# Talk with a run's selected checkpoint (runs/$(RUN)/best, kiln chat): a line is a message, /reset starts
# over, /exit ends; on the GPU in a CUDA build.
chat: build
	$(KILN) chat --model-dir runs/$(RUN)/best --device $(if $(FEATURES),cuda,cpu)

# Regenerate the committed synthetic samples and the offline models' tokenizer (both deterministic: the
# result must equal what is committed; tests check it).
TINY_MODELS := tiny-qwen3.5 tiny-gemma4 tiny-moe
samples: build
	$(KILN) synth --out $(SAMPLES)
	$(KILN) --quiet ingest --dataset terminal-synth,toolbench-synth --out runs/samples
	$(KILN) tokenizer --data runs/samples/conversations.jsonl --out configs/models/tiny
	for m in $(TINY_MODELS); do cp configs/models/tiny/tokenizer.json configs/models/tiny/tokenizer_config.json configs/models/$$m/; done

# One test at a time: burn's CPU backend, driven from several threads at once, was seen to return wrong
# gradients for its composed backward passes now and then (2 runs in 40 of the unit tests; none in 80 run
# serially). kiln drives burn from one thread (burn-flex and kiln's CPU attention use rayon inside their
# ops); the tests do the same. It costs about 45 s.
# With a Vulkan driver present the suite is built with the `vulkan` feature, and tests/vulkan_backend.rs runs
# kiln on burn's fused CubeCL backend (the code CUDA runs) against transformers, PyTorch and the CPU; Mesa's
# lavapipe is such a driver on a machine without a GPU (apt-get install mesa-vulkan-drivers; .ci/run
# installs it). Mesa wants a runtime directory, so one is made where the session has none.
VULKAN_DRIVERS := $(wildcard /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json)
TEST_FEATURES ?= $(if $(VULKAN_DRIVERS),--features vulkan)
test:
	$(if $(TEST_FEATURES),,@echo "note: no Vulkan driver here, so the fused-backend tests (tests/vulkan_backend.rs) are left out; apt-get install mesa-vulkan-drivers runs them on the CPU" >&2)
	XDG_RUNTIME_DIR=$${XDG_RUNTIME_DIR:-$$(mktemp -d)} $(CARGO) test --all-targets $(TEST_FEATURES) -- --test-threads=1
	$(CARGO) check --all-targets --features cuda

# Benchmarks (figures go to docs/BENCHMARKS.md): prepare throughput, kiln vs transformers (terminal
# trajectories, and function-calling rows); the report's checks of ToolBench-form calls; a training step,
# kiln vs transformers + PyTorch on the same device (cuda shapes where a GPU is present, tiny ones on the CPU);
# `kiln chat` turn by turn with and without the states earlier turns kept (an LFM2-350M-shaped model).
bench: build
	KILN=$(KILN) tests/bench/prepare.sh
	KILN=$(KILN) tests/bench/function_calls.sh
	KILN=$(KILN) tests/bench/toolbench_calls.sh
	KILN=$(KILN) tests/bench/train.sh
	KILN=$(KILN) tests/bench/chat.sh

# The CUDA build packed for a GPU machine without a toolchain (tests/bench/gpu_session.sh unpacks it there):
# the stripped binary is ~105 MB, over what the device tool carries (64 MiB); xz -9 brings it to ~19 MB (gzip
# -9: 30 MB), so the build with burn's autotune fits beside it and the kernel cache.
# Without nvcc, cudarc binds the newest CUDA API it knows (13.4); the GPU machines' driver (580) has 13.0's,
# so the carried build binds that one (the H200 session of 2026-11-26 ran such a build).
# GPU_FEATURES=autotune builds burn's autotune in (see Cargo.toml: its first steps compile ~10 kernels a matmul
# shape) as gpu/kiln-autotune.xz, in a target directory of its own so that neither build undoes the other.
GPU_FEATURES ?= cuda
# The models whose random-init base the GPU session's pipeline stage builds on the device (PIPELINE_MODELS):
# each one's shape, template and packed tokenizer as gpu/from-<model> (tests/bench/base_source.sh; needs ../shared).
GPU_BASES ?= qwen3.5-0.8b
GPU_VARIANT := $(if $(filter autotune,$(GPU_FEATURES)),-autotune)
GPU_CARRY := gpu/kiln$(GPU_VARIANT).xz
GPU_TARGET := target$(if $(GPU_VARIANT),/autotune)
gpu-carry: export CUDARC_CUDA_VERSION ?= 13000
gpu-carry:
	CARGO_TARGET_DIR=$(GPU_TARGET) $(CARGO) build --release --features $(GPU_FEATURES)
	mkdir -p gpu
	xz -9 -c $(GPU_TARGET)/release/kiln > $(GPU_CARRY).partial && mv $(GPU_CARRY).partial $(GPU_CARRY)
	for model in $(GPU_BASES); do tests/bench/base_source.sh $$model gpu/from-$$model || exit 1; done
	@# Which source the binary is, for a later session deciding whether to rebuild it.
	@git describe --always --dirty > $(GPU_CARRY).commit 2>/dev/null || true
	@size=$$(du -cb gpu | tail -1 | cut -f1); echo "$(GPU_CARRY): $$(wc -c < $(GPU_CARRY)) bytes, from $$(cat $(GPU_CARRY).commit 2>/dev/null); gpu/ holds $$size bytes"; \
	    test $$size -lt 67108864 || { echo "gpu/ is over 64 MiB: the device tool cannot carry it (remove what the session does not need)" >&2; exit 1; }

clean:
	$(CARGO) clean
	rm -rf runs
