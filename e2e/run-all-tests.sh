#!/usr/bin/env bash
# Every test of the project, from a fresh clone: installs what it needs (a Python venv with
# the reference stack), then formatting, lints, the Rust test suites, and the live checks
# against independent implementations (transformers, gguf) on freshly random inputs.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '\n==== %s ====\n' "$*"; }

step "python reference stack (.venv)"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check -r e2e/requirements.txt -r e2e/requirements-quant.txt -r e2e/requirements-api.txt
export PATH="$PWD/.venv/bin:$PATH"

step "rustfmt"
cargo fmt --all -- --check

step "clippy"
cargo clippy --workspace --all-targets -- -D warnings

step "cargo test (workspace)"
cargo test --workspace

step "engine vs transformers on fresh random fixtures"
e2e/fixtures_check.sh

step "Q4_K / Q8_0 vs gguf on fresh random blocks"
e2e/quant_check.sh

step "OpenAI API end to end: demo served, official openai client, SIGTERM drain"
PYTHON=.venv/bin/python e2e/api_check.sh

echo
echo "all tests passed"
