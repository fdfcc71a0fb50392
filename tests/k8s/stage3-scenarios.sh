# Stage 3's scenarios (issue 21 item 4 d, with a real kubelet); sourced by tests/k8s/stage3.sh.

# The writer: one line per 200 ms, each the next number, fsynced; never gaps unless a write was
# lost or the volume changed under it.
WRITER='i=0; while :; do echo $i >>/data/log; sync /data/log; i=$((i + 1)); sleep 0.2; done'

pod_field() { k get pod "$1" -o jsonpath="$2"; }
lines() { k exec "$1" -c app -- sh -c 'wc -l </data/log'; }
# The log is 0, 1, 2, ... with no gap and no repeat.
log_sequential() { k exec "$1" -c app -- awk 'NR - 1 != $1 { bad = 1 } END { exit bad }' /data/log; }
data_mount() { k exec "$1" -c app -- awk '$2 == "/data" { print $1, $3, substr($4, 1, 2) }' /proc/mounts; }
va_of() {
  k get volumeattachments -o json | jq -r --arg p "$1" --arg n "$NODE" '.items[]
    | select(.spec.source.persistentVolumeName == $p and .spec.nodeName == $n)
    | "\(.metadata.name) \(.metadata.creationTimestamp) \(.status.attached)"'
}
in_use() {
  k get node "$NODE" -o json | jq -e --arg v "kubernetes.io/csi/$DRIVER^$1" \
    '(.status.volumesInUse // []) | index($v) != null' >/dev/null
}
grows() { # POD N: the log has more than N lines
  [ "$(lines "$1")" -gt "$2" ]
}
# mount_warnings POD SINCE: the pod's volume warnings (FailedMount, FailedAttachVolume,
# FailedMapVolume, VolumeConditionAbnormal, ...) at or after SINCE.
mount_warnings() {
  k get events --field-selector "involvedObject.name=$1" -o json | jq -r --arg t "$2" '.items[]
    | select(.type == "Warning" and (.reason | test("Mount|Attach|Map|Volume"))
             and ((.lastTimestamp // .eventTime // "") >= $t))
    | "\(.reason): \(.message)"'
}

# d, second part: the node plugin restarted between stage and unstage (its pod deleted, the
# DaemonSet starts a new one). The new plugin must re-register with kubelet, leave the mounted
# volume alone (a pod's mount lives in kubelet's mount namespace, not the plugin's process), and
# answer the unstage that follows (checked by the caller through the new pod's log).
node_plugin_restart_under_kubelet() { # POD HANDLE MOUNT
  local pod=$1 handle=$2 mount=$3 old n1 t1
  old=$(node_plugin_pod); n1=$(lines "$pod"); t1=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  echo "restarting the node plugin: pod $old deleted"
  k -n "$NS" delete pod "$old" --wait=true --timeout=120s >/dev/null
  new_plugin() { local p; p=$(node_plugin_pod); [ -n "$p" ] && [ "$p" != "$old" ] &&
    [ "$(k -n "$NS" get pod "$p" -o jsonpath='{.status.containerStatuses[?(@.name=="pillar")].ready}')" = true ]; }
  check "d: a new node plugin pod is ready (was $old)" wait_for 180 "node plugin" new_plugin
  check "d: the new node plugin is registered with kubelet (CSINode)" wait_for 60 "registered" csinode_registered
  check "d: the writer pod still Running after the node plugin restart" pod_running "$pod"
  check "d: /data still mounted from the same device, read-write ($mount)" test "$(data_mount "$pod")" = "$mount"
  check "d: the writer kept writing across the node plugin restart" wait_for 30 "writes" grows "$pod" "$n1"
  check "d: the writer's log has no gap and no repeat" log_sequential "$pod"
  local warn; warn=$(mount_warnings "$pod" "$t1")
  check "d: no volume warning on the pod since the node plugin restart${warn:+ (got: $warn)}" test -z "$warn"
  echo "new node plugin's log for the volume so far:"
  node_plugin_log | grep -F "$handle" | tail -n 4 | sed 's/^/  /'
}

# d) kubelet restart with a mounted volume (reconstruction).
scenario_d_kubelet_restart() {
  echo "== scenario d: kubelet SIGKILLed and restarted under a pod writing to a pillar volume"
  pvc_json d3-data 1Gi | k apply -f - >/dev/null
  pod_json d3-writer d3-data "$WRITER" | k apply -f - >/dev/null
  if ! check "d: the writer pod runs with its pillar volume (bound WaitForFirstConsumer, attached, staged, published by kubelet)" \
      wait_for 240 "pod Running" pod_running d3-writer; then
    k describe pod d3-writer | tail -n 15; return
  fi
  local pv handle; pv=$(pv_of d3-data)
  handle=$(k get pv "$pv" -o jsonpath='{.spec.csi.volumeHandle}')
  echo "volume $handle (PV $pv)"
  local sum before uid cid restarts va mount_before n1 starts
  sum=$(k exec d3-writer -c app -- sh -c \
    'head -c 16777216 /dev/urandom >/data/blob && sync /data/blob && md5sum /data/blob')
  check "d: 16 MiB written and fsynced before the restart" test -n "$sum"
  uid=$(pod_field d3-writer '{.metadata.uid}')
  cid=$(pod_field d3-writer '{.status.containerStatuses[0].containerID}')
  restarts=$(pod_field d3-writer '{.status.containerStatuses[0].restartCount}')
  va=$(va_of "$pv"); mount_before=$(data_mount d3-writer)
  echo "before: pod $uid container $cid; VolumeAttachment $va; /data: $mount_before"
  check "d: the node reports the volume in use before the restart" in_use "$handle"
  n1=$(lines d3-writer); starts=$(kubelet_starts)
  local t0; t0=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  echo "restarting kubelet: $RESTART"
  if ! bash -c "$RESTART"; then fail "d: the kubelet restart command failed"; return; fi
  started_again() { [ "$(kubelet_starts)" -gt "$starts" ]; }
  check "d: kubelet started again (a new 'Starting kubelet' event)" wait_for 120 "kubelet start" started_again
  check "d: node $NODE Ready again" wait_for 120 "node Ready" node_ready
  # The volume manager's reconstruction and a sync of the pod: kubelet has re-read the pod and
  # its volumes from disk and the API when it reports them in use again and lets the pod be.
  sleep 30
  check "d: the node reports the volume in use after the restart" in_use "$handle"
  check "d: the same pod (UID) still Running" test "$(pod_field d3-writer '{.metadata.uid} {.status.phase}')" = "$uid Running"
  check "d: its container not restarted ($cid, restarts $restarts)" test \
    "$(pod_field d3-writer '{.status.containerStatuses[0].containerID} {.status.containerStatuses[0].restartCount}')" = "$cid $restarts"
  check "d: the same VolumeAttachment, attached throughout ($va)" test "$(va_of "$pv")" = "$va"
  check "d: /data still mounted from the same device, read-write ($mount_before)" test "$(data_mount d3-writer)" = "$mount_before"
  check "d: the writer kept writing across the restart (more than $n1 lines)" wait_for 30 "writes" grows d3-writer "$n1"
  check "d: the writer's log has no gap and no repeat" log_sequential d3-writer
  check "d: the 16 MiB written before the restart read back the same" test \
    "$(k exec d3-writer -c app -- md5sum /data/blob)" = "$sum"
  local warn; warn=$(mount_warnings d3-writer "$t0")
  check "d: no volume warning on the pod since the restart${warn:+ (got: $warn)}" test -z "$warn"
  echo "node plugin's calls for the volume since the restart:"
  node_plugin_log --since-time="$t0" | grep -F "$handle" | tail -n 8 | sed 's/^/  /'
  node_plugin_restart_under_kubelet d3-writer "$handle" "$mount_before"
  # Then the normal end, driven by the restarted kubelet and the new node plugin.
  k delete pod d3-writer --wait=true --timeout=120s >/dev/null
  check "d: pod deleted (kubelet unpublished and unstaged)" wait_for 120 "pod gone" \
    sh -c "! $KUBECTL get pod d3-writer -o name 2>/dev/null | grep -q ."
  unstaged() { node_plugin_log --since-time="$t0" | grep -F "$handle" | grep -q 'NodeUnstageVolume.*unstaged'; }
  check "d: NodeUnpublishVolume and NodeUnstageVolume answered for $handle" wait_for 60 "unstage" unstaged
  no_mount() { ! in_node_plugin grep -F "$pv" /proc/mounts; }
  check "d: nothing of the volume left mounted on the node" wait_for 60 "unmounted" no_mount
  detached() { [ -z "$(va_of "$pv")" ]; }
  check "d: detached (VolumeAttachment gone: ControllerUnpublish answered)" wait_for 120 "detached" detached
  k delete pvc d3-data --wait=false >/dev/null
  pv_gone() { ! k get pv "$pv" -o name >/dev/null 2>&1; }
  check "d: PV deleted (DeleteVolume answered)" wait_for 120 "PV gone" pv_gone
  record_gone() { [ -z "$(k get pillarvolumestates.pillar-csi.io -o name | grep -F "${handle##*/}")" ]; }
  check "d: pillar's record of the volume gone" wait_for 60 "record gone" record_gone
  pool_empty() { [ -z "$(agent_pool_files)" ]; }
  check "d: nothing left in the agent's pool" wait_for 60 "pool empty" pool_empty
}
