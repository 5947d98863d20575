# The two set-up commands of the README. Each installs what it needs into .venv.
.PHONY: serve test lint

# Serve search over the built-in demo bundle (built once, then cached).
serve:
	@scripts/install.sh train,service
	.venv/bin/tonearm serve

# The whole test suite (what CI runs).
test:
	@scripts/install.sh train,service,milvus,ray,dev
	@scripts/ensure-redis.sh
	@scripts/ensure-container-tools.sh
	@scripts/ensure-chromium.sh
	.venv/bin/ruff check .
	.venv/bin/mypy
	@# one run's temp files under the checkout, replaced by the next run and deleted after a passing
	@# one (README "Set-up": disk); the real-size models and their exports are built once per machine
	@# into ~/.cache/tonearm/test-models ($$TONEARM_TEST_CACHE; "off": per run; tests/model_cache.py)
	@# and hard-linked from there. --slowest: the 30 slowest tests and setups with what each guards.
	@# -n 2: two workers (pytest-xdist), tests sharing a heavy resource on one (tests/conftest.py).
	@# PYTEST_ARGS: more pytest options, e.g. PYTEST_ARGS='-k milvus' or '--junitxml=FILE'.
	@# (directories made writable first: with TONEARM_TEST_CACHE=off the read-only entries are in it)
	.venv/bin/python -m pytest -q -n 2 --dist loadscope --slowest=30 --basetemp=.pytest-tmp $(PYTEST_ARGS) \
		&& find .pytest-tmp -type d -exec chmod u+w {} + && rm -rf .pytest-tmp

lint:
	.venv/bin/ruff check .
	.venv/bin/mypy
