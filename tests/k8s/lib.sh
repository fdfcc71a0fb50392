# Shared by the end-to-end suite's stage 2 (tests/k8s/stage2.sh): starting pillar's processes
# and the sidecars out of cluster, each sidecar with its own ServiceAccount token, and playing
# kubelet (Node and CSINode objects, the node-side CSI calls with the VolumeAttachment's
# metadata) and the scheduler (the selected-node annotation) where no kubelet runs.
# Sourced, not run. Expects: KUBECTL, ROOT, NS, W (scratch dir), BIN (pillar binaries),
# SIDECARS (sidecar binaries), pass/fail functions.

DRIVER=pillar.csi.io
ZONE_KEY=topology.pillar-csi.io/zone
ZONE=e2e
POOL=e2e
PIDS=()

k() { "$KUBECTL" "$@"; }

# wait_for SECONDS DESCRIPTION COMMAND...: polls COMMAND every second until it succeeds.
wait_for() {
  local limit=$1 what=$2; shift 2
  local t=0
  until "$@" >/dev/null 2>&1; do
    t=$((t + 1))
    if [ "$t" -ge "$limit" ]; then echo "timed out after ${limit}s waiting for $what"; return 1; fi
    sleep 1
  done
}

# start NAME COMMAND...: starts a process in the background, its output in $W/logs/NAME.log.
start() {
  local name=$1; shift
  mkdir -p "$W/logs"
  "$@" >"$W/logs/$name.log" 2>&1 &
  PIDS+=($!)
  echo $! >"$W/pids/$name"
}

# stop_proc NAME [SIGNAL]: ends a process this suite started.
stop_proc() {
  local pid; pid=$(cat "$W/pids/$1" 2>/dev/null) || return 0
  kill "-${2:-TERM}" "$pid" 2>/dev/null || true
  if [ "${2:-TERM}" != STOP ]; then wait "$pid" 2>/dev/null || true; rm -f "$W/pids/$1"; fi
}

# sa_kubeconfig OUT: a kubeconfig authenticating with a fresh token of the controller's
# ServiceAccount (what the kubelet mounts into the controller pod).
sa_kubeconfig() {
  local out=$1 token server ca
  token=$(k -n "$NS" create token pillar-controller --duration 2h) || return 1
  server=$(k config view --minify -o jsonpath='{.clusters[0].cluster.server}')
  ca=$(k config view --minify --raw -o jsonpath='{.clusters[0].cluster.certificate-authority-data}')
  if [ -z "$ca" ]; then
    ca=$(base64 -w0 <"$(k config view --minify -o jsonpath='{.clusters[0].cluster.certificate-authority}')")
  fi
  (umask 077; cat >"$out" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "$server", certificate-authority-data: "$ca"}}]
users: [{name: u, user: {token: "$token"}}]
contexts: [{name: x, context: {cluster: c, user: u, namespace: $NS}}]
current-context: x
EOF
  )
}

# sidecar_args CONTAINER: the shipped container's args, one per line, from deploy/base.
sidecar_args() {
  jq -r --arg c "$1" '.spec.template.spec.containers[] | select(.name == $c) | .args[]' \
    "$W/controller-deployment.json"
}

# start_replica N POD: one controller "pod": pillar's controller and the controller-side
# sidecars (the health monitor where its binary is there) on their own socket, as the Deployment runs them (shipped args; the socket, the
# HTTP endpoints and the agent TLS replaced for running out of cluster), as pod POD.
start_replica() {
  local n=$1 pod=$2 sock="$W/replica-$n/csi.sock"
  mkdir -p "$W/replica-$n"
  sa_kubeconfig "$W/replica-$n/kubeconfig" || return 1
  local args=()
  while read -r a; do
    case $a in
      --endpoint=*) args+=("--endpoint=unix://$sock") ;;
      --agent-client-cert=* | --agent-client-key=*) ;;
      # The credentials endpoint (a pod-IP listener, a mounted certificate) is stage 3's, where
      # kubelet mounts the node plugins' tokens (scenario f); these node plugins stage local
      # devices and need no pair.
      --credentials-*) ;;
      *) args+=("$a") ;;
    esac
  done < <(sidecar_args pillar)
  start "pillar-controller-$n" env KUBECONFIG="$W/replica-$n/kubeconfig" POD_NAME="$pod" \
    POD_NAMESPACE="$NS" RUST_LOG=info "$BIN/pillar-csi" "${args[@]}" --agent-insecure-plaintext
  wait_for 30 "controller $n socket" test -S "$sock" || return 1
  local c port
  for c in csi-provisioner csi-attacher csi-resizer csi-snapshotter \
      csi-external-health-monitor-controller; do
    [ -x "$SIDECARS/$c" ] || continue
    args=()
    while read -r a; do
      case $a in
        --csi-address=*) args+=("--csi-address=$sock") ;;
        --http-endpoint=:*) port=${a#--http-endpoint=:}; args+=("--http-endpoint=127.0.0.1:$((port + 100 * n))") ;;
        *) args+=("$a") ;;
      esac
    done < <(sidecar_args "$c")
    start "$c-$n" env NAMESPACE="$NS" POD_NAME="$pod" "$SIDECARS/$c" "${args[@]}" \
      --kubeconfig="$W/replica-$n/kubeconfig" --leader-election-namespace="$NS"
  done
}

