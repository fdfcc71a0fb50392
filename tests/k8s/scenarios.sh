# Stage 2's scenarios (issue 21 item 4: a, b, c); sourced by tests/k8s/stage2.sh after setup.

# write_data DIR: writes a file of random data, fsyncs it, keeps its checksum.
write_data() {
  dd if=/dev/urandom of="$1/data" bs=1M count=4 conv=fsync status=none &&
    sha256sum <"$1/data" >"$W/data.sum"
}
same_data() { [ "$(sha256sum <"$1/data")" = "$(cat "$W/data.sum")" ]; }
# The size of the file system holding PATH (statfs: df would look PATH up in this namespace's
# mount table, where a node's mount is not).
fs_bytes() { stat -f -c '%b %S' "$1" | awk '{print $1 * $2}'; }
snapshot_ready() { [ "$(k get volumesnapshot "$1" -o jsonpath='{.status.readyToUse}')" = true ]; }
gone() { ! k get "$@" >/dev/null 2>&1; }
no_volume_states() { [ "$(k get pillarvolumestates -o name | wc -l)" -eq 0 ]; }
no_attachments() { [ "$(k get volumeattachments -o name | wc -l)" -eq 0 ]; }
pool_empty() { [ "$(agent_volumes)" -eq 0 ]; }

# pvc_for_pod PVC NODE POD [ro]: the scheduler's choice, the binding, the pod, kubelet's mount;
# prints the mount.
pvc_for_pod() {
  select_node "$1" "$2"
  wait_for 120 "PVC $1 bound" pvc_bound "$1" || return 1
  make_pod "$3" "$2" "$1" "${4:-}" || return 1
  kubelet_mount "$2" "$3" "$1" "${4:-}"
}

