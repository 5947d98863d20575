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
	@# one run's temp files (~10 GB at the peak: real-size models) under the checkout, replaced by
	@# the next run and deleted after a passing one (README "Set-up": disk)
	.venv/bin/python -m pytest -q --durations=30 --basetemp=.pytest-tmp && rm -rf .pytest-tmp

lint:
	.venv/bin/ruff check .
	.venv/bin/mypy
