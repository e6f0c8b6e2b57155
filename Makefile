.PHONY: setup test lint typecheck pytest

setup:
	./setup.sh

# The test command: lint, strict type check, then the test suite.
test: lint typecheck pytest

lint:
	.venv/bin/ruff check src tests
	.venv/bin/ruff format --check src tests

typecheck:
	.venv/bin/mypy src

# pytest exits 5 when it collected nothing: treated as a failure, never as a pass.
pytest:
	@.venv/bin/pytest -q; status=$$?; \
	if [ $$status -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi; exit $$status
