#!/usr/bin/env bash
# End-to-end suite for the operator against a real cluster (kind, k3s, or a GPU cluster).
#
#   KUBECONFIG=...  e2e/operator/run.sh
#
# Skips (exit 0, with the reason printed) when KUBECONFIG is not set. See e2e/README.md.
#
#   GLMFLASH_E2E_GPU=1        keep the GPU request and RTX 3090 product label (default: off,
#                             the CPU switch: spec.placement.requireGpu=false, any node)
#   GLMFLASH_E2E_NODE_IMAGE   image for the pack-store Job and server (default busybox:1.36,
#                             which cannot run pack-store: the suite then proves the failure
#                             path; set the real glmflash-node image to go all the way)
#   GLMFLASH_E2E_FULL=1       with the real image and model: wait for phase Running and call
#                             the OpenAI API through the Service
#   GLMFLASH_E2E_NAMESPACE    namespace to use (default glmflash-e2e, created and deleted)
#
# Besides one object's life (placement, pack-store Job, server, drift, deletion) it scales
# the object to one replica more than the cluster has nodes (each placed replica on its own
# node, the last one saying why it has none) and back, and hibernates and wakes it by
# annotation.
#
# The operator runs locally as the chart's service account (the chart's RBAC, applied from
# `helm template`, with a token from `kubectl create token`), so a missing permission fails
# here. On a cluster without a controller manager (a bare kube-apiserver + etcd: no Job
# controller, no garbage collector) the checks that need one are skipped, and said so.
# Whatever happens, the exit prints the summary, deletes the objects while the operator
# still runs (so their finalizers are released), then the namespace and the chart's
# cluster-scoped RBAC.
set -euo pipefail

if [[ -z "${KUBECONFIG:-}" ]]; then
  echo "SKIP e2e/operator: KUBECONFIG is not set (no cluster to test against)"
  exit 0
fi

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
ns="${GLMFLASH_E2E_NAMESPACE:-glmflash-e2e}"
image="${GLMFLASH_E2E_NODE_IMAGE:-busybox:1.36}"
gpu="${GLMFLASH_E2E_GPU:-0}"
passed=0
failed=0

if ! command -v kubectl >/dev/null; then
  export PATH="$("$repo/e2e/tools/get-helm.sh"):$PATH"
fi

log() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*"; }
pass() { passed=$((passed + 1)); log "PASS $*"; }
fail() { failed=$((failed + 1)); log "FAIL $*"; }

# wait_for DESCRIPTION SECONDS COMMAND...: retries COMMAND until it succeeds.
wait_for() {
  local what="$1" limit="$2"; shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS > deadline)); then fail "$what (after ${limit}s)"; return 1; fi
    sleep 2
  done
  pass "$what"
}

jp() { kubectl -n "$ns" get gfd e2e -o "jsonpath=$1" 2>/dev/null; }
cond() { jp "{.status.conditions[?(@.type==\"$1\")].$2}"; }
phase_is() { [[ "$(jp '{.status.phase}')" == "$1" ]]; }
cond_true() { [[ "$(cond "$1" status)" == True ]]; }
has_finalizer() { [[ "$(jp '{.metadata.finalizers[0]}')" == glmflash.io/cleanup ]]; }
object_gone() { ! kubectl -n "$ns" get gfd e2e; }
jobs_gone() { [[ -z "$(kubectl -n "$ns" get jobs -l app.kubernetes.io/instance=e2e -o name)" ]]; }

skip() { log "SKIP $*"; }

