# Stage 3's scenario f (issue 25): delivery of a node's DH-HMAC-CHAP pair, with the real API
# server reviewing real projected tokens. Sourced by tests/k8s/stage3.sh (which has deployed the
# overlay and made the TLS material, the endpoint's included).
#   - The PillarProtocol requires DH-HMAC-CHAP (set here when it does not); a pod's volume is
#     staged: the node plugin, which got no secret from kubelet, asked the controller's endpoint
#     with its projected token (audience pillar-csi.io/node-credentials), the controller had the
#     API server review it and answered; the node plugin's log says the pair was delivered, in
#     the stage's span (the volume ID), and the volume's AuthDisabled condition is False (its
#     storage node set the keys of the admitted host).
#   - `pillar-csi check-node-credentials` in the node plugin's pod: delivered.
#   - A pod of another ServiceAccount (default/default) on the same node, with a projected token
#     of the right audience, the CA, and this node's name and host NQN: refused,
#     PERMISSION_DENIED, and the controller's log names the account it refused.

AUDIENCE=pillar-csi.io/node-credentials

controller_logs() { # SINCE
  local p
  for p in $(k -n "$NS" get pods -l app=pillar-controller -o jsonpath='{.items[*].metadata.name}'); do
    k -n "$NS" logs "$p" -c pillar --since-time="$1" 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g'
  done
}

# rogue_pod_json NAME HOSTNQN ENDPOINT SERVER_NAME: a pod of default/default on NODE asking for
# NODE's pair with its own projected token of the endpoint's audience.
rogue_pod_json() {
  jq -n --arg n "$1" --arg nqn "$2" --arg ep "$3" --arg sn "$4" --arg node "$NODE" \
    --arg aud "$AUDIENCE" --arg img "$(k -n "$NS" get ds pillar-node -o jsonpath='{.spec.template.spec.containers[0].image}')" \
    '{apiVersion: "v1", kind: "Pod", metadata: {name: $n, labels: {"pillar-e2e": "stage3"}},
      spec: {serviceAccountName: "default", nodeName: $node, hostNetwork: true,
        restartPolicy: "Never", terminationGracePeriodSeconds: 1,
        containers: [{name: "rogue", image: $img, imagePullPolicy: "IfNotPresent",
          command: ["sh", "-c", "echo \($nqn) >/tmp/hostnqn && exec pillar-csi check-node-credentials --hostnqn-file=/tmp/hostnqn --credentials-endpoint=\($ep) --credentials-server-name=\($sn) --credentials-ca=/ca/ca.crt --credentials-token-file=/token/token"],
          env: [{name: "NODE_NAME", value: $node}],
          volumeMounts: [{name: "token", mountPath: "/token"}, {name: "ca", mountPath: "/ca"}]}],
        volumes: [
          {name: "token", projected: {sources: [{serviceAccountToken: {audience: $aud,
            expirationSeconds: 600, path: "token"}}]}},
          {name: "ca", configMap: {name: "e2e-credentials-ca"}}]}}'
}