# a) a PVC's whole life: WaitForFirstConsumer, pod, data, online expansion, snapshot, restore,
# clone; a block PVC; a ReadOnlyMany PVC on two nodes; everything deleted, nothing left.
scenario_a() {
  echo "== scenario a: PVC lifecycle"
  local m
  make_pvc a-data 320Mi ReadWriteOnce
  sleep 2
  check "a: WaitForFirstConsumer PVC stays Pending before a node is chosen" \
    test "$(k get pvc a-data -o jsonpath='{.status.phase}')" = Pending
  if ! m=$(pvc_for_pod a-data e2e-node-a a-writer); then
    fail "a: PVC a-data provisioned, attached, staged and published on e2e-node-a"; return
  fi
  pass "a: PVC a-data provisioned, attached, staged and published on e2e-node-a"
  local hm; hm=$(on_node e2e-node-a "$m")
  write_and_check() { write_data "$1" && same_data "$1"; }
  check "a: write 4 MiB, fsync, read back" write_and_check "$hm"
  local pv; pv=$(pv_of a-data)
  check "a: the PV carries the node's zone as node affinity" test \
    "$(k get pv "$pv" -o jsonpath='{.spec.nodeAffinity.required.nodeSelectorTerms[0].matchExpressions[0].key}')" = "$ZONE_KEY"

  # Online expansion: the resizer's ControllerExpandVolume, then kubelet's NodeExpandVolume.
  local before; before=$(fs_bytes "$hm")
  k patch pvc a-data --type=merge -p '{"spec":{"resources":{"requests":{"storage":"400Mi"}}}}' >/dev/null
  pv_grown() { [ "$(k get pv "$pv" -o jsonpath='{.spec.capacity.storage}')" = 400Mi ]; }
  check "a: the resizer grew the PV to 400Mi (ControllerExpandVolume)" wait_for 90 "PV grown" pv_grown
  local handle; handle=$(k get pv "$pv" -o jsonpath='{.spec.csi.volumeHandle}')
  local staging="$W/e2e-node-a/kubelet/plugins/$pv/globalmount"
  check "a: NodeExpandVolume online" "$BIN/pillarctl" --node "$W/e2e-node-a/csi.sock" kubelet \
    expand "$handle" --size $((400 << 20)) --path "$m" --staging "$staging"
  k patch pvc a-data --subresource=status --type=merge \
    -p '{"status":{"capacity":{"storage":"400Mi"},"conditions":[]}}' >/dev/null
  grown_intact() { [ "$(fs_bytes "$hm")" -gt $((before + (48 << 20))) ] && same_data "$hm"; }
  check "a: the file system grew online ($before -> $(fs_bytes "$hm") bytes), data intact" grown_intact

  # Snapshot, restore and clone, each read back on node b.
  jq -n '{apiVersion: "snapshot.storage.k8s.io/v1", kind: "VolumeSnapshot",
    metadata: {name: "a-snap"}, spec: {volumeSnapshotClassName: "pillar-e2e",
    source: {persistentVolumeClaimName: "a-data"}}}' | k apply -f - >/dev/null
  check "a: VolumeSnapshot ready (CreateSnapshot)" wait_for 120 "snapshot ready" snapshot_ready a-snap
  make_pvc a-restore 400Mi ReadWriteOnce Filesystem VolumeSnapshot a-snap
  make_pvc a-clone 400Mi ReadWriteOnce Filesystem PersistentVolumeClaim a-data
  local r c
  if r=$(pvc_for_pod a-restore e2e-node-b a-restore-reader); then
    check "a: the restored PVC holds the snapshot's data (node b)" same_data "$(on_node e2e-node-b "$r")"
  else fail "a: restore PVC from the snapshot bound and mounted on node b"; fi
  if c=$(pvc_for_pod a-clone e2e-node-b a-clone-reader); then
    check "a: the cloned PVC holds the source's data (node b)" same_data "$(on_node e2e-node-b "$c")"
  else fail "a: clone PVC bound and mounted on node b"; fi

  # A block PVC.
  local b
  make_pvc a-block 64Mi ReadWriteOnce Block
  if b=$(pvc_for_pod a-block e2e-node-a a-block-user "" ); then
    b=$(on_node e2e-node-a "$b")
    check "a: block PVC published as a block device" test -b "$b"
    check "a: block PVC: write 1 MiB at 4 MiB, read it back" bash -c "
      dd if=/dev/urandom of=$W/blk bs=1M count=1 status=none &&
      dd if=$W/blk of=$b bs=1M seek=4 conv=fsync status=none &&
      cmp <(dd if=$b bs=1M skip=4 count=1 status=none) $W/blk"
  else fail "a: block PVC bound and published"; fi

  # A snapshot of a mounted file system has a dirty log: a read-only stage of it must be
  # refused, not show the file system as of its last checkpoint.
  make_pvc a-rox-dirty 400Mi ReadOnlyMany Filesystem VolumeSnapshot a-snap
  local refused
  if refused=$(pvc_for_pod a-rox-dirty e2e-node-a a-rox-dirty-a ro 2>&1); then
    fail "a: a read-only stage of a snapshot of a mounted file system is refused (it was staged)"
  else
    check "a: a read-only stage of a snapshot of a mounted file system is refused ($(grep -o 'FailedPrecondition\|[^"]*recovery[^"]*' <<<"$refused" | head -1 | cut -c1-120))" \
      grep -q "recovery" <<<"$refused"
  fi
  # The restore, unmounted cleanly (its read-write stage replayed the log), snapshotted again.
  delete_pod e2e-node-b a-restore-reader
  jq -n '{apiVersion: "snapshot.storage.k8s.io/v1", kind: "VolumeSnapshot",
    metadata: {name: "a-snap-clean"}, spec: {volumeSnapshotClassName: "pillar-e2e",
    source: {persistentVolumeClaimName: "a-restore"}}}' | k apply -f - >/dev/null
  check "a: snapshot of the cleanly unmounted restore ready" wait_for 120 "snapshot ready" snapshot_ready a-snap-clean

  # ReadOnlyMany from the clean snapshot, on two pods on two nodes, read-only on both.
  make_pvc a-rox 400Mi ReadOnlyMany Filesystem VolumeSnapshot a-snap-clean
  local x y
  if x=$(pvc_for_pod a-rox e2e-node-a a-rox-a ro) && make_pod a-rox-b e2e-node-b a-rox ro &&
     y=$(kubelet_mount e2e-node-b a-rox-b a-rox ro); then
    pass "a: ReadOnlyMany PVC attached and published on both nodes"
    read_only() { mount_options "$1" "$2" | grep -q '^ro'; }
    check "a: mounted read-only on node a ($(mount_options e2e-node-a "$x"))" read_only e2e-node-a "$x"
    check "a: mounted read-only on node b ($(mount_options e2e-node-b "$y"))" read_only e2e-node-b "$y"
    x=$(on_node e2e-node-a "$x"); y=$(on_node e2e-node-b "$y")
    write_refused() { ! touch "$1/x" 2>/dev/null; }
    check "a: a write on the read-only mount is refused" write_refused "$y"
    both_read() { same_data "$x" && same_data "$y"; }
    check "a: both read the snapshot's data" both_read
  else fail "a: ReadOnlyMany PVC on two nodes"; fi

  # Delete everything: pods (kubelet unmounts first), then claims and the snapshot.
  local p
  for p in a-writer a-block-user a-rox-a; do delete_pod e2e-node-a "$p"; done
  for p in a-clone-reader a-rox-b; do delete_pod e2e-node-b "$p"; done
  delete_pod e2e-node-a a-rox-dirty-a
  check "a: every VolumeAttachment gone (ControllerUnpublish)" wait_for 120 "detach" no_attachments
  k delete pvc a-restore a-clone a-block a-rox a-rox-dirty --wait=false >/dev/null
  k delete volumesnapshot a-snap a-snap-clean --wait=false >/dev/null
  wait_for 120 "snapshots deleted" gone volumesnapshot a-snap
  wait_for 120 "snapshots deleted" gone volumesnapshot a-snap-clean
  k delete pvc a-data --wait=false >/dev/null
  no_pvs() { [ "$(k get pv -o name | wc -l)" -eq 0 ]; }
  check "a: every PV deleted (DeleteVolume)" wait_for 180 "PVs deleted" no_pvs
  check "a: no PillarVolumeState left" wait_for 60 "volume states" no_volume_states
  check "a: no volume left on the agent" wait_for 60 "agent pool empty" pool_empty
  check "a: no snapshot content left" test "$(k get volumesnapshotcontents -o name | wc -l)" -eq 0
}

