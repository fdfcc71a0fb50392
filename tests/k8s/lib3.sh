# Shared by the end-to-end suite's stage 3 (tests/k8s/stage3.sh): deploying the shipped manifests
# through the test-only overlay tests/k8s/overlays/kubelet to a cluster with a real kubelet, the
# TLS material they need, the suite's PillarAgent, PillarProtocol, StorageClass and
# VolumeSnapshotClass, and what the checks ask of the cluster.
# Sourced, not run. Expects: KUBECTL, ROOT, NS, W, NODE, IMAGE, and lib.sh (k, wait_for, DRIVER,
# ZONE_KEY, ZONE, POOL).

AGENT=e2e-storage
POOL_DIR=/var/lib/pillar/e2e-pool
# The StorageClass's file system. ext4 grows online only where the node plugin has
# CAP_SYS_RESOURCE (a node that is itself a container may lack it): xfs there.
FS_TYPE=${PILLAR_E2E_FS_TYPE:-ext4}

node_ip() {
  k get node "$NODE" -o jsonpath='{.status.addresses[?(@.type=="InternalIP")].address}'
}

# make_tls: a CA, the agent's server certificate (DNS SAN: the PillarAgent's tls.serverName) and
# the controller's client certificate (DNS SAN: the agent's --authorized-client), as README
# "Deploy" step 3 asks; the three secrets the manifests mount.
make_tls() {
  local d="$W/tls"
  mkdir -p "$d" && (
    cd "$d" || exit 1
    openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 \
      -subj "/CN=pillar-e2e-agent-ca" 2>/dev/null || exit 1
    leaf() { # NAME SAN EKU
      openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$2" \
        2>/dev/null &&
      printf 'subjectAltName=DNS:%s\nextendedKeyUsage=%s\nbasicConstraints=CA:FALSE\n' "$2" "$3" \
        >"$1.ext" &&
      openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
        -extfile "$1.ext" -out "$1.crt" 2>/dev/null
    }
    leaf agent "$NODE.pillar-agent" serverAuth &&
      leaf controller pillar-controller.pillar-system clientAuth &&
      leaf credentials pillar-controller.pillar-system.svc serverAuth
  ) || return 1
  secret() { k -n "$NS" create secret generic "$@" --dry-run=client -o yaml | k apply -f - >/dev/null; }
  secret pillar-agent-tls --from-file=tls.crt="$d/agent.crt" --from-file=tls.key="$d/agent.key" \
    --from-file=ca.crt="$d/ca.crt" &&
  secret pillar-controller-tls --from-file=tls.crt="$d/controller.crt" \
    --from-file=tls.key="$d/controller.key" &&
  secret pillar-agent-ca --from-file=ca.crt="$d/ca.crt" &&
  secret pillar-controller-credentials-tls --from-file=tls.crt="$d/credentials.crt" \
    --from-file=tls.key="$d/credentials.key" &&
  secret pillar-credentials-ca --from-file=ca.crt="$d/ca.crt"
}

# A cluster without kube-proxy (PILLAR_E2E_NO_KUBE_PROXY=1): kube-proxy's one rule the
# credentials endpoint needs, the overlay's fixed ClusterIP of Service pillar-controller to one
# controller pod (any replica answers), for this network namespace's own traffic (the node
# plugin runs on the host network) and for pods'. Removed by undeploy.
CREDENTIALS_VIP=10.96.0.98
service_stand_in() {
  [ "${PILLAR_E2E_NO_KUBE_PROXY:-}" = 1 ] || return 0
  local ip
  ip=$(k -n "$NS" get pods -l app=pillar-controller -o json | jq -r '[.items[]
    | select(.metadata.deletionTimestamp == null and .status.podIP != null)][0].status.podIP // empty')
  [ -n "$ip" ] || { echo "no controller pod IP"; return 1; }
  service_stand_in_off
  for chain in OUTPUT PREROUTING; do
    iptables -t nat -A "$chain" -d "$CREDENTIALS_VIP" -p tcp --dport 9820 \
      -m comment --comment pillar-e2e-credentials -j DNAT --to-destination "$ip:9820" || return 1
  done
  echo "kube-proxy stand-in: $CREDENTIALS_VIP:9820 -> $ip:9820"
}
service_stand_in_off() {
  [ "${PILLAR_E2E_NO_KUBE_PROXY:-}" = 1 ] || return 0
  local chain rule
  for chain in OUTPUT PREROUTING; do
    iptables -t nat -S "$chain" 2>/dev/null | grep -- '--comment pillar-e2e-credentials' |
      sed 's/^-A /-D /' | while read -r rule; do
        # shellcheck disable=SC2086 # a rule's words
        iptables -t nat $rule
      done
  done
}

