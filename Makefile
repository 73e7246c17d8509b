# kvq: `make demo` and `make test` do all the set-up on a fresh machine with Python and pip.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvq-setup
LATEST ?= .venv-triton-latest
TFLOW  ?= .venv-tf-lowest

.PHONY: setup demo test battery test-triton-latest test-transformers-lowest test-reference test-parity gpu-test book browser-test bench results clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[fast,viz,book,hf,test,browser]"
	touch $(STAMP)

setup: $(STAMP)                        ## virtualenv .venv with kvq and its CPU dependencies

# The demo needs NumPy only: kvq alone in its own virtualenv (seconds to install, not the test set-up's GBs).
DEMO   ?= .venv-demo
$(DEMO)/.kvq-setup: pyproject.toml
	$(PYTHON) -m venv $(DEMO)
	$(DEMO)/bin/python -m pip install -q --upgrade pip
	$(DEMO)/bin/python -m pip install -q -e .
	touch $@

demo: $(DEMO)/.kvq-setup               ## the main demo (CPU, NumPy reference; `.venv/bin/kvq demo` adds the GPU tier)
	$(DEMO)/bin/kvq demo

test: $(STAMP)                         ## CPU test suite: reference, Triton via interpreter, nvcc compile, the battery
	@echo "make test: the CPU suite, about 20 minutes on 2 cores (the slow parts: the nvcc compiles of"
	@echo "  tests/fast/test_cuda_compile.py, a few minutes, each on its own line 'nvcc <source> ... <seconds> s';"
	@echo "  Triton's interpreter; the battery). The 10 slowest tests are listed at the end."
	$(BIN)/python -m pytest -m "not gpu and not browser" -q --durations=10

battery: $(STAMP)                      ## the bad-input battery alone, and its figures (make test runs it too)
	KVQ_BATTERY_FIGURES=battery-figures.json $(BIN)/python -m pytest tests/battery -m battery -q -p no:randomly; \
	  rc=$$?; $(BIN)/python tests/battery/report.py battery-figures.json --markdown; exit $$rc

# The same torch and test tools as .venv (constraints.txt without its triton line), then the newest Triton
# pip finds (--no-deps: even where a torch wheel pins another); kvq's Triton kernels must work with both.
$(LATEST)/.kvq-setup: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	grep -v '^triton' constraints.txt > $(LATEST)/constraints.txt
	$(LATEST)/bin/python -m pip install -q -c $(LATEST)/constraints.txt -e ".[fast,test]"
	$(LATEST)/bin/python -m pip install -q --upgrade --no-deps triton
	touch $@

test-triton-latest: $(LATEST)/.kvq-setup  ## the CPU tests that run Triton (interpreter), with the newest Triton
	$(LATEST)/bin/python -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
	$(LATEST)/bin/python -m pytest tests/parity tests/fast -m "not gpu and not nvcc" -q -p no:cacheprovider

# The same torch and test tools as .venv, with the lowest transformers pyproject's hf extra allows
# (constraints-transformers-lowest.txt); `make test` runs the newest (constraints.txt does not pin it).
TF_TESTS := tests/integrations tests/battery/test_hf_battery.py tests/test_calibration_files.py \
            tests/test_calibration_validation.py tests/test_evaluation.py tests/test_train_tiny_lm.py \
            tests/test_cli_bad_input.py tests/test_cli_bench_e2e.py tests/test_cli_figures_bench.py
$(TFLOW)/.kvq-setup: pyproject.toml constraints.txt constraints-transformers-lowest.txt
	$(PYTHON) -m venv $(TFLOW)
	$(TFLOW)/bin/python -m pip install -q --upgrade pip
	grep -v '^transformers' constraints.txt > $(TFLOW)/constraints.txt
	cat constraints-transformers-lowest.txt >> $(TFLOW)/constraints.txt
	$(TFLOW)/bin/python -m pip install -q -c $(TFLOW)/constraints.txt -e ".[fast,hf,viz,test]"
	touch $@

test-transformers-lowest: $(TFLOW)/.kvq-setup  ## the tests that use transformers, with the lowest supported transformers
	$(TFLOW)/bin/python -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
	$(TFLOW)/bin/python -m pytest $(TF_TESTS) -m "not gpu and not browser" -q -p no:cacheprovider

test-reference: $(STAMP)
	$(BIN)/python -m pytest tests/reference -q

test-parity: $(STAMP)
	$(BIN)/python -m pytest tests/parity -m "not gpu" -q

gpu-test:                              ## on a CUDA machine: every parity test on the GPU
	$(PYTHON) -m pytest -m gpu -q

book: $(STAMP)                         ## build the Jupyter Book with execution (fails on a cell error)
	$(BIN)/jupyter-book build book --warningiserror --keep-going

browser-test: $(STAMP)                 ## headless Chromium over the built book (run `make book` first)
	$(BIN)/python -m pytest -m browser tests/browser -v --tb=short

bench:                                 ## on a CUDA machine, `make bench CARD=h100`: the suite's latest run into benchmarks/results/$(CARD)/
	$(PYTHON) benchmarks/run_all.py --out benchmarks/results/$(or $(CARD),$(error name the card: make bench CARD=h100))

results: $(STAMP)                      ## docs/results.md and README.md's method table, from benchmarks/results/<card>/*.json
	$(BIN)/python benchmarks/results_page.py

clean:
	rm -rf $(VENV) $(LATEST) $(TFLOW) $(DEMO) book/_build .pytest_cache .hypothesis