# b) Two controller replicas; the leader (pillar's controller and its sidecars) killed in the
# middle of a run of provisioning and attaching.
scenario_b() {
  echo "== scenario b: two replicas, the leader killed mid-run"
  if ! start_replica 2 "${PODS[1]}"; then fail "b: replica 2 started"; return; fi
  pass "b: replica 2 started as pod ${PODS[1]} (standby)"
  local holder; holder=$(k -n "$NS" get lease pillar-controller -o jsonpath='{.spec.holderIdentity}')
  check "b: replica 1 holds pillar's Lease ($holder)" test "$holder" = "${PODS[0]}"
  bound_count() { k get pvc -o json | jq '[.items[] | select(.metadata.name | startswith("b-"))
    | select(.status.phase == "Bound")] | length'; }
  some_bound() { [ "$(bound_count)" -ge 1 ]; }
  local at=0
  local i n=8
  # Half the claims, then the leader is killed as soon as one is bound; the other half arrive
  # after the kill: the run goes on across the takeover.
  for i in $(seq 1 $n); do
    make_pvc "b-$i" 64Mi ReadWriteOnce
    select_node "b-$i" e2e-node-$([ $((i % 2)) = 0 ] && echo a || echo b)
    if [ "$i" = $((n / 2)) ]; then
      wait_for 120 "a first claim bound" some_bound
      at=$(bound_count)
      stop_replica 1 KILL
      echo "$(date +%T.%N) killed replica 1 (SIGKILL) with $at of $n claims bound, $((n / 2)) created"
    fi
  done
  check "b: the leader was killed mid-run ($at of $n bound)" test "$at" -lt "$n"
  all_bound() { [ "$(bound_count)" -eq "$n" ]; }
  check "b: every claim bound after the takeover" wait_for 180 "all claims bound" all_bound
  for i in $(seq 1 $n); do
    make_pod "b-pod-$i" e2e-node-$([ $((i % 2)) = 0 ] && echo a || echo b) "b-$i"
  done
  attached_count() { k get volumeattachments -o json | jq '[.items[] | select(.status.attached == true)] | length'; }
  all_attached() { [ "$(attached_count)" -eq "$n" ]; }
  check "b: every volume attached by replica 2's attacher" wait_for 180 "attachments" all_attached
  new_holder() { [ "$(k -n "$NS" get lease pillar-controller -o jsonpath='{.spec.holderIdentity}')" = "${PODS[1]}" ]; }
  check "b: replica 2 took pillar's Lease" wait_for 60 "lease" new_holder
  check "b: one volume on the agent per claim, none orphaned ($(agent_volumes))" test "$(agent_volumes)" -eq "$n"
  check "b: one PillarVolumeState per claim" test "$(k get pillarvolumestates -o name | wc -l)" -eq "$n"
  for i in $(seq 1 $n); do k delete pod "b-pod-$i" --grace-period=0 --force >/dev/null 2>&1; done
  check "b: every volume detached" wait_for 180 "detach" no_attachments
  for i in $(seq 1 $n); do k delete pvc "b-$i" --wait=false >/dev/null; done
  no_pvs() { [ "$(k get pv -o name | wc -l)" -eq 0 ]; }
  check "b: every PV deleted" wait_for 180 "PVs deleted" no_pvs
  check "b: nothing left on the agent" wait_for 60 "agent pool empty" pool_empty
}