operator_pid=""
rbac=""
job_controller=1
summary_done=0
summary() {
  ((summary_done)) && return
  summary_done=1
  echo "e2e-operator: $passed passed, $failed failed"
}
cleanup() {
  local rc=$?
  set +e
  summary
  # Objects first, while the operator can still release their finalizers; whatever is
  # left after that loses its finalizer by hand, so the namespace never hangs.
  kubectl -n "$ns" delete gfd --all --wait=false >/dev/null 2>&1
  local deadline=$((SECONDS + 60))
  while ((SECONDS < deadline)) && [[ -n "$(kubectl -n "$ns" get gfd -o name 2>/dev/null)" ]]; do sleep 2; done
  if [[ -n "$operator_pid" ]]; then kill "$operator_pid" 2>/dev/null; wait "$operator_pid" 2>/dev/null; fi
  for o in $(kubectl -n "$ns" get gfd -o name 2>/dev/null); do
    kubectl -n "$ns" patch "$o" --type=merge -p '{"metadata":{"finalizers":null}}' >/dev/null 2>&1
  done
  kubectl delete namespace "$ns" --wait=false >/dev/null 2>&1
  if ((!job_controller)); then
    # No namespace controller either: finish the namespace's own finalizer by hand.
    sleep 5
    kubectl get namespace "$ns" -o json 2>/dev/null |
      python3 -c 'import json,sys; n=json.load(sys.stdin); n["spec"]["finalizers"]=[]; print(json.dumps(n))' |
      kubectl replace --raw "/api/v1/namespaces/$ns/finalize" -f - >/dev/null 2>&1
  fi
  if [[ -n "$rbac" ]]; then kubectl delete -f "$rbac" --ignore-not-found >/dev/null 2>&1; rm -f "$rbac"; fi
  rm -f "${operator_kubeconfig:-}"
  if ((rc == 0 && failed > 0)); then rc=1; fi
  exit "$rc"
}
trap cleanup EXIT

log "cluster: $(kubectl config current-context)"
kubectl version >/dev/null || { echo "cannot reach the cluster in KUBECONFIG"; exit 1; }

# 1. The CRD installs and the API server enforces its CEL rules.
kubectl apply --server-side -f "$repo/crds/glmflash.io_glmflashdeployments.yaml" >/dev/null
wait_for "CRD established" 60 kubectl wait --for=condition=Established crd/glmflashdeployments.glmflash.io --timeout=5s
kubectl create namespace "$ns" >/dev/null 2>&1 || true

bad="$(sed -e 's/^  name: glm$/  name: bad/' -e "s/^  namespace: default$/  namespace: $ns/" -e 's/^  mode: nvme$/  mode: fast/' \
  "$repo/charts/glmflash/examples/glmflash-deployment.yaml")"
if out="$(kubectl apply -f - <<<"$bad" 2>&1)"; then
  fail "API server accepted mode fast with a 55Gi cap: $out"
else
  if grep -q "at least 128Gi" <<<"$out"; then pass "CEL rule rejects fast mode under 128Gi"; else fail "unexpected rejection: $out"; fi
fi

# 2. The operator runs (locally, against this cluster, as the chart's service account) and
# owns the object.
command -v helm >/dev/null || export PATH="$("$repo/e2e/tools/get-helm.sh"):$PATH"
rbac="$(mktemp)"
helm template glmflash-e2e "$repo/charts/glmflash" --namespace "$ns" \
  --show-only templates/serviceaccount.yaml --show-only templates/rbac.yaml >"$rbac"
kubectl apply -f "$rbac" >/dev/null
sa="$(awk '/^kind: ServiceAccount/ {f = 1} f && /^  name:/ {print $2; exit}' "$rbac")"
operator_kubeconfig="$(mktemp)"
server="$(kubectl config view --minify --raw -o jsonpath='{.clusters[0].cluster.server}')"
ca="$(kubectl config view --minify --raw -o jsonpath='{.clusters[0].cluster.certificate-authority-data}')"
token="$(kubectl -n "$ns" create token "$sa" --duration=2h)"
cat >"$operator_kubeconfig" <<EOF2
apiVersion: v1
kind: Config
clusters: [{name: e2e, cluster: {server: "$server", certificate-authority-data: "$ca"}}]
users: [{name: $sa, user: {token: "$token"}}]
contexts: [{name: e2e, context: {cluster: e2e, user: $sa, namespace: $ns}}]
current-context: e2e
EOF2
pass "operator runs as service account $sa with the chart's RBAC"

cargo build -q -p glmflash-operator --manifest-path "$repo/Cargo.toml"
KUBECONFIG="$operator_kubeconfig" "${CARGO_TARGET_DIR:-$repo/target}/debug/glmflash-operator" \
  --no-leader-election --http-addr 127.0.0.1:18080 \
  --watch-namespace "$ns" >"${TMPDIR:-/tmp}/glmflash-e2e-operator.log" 2>&1 &
