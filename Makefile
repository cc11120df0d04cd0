# The two commands a fresh machine needs: `make demo` and `make test`.
# Every target runs `setup` first (idempotent, fast when nothing changed).

VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Two workers (pytest-xdist), each file's tests kept together on one: most tests wait on
# processes and disks, so two run in the time of one and a bit. PYTEST_WORKERS= runs serially.
PYTEST_WORKERS ?= -n 2 --dist loadfile

.PHONY: setup test demo check bench clean gpu-bundle

setup:
	@bash scripts/setup.sh

# pytest exits 5 when it collected no tests: that is a failure here, and said so.
test: setup
	@$(PY) -m pytest $(PYTEST_WORKERS) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5) - failing" >&2; exit 1; fi; \
	exit $$rc

demo: setup
	$(VENV)/bin/aiopersist doctor .
	HF_HUB_OFFLINE=1 $(VENV)/bin/aiopersist demo-trainer --dir .demo-data/trainer
	$(VENV)/bin/aiopersist demo --dir .demo-data/engine --size-mib 512

check: setup
	$(VENV)/bin/ruff check aiopersist tests integrations setup.py
	$(VENV)/bin/mypy
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

bench: setup
	$(VENV)/bin/aiopersist bench raw --dir bench-data
	$(VENV)/bin/aiopersist bench save --dir bench-data --plot bench-data/save.png
	$(VENV)/bin/aiopersist bench load --dir bench-data --plot bench-data/load.png
	$(VENV)/bin/aiopersist bench train --dir bench-data

# Everything the lent GPU machine lacks for scripts/gpu-check.sh (docs/development.md).
gpu-bundle: setup
	@bash scripts/gpu-bundle.sh

clean:
	rm -rf build site bench-data .demo-data *.egg-info aiopersist/_native/_liburing*.so \
		.gpu-bundle .gpu-bundle-dry gpu-check-out