# c) Node loss: the node whose pod writes to an RWO volume stops answering; the out-of-service
# taint lets the attach-detach controller force-detach; pillar's ControllerUnpublish revokes
# (the host leaves the subsystem's ACL); the pod runs on another node with every acknowledged
# write. In this stage the lost node's writes cannot be cut off on the data path (the volume is
# a local device, not NVMe/TCP): that half is the kernel lane's s9.
scenario_c() {
  echo "== scenario c: node loss, out-of-service taint, force detach"
  local m
  make_pvc c-data 320Mi ReadWriteOnce
  if ! m=$(pvc_for_pod c-data e2e-node-a c-writer); then fail "c: writer's volume mounted on e2e-node-a"; return; fi
  pass "c: writer's volume mounted on e2e-node-a"
  m=$(on_node e2e-node-a "$m")
  # The writer: each record appended and fsynced before it counts as acknowledged.
  ( i=0; while :; do i=$((i + 1))
      printf '%08d\n' "$i" | dd of="$m/log" oflag=append conv=notrunc,fsync status=none || exit
      echo "$i" >>"$W/acked"; done ) &
  local writer=$!
  echo $writer >"$W/pids/writer"
  sleep 3
  # The node stops answering: its node plugin and its writer freeze.
  stop_proc node-e2e-node-a STOP
  kill -STOP "$writer"
  local acked; acked=$(tail -1 "$W/acked")
  echo "node e2e-node-a frozen after $acked acknowledged writes"
  local pv handle nqn; pv=$(pv_of c-data); handle=$(k get pv "$pv" -o jsonpath='{.spec.csi.volumeHandle}')
  nqn=$(cat "$W/e2e-node-a/hostnqn")
  local taint_at; taint_at=$(date +%T.%N)
  k taint node e2e-node-a node.kubernetes.io/out-of-service=nodeshutdown:NoExecute >/dev/null
  echo "$taint_at out-of-service taint on e2e-node-a"
  check "c: the pod on the lost node is deleted (taint eviction, pod GC)" wait_for 180 "pod gone" gone pod c-writer
  va_gone() { ! va_attached e2e-node-a "$pv" && ! k get volumeattachments -o json |
    jq -e --arg p "$pv" '.items[] | select(.spec.source.persistentVolumeName == $p)' >/dev/null; }
  check "c: the attachment to the lost node is force-detached (ControllerUnpublish answered)" \
    wait_for 180 "force detach" va_gone
  echo "$(date +%T.%N) VolumeAttachment gone"
  local acl; acl=$(find "$W/agent/configfs-double/subsystems" -path "*allowed_hosts/$nqn" 2>/dev/null | wc -l)
  check "c: the lost node's host NQN is out of the subsystem's ACL on the agent" test "$acl" -eq 0
  check "c: pillar's record no longer names the lost node" test \
    "$(k get pillarvolumestate "$handle" -o json | jq '[.status.publishedNodes[]? | select(.node == "e2e-node-a")] | length')" -eq 0
  grep -h "$handle" "$W"/logs/pillar-controller-*.log | grep -iE "revok|unpublish" | tail -3 | cut -c1-220
  grep -h "$handle" "$W/logs/agent.log" | grep -E "RevokeInitiator" | tail -2 | cut -c1-220
  local m2
  if m2=$(pvc_for_pod c-data e2e-node-b c-writer-2); then
    pass "c: the replacement pod's volume attached and mounted on e2e-node-b"
    m2=$(on_node e2e-node-b "$m2")
    local last; last=$(tail -1 "$m2/log" | sed 's/^0*//')
    check "c: every acknowledged write is on the volume (acknowledged $acked, last on disk $last)" \
      test "${last:-0}" -ge "$acked"
  else fail "c: the replacement pod's volume attached and mounted on e2e-node-b"; fi
  # The lost node is rebooted: its processes and its mounts are gone. Then the volume goes.
  kill -KILL "$writer" 2>/dev/null
  stop_proc node-e2e-node-a KILL
  stop_proc ns-e2e-node-a KILL
  delete_pod e2e-node-b c-writer-2
  k delete pvc c-data --wait=false >/dev/null
  volume_gone() { gone pv "$pv" && [ ! -e "$W/pool/$handle.img" ]; }
  check "c: after the lost node's reboot the volume is detached and deleted" \
    wait_for 120 "c-data deleted" volume_gone
  k taint node e2e-node-a node.kubernetes.io/out-of-service- >/dev/null 2>&1
}

