.PHONY: setup demo test check lint typecheck docs pytest dist

# Every target that runs keel runs the set-up first: seconds, and no registry, when nothing
# changed since the last one (setup.sh keeps a stamp of what it installed in .venv).
setup:
	@./setup.sh

# The main job on the embedded default: the flight-booking agent, killed and resumed.
demo: setup
	.venv/bin/keel demo

# The wheel and the sdist of keel-runtime into dist/ (git-ignored), built offline with the build
# frontend and the hatchling that the set-up installed.
dist: setup
	rm -rf dist
	.venv/bin/python -m build --no-isolation --outdir dist .

# The test command: the set-up, then lint, strict type check, the documentation site, the tests.
test: setup
	@$(MAKE) --no-print-directory check

check: lint typecheck docs pytest

lint:
	.venv/bin/ruff check src tests
	.venv/bin/ruff format --check src tests
	.venv/bin/lint-imports

typecheck:
	.venv/bin/mypy src

# The documentation site, strict (a broken link or a missing API reference fails), offline: a
# dead proxy makes any download a plugin might try fail the build instead of reaching out.
docs:
	HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 NO_PROXY= NO_MKDOCS_2_WARNING=1 \
		.venv/bin/mkdocs build --strict

# pytest exits 5 when it collected nothing: treated as a failure, never as a pass. Two test
# processes (pytest-xdist), each test file whole in one of them (its module and package fixtures
# built once); each process starts its own PostgreSQL and Redis. The random order's seed is
# printed first: `.venv/bin/pytest -n 2 --dist loadfile -p randomly --randomly-seed=N` replays it.
pytest:
	@.venv/bin/pytest -q -n 2 --dist loadfile; status=$$?; \
	if [ $$status -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi; exit $$status