# deploy: the overlay, the secrets, and the suite's pillar objects and classes.
deploy() {
  local ip
  ip=$(node_ip) && [ -n "$ip" ] || { echo "node $NODE has no InternalIP"; return 1; }
  k kustomize "$ROOT/tests/k8s/overlays/kubelet" >"$W/deploy.yaml" || return 1
  # The secrets before the pods: the agent reads its certificate once, at start, while kubelet
  # updates a mounted secret in place; pods started on an earlier run's secrets would serve a
  # certificate of a CA the controller no longer trusts (seen: BadSignature).
  k get namespace "$NS" >/dev/null 2>&1 || k create namespace "$NS" >/dev/null || return 1
  make_tls || { echo "TLS material"; return 1; }
  k apply --server-side --force-conflicts --field-manager=pillar-e2e -f "$W/deploy.yaml" \
    >/dev/null || return 1
  jq -n --arg a "$AGENT" --arg n "$NODE" --arg ip "$ip" --arg zk "$ZONE_KEY" --arg z "$ZONE" \
    --arg p "$POOL" '{apiVersion: "pillar-csi.io/v1alpha1", kind: "PillarAgent",
    metadata: {name: $a}, spec: {node: $n, address: "\($ip):9500", nvmeAddress: $ip,
      tls: {serverName: "\($n).pillar-agent", caBundlePath: "/etc/pillar/agent-ca/ca.crt"},
      pools: [{name: $p, kind: "file"}], topology: {($zk): $z}}}' | k apply -f - >/dev/null &&
  k apply -f "$ROOT/deploy/examples/pillarprotocol.yaml" >/dev/null &&
  jq -n --arg p "$POOL" --arg fs "$FS_TYPE" '{apiVersion: "storage.k8s.io/v1", kind: "StorageClass",
    metadata: {name: "pillar-e2e"}, provisioner: "pillar.csi.io",
    parameters: {"pillar.io/pool": $p, "pillar.io/protocol": "nvme-tcp",
      "csi.storage.k8s.io/fstype": $fs},
    allowVolumeExpansion: true, volumeBindingMode: "WaitForFirstConsumer", reclaimPolicy: "Delete"}' |
    k apply -f - >/dev/null &&
  jq '.metadata.name = "pillar-e2e"' <(k create --dry-run=client -o json \
    -f "$ROOT/deploy/examples/volumesnapshotclass.yaml") | k apply -f - >/dev/null
}

