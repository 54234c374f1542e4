# Two commands do all the set-up on a fresh machine: `make campaign` and `make test`.
# The virtual environment is made once and reinstalled only when pyproject/constraints change.
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export DVC_NO_ANALYTICS := 1
export GLOO_SOCKET_IFNAME := lo
export MASTER_ADDR := 127.0.0.1

.PHONY: setup campaign test test-fast bench schema screenshots docs docs-build clean-runs

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,lightning,transformers]'
	touch $(STAMP)

setup: $(STAMP)
	@# The project's own modules compiled ahead (only those changed since): where the environment
	@# sets PYTHONDONTWRITEBYTECODE (this kind of machine does), every process a campaign or the
	@# suite starts (~1,000 in `make test`) compiled them again, ~0.1 s of CPU each.
	$(PY) -m compileall -q flows tasks training cluster tests

# The default campaign in params.yaml, through DVC: data stage, then the campaign stage.
# A second run is a no-op when nothing changed; a killed run resumes from its checkpoints.
campaign: setup
	dvc repro

# Three workers on the two cores: the end-to-end tests wait on processes they start as much
# as they compute (27 min in one worker, 18–20 with three). Each worker has its own lease
# store, Prefect harness, Prefect server for the campaigns its slow tests launch, and temporary
# folders (tests/conftest.py keys them by process). Tests are handed out one at a time, in the
# order tests/conftest.py sets (slow first, the pool's waiting tests spread among them, fast
# last), to whichever worker frees up: no worker starts a long test after the others have ended.
XDIST := -n 3 --dist load --maxschedchunk 1
# One thread per process, as every trainer runs (training/launch.py): three workers share two
# cores, and torch's threads in a test process only wait on each other there.
TEST_ENV := OMP_NUM_THREADS=1

# The documentation site is built first (seconds): a broken link or a missing page fails the
# suite before its minutes; pytest's exit code is then the target's.
test: setup docs-build
	$(TEST_ENV) $(PY) -m pytest -q $(XDIST) --durations=25

# The same without the slow end-to-end tests (real campaigns, torchrun, elastic trials).
test-fast: setup
	$(TEST_ENV) $(PY) -m pytest -q $(XDIST) -m "not slow"

bench: setup
	$(PY) bench/packing_bench.py
	$(PY) bench/scheduler_bench.py --jobs 160 --seeds 1 --heavy 0   # one workload; the full eight take hours (Pollux's search)
	$(PY) bench/profile_bench.py

# The README's pictures (docs/images/*.png: the live table, the Prefect artifact, curves.png, the
# MLflow view), taken by the browser test from the campaign it runs: run it, look at them, commit them.
screenshots: setup
	CAMPAIGN_SCREENSHOTS=docs/images $(TEST_ENV) $(PY) -m pytest -q tests/test_ui.py

# The JSON Schema of params.yaml (schema/params.schema.json, for editors), from training/spec.py's
# models: run after changing one (tests/test_spec_schema.py fails until then), and commit it.
schema: setup
	$(PY) -m training.spec_schema --write

# The documentation site (MkDocs Material, mkdocs.yml): `make docs` serves it on 127.0.0.1:8000 and
# rebuilds on each change; `make docs-build` builds it into site/ with --strict, so a broken link,
# anchor or missing page is an error. The spec and CLI references are generated from the code.
# (--quiet would hide the warnings --strict counts; NO_MKDOCS_2_WARNING: Material's banner about its successor.)
DOCS_ENV := NO_MKDOCS_2_WARNING=1

docs: setup
	$(DOCS_ENV) $(PY) -m mkdocs serve

docs-build: setup
	$(DOCS_ENV) $(PY) -m mkdocs build --strict

clean-runs:
	rm -rf checkpoints metrics mlflow.db mlruns data/digits.npz