# d) (the part without kubelet) The node plugin restarted between stage and unstage: a
# publish, an unpublish and the unstage after the restart find the stage record and finish.
# kubelet's own restart (volume reconstruction) needs a real kubelet: not in this stage.
scenario_d() {
  echo "== scenario d: node plugin restart between stage and unstage"
  local m
  make_pvc d-data 320Mi ReadWriteOnce
  if ! m=$(pvc_for_pod d-data e2e-node-b d-first); then fail "d: volume mounted on e2e-node-b"; return; fi
  check "d: write before the restart" write_data "$(on_node e2e-node-b "$m")"
  stop_proc node-e2e-node-b KILL
  start_node_plugin e2e-node-b
    answers() { "$BIN/pillarctl" --node "$W/e2e-node-b/csi.sock" info; }
  check "d: the node plugin answers again after SIGKILL and restart" wait_for 30 "node plugin" answers
  local m2
  if make_pod d-second e2e-node-b d-data && m2=$(kubelet_mount e2e-node-b d-second d-data); then
    pass "d: a second pod's publish after the restart (stage record found)"
    check "d: the data written before the restart is there" same_data "$(on_node e2e-node-b "$m2")"
  else fail "d: a second pod's publish after the restart"; fi
  both_gone() { delete_pod e2e-node-b d-first && delete_pod e2e-node-b d-second; }
  check "d: unpublish, unpublish and unstage after the restart" both_gone
  none_mounted() { ! grep -q "$(pv_of d-data)" "/proc/$(cat "$W/pids/ns-e2e-node-b")/mounts"; }
  check "d: nothing of the volume left mounted on the node" none_mounted
  local pv; pv=$(pv_of d-data)
  k delete pvc d-data --wait=false >/dev/null
  check "d: volume detached and deleted, nothing left on the agent" wait_for 120 "deleted" pool_empty
}