operator_pid=$!
wait_for "operator ready" 60 curl -fsS http://127.0.0.1:18080/readyz

placement="    gpuProduct: NVIDIA-GeForce-RTX-3090"
if [[ "$gpu" != 1 ]]; then placement=$'    gpuProduct: ""\n    requireGpu: false'; fi
kubectl apply -f - >/dev/null <<EOF2
apiVersion: glmflash.io/v1alpha1
kind: GlmFlashDeployment
metadata:
  name: e2e
  namespace: $ns
spec:
  model:
    nodePath: /tmp/glmflash-e2e-model
  mode: nvme
  placement:
$placement
  memory:
    limit: 16Gi
    shmSize: 64Mi
  store:
    hostPath: /tmp/glmflash-e2e
    packRetries: 0
  image:
    repository: ${image%:*}
    tag: "${image##*:}"
EOF2

wait_for "finalizer added" 60 has_finalizer
wait_for "NodeSelected=True" 60 cond_true NodeSelected
node="$(jp '{.status.node}')"
job="$(kubectl -n "$ns" get jobs -l app.kubernetes.io/instance=e2e,app.kubernetes.io/component=pack-store -o jsonpath='{.items[0].metadata.name}' 2>/dev/null || true)"
if [[ -n "$job" ]]; then pass "pack-store Job $job created for node $node"; else fail "no pack-store Job"; fi
owner="$(kubectl -n "$ns" get job "$job" -o jsonpath='{.metadata.ownerReferences[0].kind}')"
[[ "$owner" == GlmFlashDeployment ]] && pass "Job owned by the GlmFlashDeployment" || fail "Job owner is '$owner'"
pinned="$(kubectl -n "$ns" get job "$job" -o jsonpath='{.spec.template.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchFields[0].values[0]}')"
[[ "$pinned" == "$node" ]] && pass "Job pinned to $node" || fail "Job pinned to '$pinned', status says '$node'"

# A Job controller gives the Job a pod (or a FailedCreate Event) within a minute.
job_controller=0
job="${job:-none}"
job_started() {
  [[ -n "$(kubectl -n "$ns" get pods -l "batch.kubernetes.io/job-name=$job" -o name)" ]] ||
    kubectl -n "$ns" get events --field-selector "involvedObject.name=$job" -o name | grep -q .
}
deadline=$((SECONDS + 60))
until job_started >/dev/null 2>&1; do
  if ((SECONDS > deadline)); then break; fi
  sleep 2
done
if job_started >/dev/null 2>&1; then job_controller=1; fi

if ((!job_controller)); then
  skip "no Job controller in this cluster (no pod nor Event for $job in 60s): Job and garbage-collection checks"
  [[ "$(jp '{.status.phase}')" == PackingStore ]] && pass "phase PackingStore while the Job waits" || fail "phase '$(jp '{.status.phase}')' while the Job waits"
elif [[ "${GLMFLASH_E2E_FULL:-0}" == 1 ]]; then
  wait_for "phase Running" 7200 phase_is Running
  kubectl -n "$ns" run e2e-client --rm -i --restart=Never --image=curlimages/curl:8.10.1 -- \
    curl -fsS "http://e2e.$ns.svc:30000/v1/models" | grep -q glm-5.3-flash \
    && pass "OpenAI /v1/models answers through the Service" || fail "OpenAI API not reachable"
else
  # busybox cannot run pack-store: the Job fails and the condition must say so.
  wait_for "phase Failed after the Job failed" 300 phase_is Failed
  [[ "$(cond StoreReady reason)" == PackStoreFailed ]] && pass "StoreReady reason PackStoreFailed" || fail "StoreReady reason '$(cond StoreReady reason)'"
  kubectl -n "$ns" get events --field-selector involvedObject.name=e2e -o jsonpath='{.items[*].reason}' | grep -q Failed \
    && pass "Failed event published" || fail "no Failed event"
  if kubectl -n "$ns" get deployment e2e >/dev/null 2>&1; then fail "server Deployment created without a store"; else pass "no server without a store"; fi