stop_replica() {
  local n=$1 sig=${2:-TERM} c
  for c in pillar-controller csi-provisioner csi-attacher csi-resizer csi-snapshotter \
      csi-external-health-monitor-controller; do
    stop_proc "$c-$n" "$sig"
  done
}

# ---------- playing kubelet ----------

# start_node NAME: the node plugin (test-only local-device attach: the agent is on the configfs
# double on this machine) in a mount namespace of its own, as on a machine of its own: its
# mounts are invisible to the other node's plugin (which would otherwise see them as mounts it
# must not unstage under); then what kubelet and the registrar do with NodeGetInfo: the Node
# object with its topology labels and the CSINode object.
start_node() {
  local node=$1 d="$W/$1"
  mkdir -p "$d/state" "$d/kubelet"
  : >"$d/mounts"
  local id; id=$(cat /proc/sys/kernel/random/uuid)
  echo "nqn.2014-08.org.nvmexpress:uuid:$id" >"$d/hostnqn"
  echo "$id" >"$d/hostid"
  start "ns-$node" unshare --mount --propagation private sleep infinity
  own_ns() { [ "$(readlink "/proc/$(cat "$W/pids/ns-$node")/ns/mnt")" != "$(readlink /proc/self/ns/mnt)" ]; }
  wait_for 10 "mount namespace of $node" own_ns || return 1
  start_node_plugin "$node" || return 1
  local info; info=$("$BIN/pillarctl" --node "$d/csi.sock" info) || return 1
  apply_node_objects "$node" "$info"
}

# start_node_plugin NAME: the node plugin process, inside NAME's mount namespace.
start_node_plugin() {
  local node=$1 d="$W/$1"
  rm -f "$d/csi.sock"
  start "node-$node" nsenter -t "$(cat "$W/pids/ns-$node")" -m -- env RUST_LOG=info \
    "$BIN/pillar-csi" node --endpoint "unix://$d/csi.sock" --node-name "$node" \
    --state-dir "$d/state" --hostnqn-file "$d/hostnqn" --hostid-file "$d/hostid" \
    --topology "$ZONE_KEY=$ZONE" --test-local-device-attach
  wait_for 30 "node plugin $node" test -S "$d/csi.sock"
}

# on_node NODE PATH: PATH as NODE's mount namespace sees it, from this one.
on_node() { echo "/proc/$(cat "$W/pids/ns-$1")/root$2"; }

# mount_options NODE PATH: the options of the mount at PATH in NODE's namespace.
mount_options() {
  awk -v t="$2" '$2 == t {print $4}' "/proc/$(cat "$W/pids/ns-$1")/mounts"
}

# Node, CSINode: written with jq so label values are quoted right.
apply_node_objects() {
  local node=$1 info=$2
  jq -n --arg n "$node" --argjson t "$(jq '.topology // {}' <<<"$info")" '{
    apiVersion: "v1", kind: "Node",
    metadata: {name: $n, labels: ($t + {"kubernetes.io/hostname": $n, "kubernetes.io/os": "linux"}),
      annotations: {"volumes.kubernetes.io/controller-managed-attach-detach": "true"}}}' |
    k apply -f - >/dev/null || return 1
  jq -n --arg n "$node" --arg d "$DRIVER" --arg id "$(jq -r .node_id <<<"$info")" \
    --argjson keys "$(jq '.topology // {} | keys' <<<"$info")" '{
    apiVersion: "storage.k8s.io/v1", kind: "CSINode",
    metadata: {name: $n},
    spec: {drivers: [{name: $d, nodeID: $id, topologyKeys: $keys}]}}' |
    k apply -f - >/dev/null
}

pv_of() { k get pvc "$1" -o jsonpath='{.spec.volumeName}'; }

# va_attached NODE PV: prints the VolumeAttachment of PV on NODE once the attacher marked it
# attached; fails before.
va_attached() {
  k get volumeattachments -o json | jq -e --arg n "$1" --arg p "$2" '.items[]
    | select(.spec.nodeName == $n and .spec.source.persistentVolumeName == $p
             and .status.attached == true)'
}