# undeploy: what this stage (or an interrupted run of it) created, the workloads last so that
# the controller and the node plugin still serve the deletions. The CRDs, RBAC and namespace of
# stage 1 stay.
undeploy() {
  local o
  k delete pods -l pillar-e2e=stage3 --grace-period=2 --wait=true --timeout=120s >/dev/null 2>&1
  k delete volumesnapshots -l pillar-e2e=stage3 --wait=true --timeout=120s >/dev/null 2>&1
  k delete pvc -l pillar-e2e=stage3 --wait=true --timeout=120s >/dev/null 2>&1
  gone() { [ -z "$(k get pv -o json | jq -r --arg d "$DRIVER" '.items[]
    | select(.spec.csi.driver == $d and .spec.claimRef.namespace == "default") | .metadata.name')" ]; }
  wait_for 120 "the stage's PVs deleted" gone >/dev/null
  k -n "$NS" delete deploy/pillar-controller ds/pillar-node ds/pillar-agent pdb/pillar-controller \
    --wait=true --timeout=120s >/dev/null 2>&1
  k -n "$NS" delete secret pillar-agent-tls pillar-controller-tls pillar-agent-ca \
    pillar-controller-credentials-tls pillar-credentials-ca --ignore-not-found >/dev/null 2>&1
  service_stand_in_off
  k -n "$NS" wait --for=delete pod -l 'app in (pillar-controller, pillar-node, pillar-agent)' \
    --timeout=120s >/dev/null 2>&1
  # storage-1: stage 1's example PillarAgent (an address no test machine has).
  for o in "pillaragent/$AGENT" pillaragent/storage-1 storageclass/pillar-e2e \
      volumesnapshotclass/pillar-e2e; do
    k delete "$o" --ignore-not-found >/dev/null 2>&1
  done
}

csinode_registered() {
  k get csinode "$NODE" -o json | jq -e --arg d "$DRIVER" --arg zk "$ZONE_KEY" '.spec.drivers[]
    | select(.name == $d) | .topologyKeys | index($zk) != null' >/dev/null
}

node_topology_labels() {
  k get node "$NODE" -o json | jq -e --arg zk "$ZONE_KEY" --arg z "$ZONE" --arg n "$NODE" \
    '.metadata.labels[$zk] == $z and .metadata.labels["pillar.io/node"] == $n' >/dev/null
}

agent_serving() {
  [ "$(k get pillaragent "$AGENT" -o jsonpath='{.status.state}')" = Serving ]
}

lease_held() {
  local holder; holder=$(k -n "$NS" get lease pillar-controller -o jsonpath='{.spec.holderIdentity}')
  [ -n "$holder" ] && k -n "$NS" get pod "$holder" -o name >/dev/null
}

# pod_json NAME PVC COMMAND: a pod of this stage running COMMAND (sh -c) with PVC at /data.
pod_json() {
  jq -n --arg n "$1" --arg c "$2" --arg cmd "$3" --arg img "$IMAGE" '{apiVersion: "v1",
    kind: "Pod", metadata: {name: $n, labels: {"pillar-e2e": "stage3"}},
    spec: {terminationGracePeriodSeconds: 2,
      containers: [{name: "app", image: $img, imagePullPolicy: "IfNotPresent",
        command: ["sh", "-c", $cmd], volumeMounts: [{name: "data", mountPath: "/data"}]}],
      volumes: [{name: "data", persistentVolumeClaim: {claimName: $c}}]}}'
}

pvc_json() { # NAME SIZE
  jq -n --arg n "$1" --arg s "$2" '{apiVersion: "v1", kind: "PersistentVolumeClaim",
    metadata: {name: $n, labels: {"pillar-e2e": "stage3"}},
    spec: {storageClassName: "pillar-e2e", accessModes: ["ReadWriteOnce"],
      resources: {requests: {storage: $s}}}}'
}

pod_running() { [ "$(k get pod "$1" -o jsonpath='{.status.phase}')" = Running ]; }
node_ready() {
  k get node "$NODE" -o json | jq -e 'any(.status.conditions[]; .type == "Ready" and .status == "True")' >/dev/null
}

# kubelet_starts: how many times the node's kubelet has started (its "Starting kubelet." Events:
# one object per process).
kubelet_starts() {
  k get events -A --field-selector "involvedObject.kind=Node,involvedObject.name=$NODE,reason=Starting" \
    -o json | jq '[.items[] | select(.source.component == "kubelet" or .reportingComponent == "kubelet")] | length'
}

# node_plugin_log [kubectl logs args]: the node plugin container's log on NODE (colours
# stripped).
# The node plugin pod on NODE (the DaemonSet's; one per node). A pod being deleted is left out.
node_plugin_pod() {
  k -n "$NS" get pods -l app=pillar-node --field-selector "spec.nodeName=$NODE" -o json |
    jq -r '[.items[] | select(.metadata.deletionTimestamp == null)][0].metadata.name // empty'
}

node_plugin_log() {
  k -n "$NS" logs "$(node_plugin_pod)" -c pillar "$@" | sed 's/\x1b\[[0-9;]*m//g'
}

# in_node_plugin COMMAND...: runs COMMAND in the node plugin's container on NODE (it sees the
# node's mounts under /var/lib/kubelet: the DaemonSet mounts it with Bidirectional propagation).
in_node_plugin() {
  k -n "$NS" exec "$(node_plugin_pod)" -c pillar -- "$@"
}

in_agent() {
  local pod; pod=$(k -n "$NS" get pods -l app=pillar-agent --field-selector "spec.nodeName=$NODE" \
    -o jsonpath='{.items[0].metadata.name}')
  k -n "$NS" exec "$pod" -c agent -- "$@"
}

# agent_pool_files: the volumes' files in the agent's pool (not its hidden bookkeeping).
agent_pool_files() { in_agent find "$POOL_DIR" -maxdepth 1 -type f ! -name '.*'; }