fi

# 3. Drift: the operator owns the server Deployment (when there is one) and reverts a scale.
if kubectl -n "$ns" get deployment e2e >/dev/null 2>&1; then
  kubectl -n "$ns" scale deployment e2e --replicas=0 >/dev/null
  replicas_back() { [[ "$(kubectl -n "$ns" get deployment e2e -o jsonpath='{.spec.replicas}')" == 1 ]]; }
  wait_for "hand-scaled server Deployment put back to 1 replica" 60 replicas_back
fi

# 4. Replicas: a second replica never shares the first one's node, and the API server
# refuses two replicas pinned to one node.
pinned2="$(sed -e 's/^  name: glm$/  name: pinned2/' -e "s/^  namespace: default$/  namespace: $ns/" \
  -e 's/^  replicas: 1$/  replicas: 2/' -e 's/^  placement:$/  placement:\n    nodeName: any/' \
  "$repo/charts/glmflash/examples/glmflash-deployment.yaml")"
if out="$(kubectl apply -f - <<<"$pinned2" 2>&1)"; then
  fail "API server accepted two replicas on placement.nodeName: $out"
elif grep -q "every replica needs its own" <<<"$out"; then
  pass "CEL rule rejects two replicas pinned to one node"
else
  fail "unexpected rejection: $out"
fi
nodes_fit="$(kubectl get nodes -o name | wc -l)"
replicas=$((nodes_fit + 1))
kubectl -n "$ns" patch gfd e2e --type merge -p "{\"spec\":{\"replicas\":$replicas}}" >/dev/null
ready_total() { [[ "$(jp '{.status.ready}')" == */"$replicas" ]]; }
wait_for "status.ready counts $replicas desired replicas" 60 ready_total
distinct_nodes() {
  local placed
  placed="$(jp '{range .status.replicas[*]}{.node}{"\n"}{end}' | sort)"
  [[ -n "$placed" && "$(uniq <<<"$placed")" == "$placed" ]]
}
wait_for "every placed replica on its own node" 60 distinct_nodes
short() { [[ "$(cond NodeSelected message)" == *"another replica of it runs there"* ]]; }
wait_for "the replica with no node left says why" 120 short
kubectl -n "$ns" patch gfd e2e --type merge -p '{"spec":{"replicas":1}}' >/dev/null
one_left() { [[ "$(jp '{.status.ready}')" == */1 && "$(jp '{.status.replicas[*].index}')" == 0 ]]; }
wait_for "scaled back to one replica" 180 one_left

# 5. Hibernate by annotation: phase Hibernated, no server pod, nodes released; the wake
# takes the object back out of it.
kubectl -n "$ns" annotate gfd e2e glmflash.io/hibernate=true >/dev/null
wait_for "phase Hibernated" 180 phase_is Hibernated
if kubectl -n "$ns" get deployment e2e >/dev/null 2>&1; then
  [[ "$(kubectl -n "$ns" get deployment e2e -o jsonpath='{.spec.replicas}')" == 0 ]] \
    && pass "hibernated server scaled to zero" || fail "hibernated server still has replicas"
fi
[[ "$(jp '{.status.replicas[0].phase}')" == Hibernated ]] && pass "replica 0 Hibernated, node kept: $(jp '{.status.replicas[0].node}')" || fail "replica 0 is '$(jp '{.status.replicas[0].phase}')'"
kubectl -n "$ns" annotate gfd e2e glmflash.io/hibernate- >/dev/null
woken() { [[ "$(jp '{.status.phase}')" != Hibernated ]]; }
wait_for "woken (phase $(jp '{.status.phase}'))" 120 woken
if [[ "${GLMFLASH_E2E_FULL:-0}" == 1 ]]; then
  wait_for "phase Running again after the wake" 1800 phase_is Running
fi

# 6. Deletion: finalizer runs, owned objects are garbage collected.
kubectl -n "$ns" delete gfd e2e --wait=false >/dev/null
wait_for "object deleted (finalizer released)" 120 object_gone
if ((job_controller)); then
  wait_for "owned Job garbage collected" 120 jobs_gone
else
  skip "garbage collection of the owned Job (no controller manager)"
fi