# select_node PVC NODE: what the scheduler does for a WaitForFirstConsumer claim.
select_node() {
  k annotate --overwrite pvc "$1" "volume.kubernetes.io/selected-node=$2" >/dev/null
}

# make_pvc NAME SIZE ACCESS [MODE] [DATASOURCE-KIND DATASOURCE-NAME]
make_pvc() {
  local name=$1 size=$2 access=$3 mode=${4:-Filesystem} kind=${5:-} src=${6:-}
  jq -n --arg n "$name" --arg s "$size" --arg a "$access" --arg m "$mode" --arg k "$kind" \
    --arg src "$src" '{apiVersion: "v1", kind: "PersistentVolumeClaim", metadata: {name: $n},
    spec: ({storageClassName: "pillar-e2e", accessModes: [$a], volumeMode: $m,
      resources: {requests: {storage: $s}}}
      + (if $k == "" then {} else {dataSource: {kind: $k, name: $src,
          apiGroup: (if $k == "VolumeSnapshot" then "snapshot.storage.k8s.io" else null end)}} end))}' |
    k apply -f - >/dev/null
}

pvc_bound() { [ "$(k get pvc "$1" -o jsonpath='{.status.phase}')" = Bound ]; }

# make_pod NAME NODE PVC [ro]: a pod bound to NODE (it never runs: no kubelet; the
# attach-detach controller attaches its volume all the same). It tolerates the taints of a node
# without kubelet (not-ready, unreachable) and, as any pod, not the out-of-service taint.
make_pod() {
  local ro=false; [ "${4:-}" = ro ] && ro=true
  jq -n --arg n "$1" --arg node "$2" --arg c "$3" --argjson ro "$ro" '{apiVersion: "v1",
    kind: "Pod", metadata: {name: $n}, spec: {nodeName: $node,
      tolerations: [{key: "node.kubernetes.io/not-ready", operator: "Exists"},
                    {key: "node.kubernetes.io/unreachable", operator: "Exists"}],
      containers: [{name: "app", image: "registry.invalid/e2e/none"}],
      volumes: [{name: "data", persistentVolumeClaim: {claimName: $c, readOnly: $ro}}]}}' |
    k apply -f - >/dev/null
}

# report_in_use NODE: Node.status.volumesInUse from what this "kubelet" has staged.
report_in_use() {
  local node=$1
  jq -Rn --arg d "$DRIVER" '[inputs | split("|")[2] | "kubernetes.io/csi/\($d)^\(.)"] | unique
    | {status: {volumesInUse: .}}' <"$W/$node/mounts" >"$W/$node/in-use.json"
  k patch node "$node" --subresource=status --type=merge --patch-file "$W/$node/in-use.json" >/dev/null
}

