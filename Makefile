# NanoEuler entry points. PYTHON=... picks the interpreter.
PYTHON ?= python3
export PIP_ROOT_USER_ACTION := ignore
PIP := $(PYTHON) -m pip install -q --disable-pip-version-check

.PHONY: all setup setup-test warm check test train train-medium bench speedrun data clean

all: warm                                  # `make`: install, then compile every Numba kernel into the cache

setup:
	$(PIP) -r requirements.txt

setup-test: setup                          # test-only tools; the NVRTC wheel lets CI compile the CUDA kernels
	$(PIP) pytest pytest-xdist hypothesis duckdb matplotlib nvidia-cuda-nvrtc-cu12  # matplotlib: the plot test of test_evaluate.py; xdist: two workers
	$(PIP) "torch==2.13.0+cpu" transformers  # test_export.py loads the exports in transformers (CPU wheel, not CUDA's)
	$(PIP) llama-cpp-python || echo "llama-cpp-python did not build: the llama.cpp test of test_export.py will skip"  # compiles llama.cpp once (~5 min), cached by pip after
	$(PIP) openai playwright               # test_serve.py: the OpenAI client, and Playwright to drive Debian's chromium (it downloads no browser)
	test -x /usr/bin/chromium || ! command -v apt-get > /dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
		|| (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
		|| echo "chromium did not install: the chat page test of test_serve.py will skip"

warm: setup
	$(PYTHON) gradcheck.py all > /dev/null  # float64 kernels
	$(PYTHON) nanoeuler.py bench --steps 1  # float32 kernels

check: setup                               # every backward against float64 finite differences
	$(PYTHON) gradcheck.py all

test: setup-test                           # two workers: the suite's subprocesses keep both of CI's cores busy
	$(PYTHON) -m pytest -q -n 2

mutation: setup-test                       # plant bugs one at a time: which ones do the tests miss?
	$(PYTHON) mutate.py

train: setup                               # the small model on the embedded default corpus (no download)
	$(PYTHON) nanoeuler.py train

train-medium: setup                        # the ~10M config on the embedded corpus
	$(PYTHON) nanoeuler.py train medium

bench: setup
	$(PYTHON) nanoeuler.py bench

speedrun: setup                            # data to a chat model and its REPORT.md in one command; ARGS="--budget-minutes 10"
	$(PYTHON) speedrun.py $(ARGS)

# corpora -> data/pretrain.txt (books + web) -> the 4096 tokenizer and the uint16 token file
data: data/pretrain.bin data/alpaca.json data/prefs.jsonl
data/gutenberg.txt:
	bash data/get_gutenberg.sh
data/web.txt:
	bash data/get_web.sh 100
data/alpaca.json:
	bash data/get_alpaca.sh
data/prefs.jsonl:
	bash data/get_prefs.sh
data/pretrain.txt: data/gutenberg.txt data/web.txt
	cat data/gutenberg.txt data/web.txt > data/pretrain.txt.tmp && mv data/pretrain.txt.tmp data/pretrain.txt
data/pretrain.bpe: data/pretrain.txt
	$(PYTHON) bpe.py train data/pretrain.txt --vocab 4096 -o data/pretrain.bpe
data/pretrain.bin: data/pretrain.bpe
	$(PYTHON) bpe.py encode data/pretrain.bpe data/pretrain.txt -o data/pretrain.bin

clean:
	rm -rf __pycache__ .pytest_cache data/cache