scenario_f_credentials_delivery() {
  local since auth pvc=e2e-auth pod=e2e-auth handle args endpoint server_name nqn out phase
  echo "f) delivery of a node's DH-HMAC-CHAP pair"
  since=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  auth=$(k get pillarprotocol nvme-tcp -o jsonpath='{.spec.nvmeTcp.auth}')
  if [ "$auth" != dhchap ]; then
    k patch pillarprotocol nvme-tcp --type merge -p '{"spec":{"nvmeTcp":{"auth":"dhchap"}}}' >/dev/null
    echo "PillarProtocol nvme-tcp: auth $auth -> dhchap for this scenario"
  fi
  pvc_json "$pvc" 1Gi | k apply -f - >/dev/null
  pod_json "$pod" "$pvc" 'echo hello >/data/f && sleep 3600' | k apply -f - >/dev/null
  check "f) a pod with a volume of an auth: dhchap protocol runs" wait_for 240 "pod $pod" pod_running "$pod"
  handle=$(k get pv "$(k get pvc "$pvc" -o jsonpath='{.spec.volumeName}')" -o jsonpath='{.spec.csi.volumeHandle}')
  out=$(node_plugin_log --since-time="$since" | grep "pair was delivered by the controller" | grep -F "$handle")
  if [ -n "$out" ]; then
    pass "f) the node plugin's log: its pair was delivered for volume $handle"
    echo "  $(echo "$out" | head -n 1)"
  else
    fail "f) no delivery of the node's pair in the node plugin's log for volume $handle"
  fi
  out=$(controller_logs "$since" | grep "delivered the node's DH-HMAC-CHAP pair to that node" | grep -F "$handle")
  if [ -n "$out" ]; then
    pass "f) a controller's log: the reviewed token got node $NODE its pair"
    echo "  $(echo "$out" | head -n 1)"
  else
    fail "f) no delivery in the controllers' logs"
  fi
  out=$(k get pillarvolumestate "$handle" -o json | jq -r '.status.conditions[]
    | select(.type == "AuthDisabled") | "\(.status) \(.reason)"')
  if [ "${out%% *}" = False ]; then pass "f) AuthDisabled of $handle: $out"; else fail "f) AuthDisabled of $handle: $out"; fi

  args=$(k -n "$NS" get ds pillar-node -o json | jq -r '.spec.template.spec.containers[0].args[]')
  endpoint=$(echo "$args" | sed -n 's/^--credentials-endpoint=//p')
  server_name=$(echo "$args" | sed -n 's/^--credentials-server-name=//p')
  server_name=${server_name:-pillar-controller.$NS.svc}
  if out=$(in_node_plugin pillar-csi check-node-credentials --credentials-endpoint="$endpoint" \
      --credentials-server-name="$server_name" 2>&1); then
    pass "f) check-node-credentials in the node plugin's pod: delivered"
    echo "  $(echo "$out" | sed 's/\x1b\[[0-9;]*m//g' | tail -n 1)"
  else
    fail "f) check-node-credentials in the node plugin's pod: $out"
  fi

  nqn=$(in_node_plugin cat /etc/nvme/hostnqn | tr -d '\r\n')
  k delete configmap e2e-credentials-ca --ignore-not-found >/dev/null 2>&1
  k create configmap e2e-credentials-ca --from-file=ca.crt="$W/tls/ca.crt" >/dev/null
  rogue_pod_json e2e-rogue "$nqn" "$endpoint" "$server_name" | k apply -f - >/dev/null
  rogue_done() { phase=$(k get pod e2e-rogue -o jsonpath='{.status.phase}'); [ "$phase" = Failed ] || [ "$phase" = Succeeded ]; }
  wait_for 120 "pod e2e-rogue" rogue_done >/dev/null
  out=$(k logs e2e-rogue 2>&1 | sed 's/\x1b\[[0-9;]*m//g')
  phase=$(k get pod e2e-rogue -o jsonpath='{.status.phase}')
  if [ "$phase" = Failed ] && echo "$out" | grep -q PermissionDenied &&
      echo "$out" | grep -q "system:serviceaccount:default:default"; then
    pass "f) a pod of default/default with a token of audience $AUDIENCE is refused node $NODE's pair"
    echo "  $(echo "$out" | tail -n 1)"
  else
    fail "f) the other ServiceAccount's pod ($phase): $out"
  fi
  out=$(controller_logs "$since" | grep "pair was refused" | grep -F "default:default")
  if [ -n "$out" ]; then
    pass "f) a controller's log names the refused account"
    echo "  $(echo "$out" | head -n 1)"
  else
    fail "f) no refusal in the controllers' logs"
  fi

  k delete pod e2e-rogue "$pod" --grace-period=1 --wait=true --timeout=120s >/dev/null 2>&1
  k delete configmap e2e-credentials-ca --ignore-not-found >/dev/null 2>&1
  k delete pvc "$pvc" --wait=true --timeout=120s >/dev/null 2>&1
  if [ "$auth" != dhchap ]; then
    k patch pillarprotocol nvme-tcp --type merge -p "{\"spec\":{\"nvmeTcp\":{\"auth\":\"$auth\"}}}" >/dev/null
  fi
}