# kubelet_mount NODE POD PVC [ro]: waits for the attach, then NodeStage (unless staged) and
# NodePublish with the VolumeAttachment's metadata and the PV's attributes, as kubelet does;
# prints the publish target as NODE sees it (on_node turns it into a path usable here).
kubelet_mount() {
  local node=$1 pod=$2 pvc=$3 ro=${4:-} pv va pvj
  pv=$(pv_of "$pvc")
  wait_for 120 "$pvc attached to $node" va_attached "$node" "$pv" || return 1
  va=$(va_attached "$node" "$pv"); pvj=$(k get pv "$pv" -o json)
  local handle mode=rwo uid; handle=$(jq -r .spec.csi.volumeHandle <<<"$pvj")
  case $(jq -r '.spec.accessModes[0]' <<<"$pvj") in
    ReadOnlyMany) mode=rox ;; ReadWriteOncePod) mode=rwop ;;
  esac
  local vol=(--mode "$mode")
  [ "$(jq -r .spec.volumeMode <<<"$pvj")" = Block ] && vol+=(--block)
  local fst; fst=$(jq -r '.spec.csi.fsType // ""' <<<"$pvj"); [ -n "$fst" ] && vol+=(--fs-type "$fst")
  mapfile -t -O "${#vol[@]}" vol < <(jq -r '.status.attachmentMetadata // {} | to_entries[]
    | "--publish-context=\(.key)=\(.value)"' <<<"$va")
  mapfile -t -O "${#vol[@]}" vol < <(jq -r '.spec.csi.volumeAttributes // {} | to_entries[]
    | "--volume-context=\(.key)=\(.value)"' <<<"$pvj")
  uid=$(k get pod "$pod" -o jsonpath='{.metadata.uid}')
  local staging="$W/$node/kubelet/plugins/$pv/globalmount"
  local target="$W/$node/kubelet/pods/$uid/volumes/$pv/mount"
  mkdir -p "$staging" "$(dirname "$target")"
  local ctl=("$BIN/pillarctl" --node "$W/$node/csi.sock" kubelet)
  if ! grep -q "|$pv|" "$W/$node/mounts" 2>/dev/null; then
    "${ctl[@]}" stage "$handle" --staging "$staging" "${vol[@]}" >>"$W/$node/calls.log" || return 1
  fi
  local readonly=(); [ "$ro" = ro ] && readonly=(--readonly)
  "${ctl[@]}" publish "$handle" --staging "$staging" --target "$target" "${readonly[@]}" \
    "${vol[@]}" >>"$W/$node/calls.log" || return 1
  echo "$pod|$pv|$handle|$staging|$target" >>"$W/$node/mounts"
  report_in_use "$node"
  echo "$target"
}

# kubelet_unmount NODE POD: NodeUnpublish of the pod's volumes, NodeUnstage of those no other
# pod on NODE uses, volumesInUse updated: what kubelet does before a pod is gone.
kubelet_unmount() {
  local node=$1 pod=$2 line p pv handle staging target
  local ctl=("$BIN/pillarctl" --node "$W/$node/csi.sock" kubelet)
  while IFS='|' read -r p pv handle staging target; do
    [ "$p" = "$pod" ] || continue
    "${ctl[@]}" unpublish "$handle" --target "$target" >>"$W/$node/calls.log" || return 1
    grep -v "^$pod|$pv|" "$W/$node/mounts" >"$W/$node/mounts.new" || true
    mv "$W/$node/mounts.new" "$W/$node/mounts"
    if ! grep -q "|$pv|" "$W/$node/mounts"; then
      "${ctl[@]}" unstage "$handle" --staging "$staging" >>"$W/$node/calls.log" || return 1
    fi
  done < <(cat "$W/$node/mounts")
  report_in_use "$node"
}

# delete_pod NODE POD: kubelet unmounts, then the pod object goes.
delete_pod() {
  kubelet_unmount "$1" "$2" || return 1
  k delete pod "$2" --grace-period=0 --force --wait=true >/dev/null 2>&1
}

# agent_volumes: the volumes the agent holds in its pool (files of the file pool).
agent_volumes() { find "$W/pool" -maxdepth 1 -type f ! -name '.*' | wc -l; }

# reset_cluster: removes what an earlier, interrupted run of this stage left (its pods, claims,
# snapshots, PVs, VolumeAttachments and pillar's records), finalizers included: no controller
# is left to process them.
reset_cluster() {
  local kind
  k delete pods --all --grace-period=0 --force >/dev/null 2>&1
  for kind in pvc volumesnapshots volumesnapshotcontents pv volumeattachments \
      pillarvolumestates pillarsnapshotstates storageclass/pillar-e2e \
      csinode/e2e-node-a csinode/e2e-node-b node/e2e-node-a node/e2e-node-b; do
    k get "$kind" -o name 2>/dev/null | while read -r o; do
      k patch "$o" --type=merge -p '{"metadata":{"finalizers":null}}' >/dev/null 2>&1
      k delete "$o" --wait=false >/dev/null 2>&1
    done
  done
}

# pool_on_xfs: the file pool on an XFS image with reflink, as a production file pool would be:
# a snapshot or clone of a volume in use is refused on a pool that cannot reflink.
pool_on_xfs() {
  truncate -s 8G "$W/pool.img" && mkfs.xfs -q -m reflink=1 "$W/pool.img" &&
    mount -o loop "$W/pool.img" "$W/pool"
}

# The file system of the suite's volumes: ext4 grows online only with CAP_SYS_RESOURCE (the
# node plugin's DaemonSet is privileged; a container running this suite may lack it), XFS with
# CAP_SYS_ADMIN.
choose_fs_type() {
  local eff; eff=$(awk '/^CapEff/ {print $2}' /proc/self/status)
  if (( (16#$eff >> 24) & 1 )); then echo ext4; else echo xfs; fi
}

# sidecars_healthy N: every sidecar of replica N answers its liveness probe's URL (the
# Deployment's livenessProbe paths and ports, shifted by 100 * N).
sidecars_healthy() {
  local n=$1 c port url ok=0
  for c in csi-provisioner csi-attacher csi-resizer csi-snapshotter \
      csi-external-health-monitor-controller; do
    [ -e "$W/pids/$c-$n" ] || continue
    port=$(sidecar_args "$c" | sed -n 's/^--http-endpoint=://p')
    url="http://127.0.0.1:$((port + 100 * n))/healthz/leader-election"
    if ! curl -fsS -o /dev/null --max-time 5 "$url"; then echo "$c: $url does not answer"; ok=1; fi
  done
  return $ok
}
