# fxpipe: `make demo` and `make test` set up .venv on first use, then run.
PYTHON ?= python3
VENV ?= .venv
# The torch requirement installed first; pip resolves it with your pip configuration.
# On this project's CPU machines pip finds the local CPU wheel of 2.13.0. On a GPU
# machine point pip at your CUDA wheels, e.g.
#   make test PIP_EXTRA_INDEX_URL=<your CUDA wheel index>    (same TORCH_SPEC)
# or pick another release with TORCH_SPEC="torch==2.x.y".
TORCH_SPEC ?= torch==2.13.0
# transformers is a test dependency (the zoo, the HF examples): the release the tests were checked
# against, kept by the constraints file too, so a new release cannot change a clean run. (5.24.0
# changed GPT-2's generated mask code, which the golden stage files pin, and lifts Falcon's index
# lists as constants, which tracing on the meta device cannot read.) Raise it on purpose.
TRANSFORMERS_SPEC ?= transformers==5.23.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fxpipe-installed
CONSTRAINTS := $(VENV)/constraints.txt
DEMO_OUT ?= build/demo

.PHONY: demo test test-heavy setup clean bench typecheck zoo format

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip freeze | grep -i '^torch==' > $(CONSTRAINTS)
	echo "$(TRANSFORMERS_SPEC)" >> $(CONSTRAINTS)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[test]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -m "not heavy"

# the longest multi-process families (fault injection, FairScale ports): CI runs them after `make test`
test-heavy: $(STAMP)
	$(PY) -m pytest -q -m heavy

zoo: $(STAMP)
	FXPIPE_ZOO=full $(PY) -m pytest -q tests/zoo

format: $(STAMP)
	$(PY) -m ruff format .

typecheck: $(STAMP)
	$(PY) -m mypy fxpipe

demo: $(STAMP)
	$(PY) -m fxpipe partition examples/gpt.py --stages 2 --microbatches 4 --batch-size 8 --out $(DEMO_OUT)
	$(PY) -m fxpipe verify $(DEMO_OUT)
	$(PY) -m fxpipe run $(DEMO_OUT) --steps 5 --lr 0.5 --data examples/gpt_data.py:train_batches
	@echo
	@echo "fxpipe is installed in $(VENV): run $(VENV)/bin/fxpipe --help, or source $(VENV)/bin/activate first."
	@echo "Next: open $(DEMO_OUT)/report.html; try fxpipe partition examples/resnet.py --stages 2 --out build/resnet,"
	@echo "      fxpipe verify build/resnet, fxpipe run build/resnet --steps 20 (README: A five-minute tour)."

clean:
	rm -rf $(VENV) build .pytest_cache
