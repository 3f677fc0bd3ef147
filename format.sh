#!/usr/bin/env bash
# Format and lint the whole tree (configuration in pyproject.toml). Exits non-zero on a lint error.
set -euo pipefail
cd "$(dirname "$0")"
ruff format .
ruff check --fix .
