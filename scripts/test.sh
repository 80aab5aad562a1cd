#!/usr/bin/env bash
# The project's test command (README.md): static checks, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check gym_ray tests
mypy gym_ray
python -m pytest -q -p no:cacheprovider "$@"
