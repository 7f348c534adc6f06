#!/usr/bin/env bash
# 1 prefill + 1 decode instance and the proxy on this machine, in host emulation (no NPU):
# the decode instance pulls each prompt's KV cache from the prefill instance over Mooncake (TCP).
#
#   pip install 'dist/vllm-0.34.0+ascend.1-py3-none-any.whl[mooncake-host]'
#   apt-get install libibverbs1 libnuma1        # the Mooncake engine's system libraries
#   examples/disaggregated_prefill/run_1p1d_host.sh [MODEL_DIR]
#
# With no MODEL_DIR a tiny random Qwen2 is made first (examples/make_tiny_model.py).
# The script sends one request through the proxy and one to the decode instance alone
# (colocated), prints both, and keeps serving on http://127.0.0.1:$PROXY_PORT until Ctrl-C.
# ONESHOT=1 stops after the two requests instead (exit status 1 if they differ).
# Ports: PREFILL_PORT (8100), DECODE_PORT (8200), PROXY_PORT (9000), KV control ports
# 21100 (prefill) and 22100 (decode); logs in LOGS (/tmp/pd-example-logs). The three share
# the P/D secret VLLM_ASCEND_KV_SECRET (a fresh one when it is not set); everything binds
# 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${1:-/tmp/pd-example-model}
PREFILL_PORT=${PREFILL_PORT:-8100}; DECODE_PORT=${DECODE_PORT:-8200}; PROXY_PORT=${PROXY_PORT:-9000}
LOGS=${LOGS:-/tmp/pd-example-logs}; mkdir -p "$LOGS"
if [ ! -d "$MODEL" ]; then
  echo "making a tiny random Qwen2 in $MODEL ..."
  python examples/make_tiny_model.py --arch qwen2 --out "$MODEL"
fi
export VLLM_ASCEND_EMULATE=1
export VLLM_NO_USAGE_STATS=1  # upstream reports usage statistics unless told not to
# the deployment's shared P/D secret: the instances and the proxy sign and check with it
if [ -z "${VLLM_ASCEND_KV_SECRET:-}" ]; then
  VLLM_ASCEND_KV_SECRET=$(python -m vllm.ascend.kv_transfer.trust new-secret)
  export VLLM_ASCEND_KV_SECRET
fi
kv() {
  echo "{\"kv_connector\":\"AscendP2PConnector\",\"kv_role\":\"$1\",\"kv_port\":$2,\
\"kv_connector_extra_config\":{\"host\":\"127.0.0.1\"}}"
}

pids=()
stop() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap stop EXIT
vllm serve "$MODEL" --host 127.0.0.1 --port "$PREFILL_PORT" --max-model-len 1024 --dtype float32 \
  --kv-transfer-config "$(kv kv_producer 21100)" > "$LOGS/prefill.log" 2>&1 &
pids+=($!)
vllm serve "$MODEL" --host 127.0.0.1 --port "$DECODE_PORT" --max-model-len 1024 --dtype float32 \
  --kv-transfer-config "$(kv kv_consumer 22100)" > "$LOGS/decode.log" 2>&1 &
pids+=($!)
python -m vllm.ascend.kv_transfer.proxy --prefill "http://127.0.0.1:$PREFILL_PORT" \
  --decode "http://127.0.0.1:$DECODE_PORT" --host 127.0.0.1 --port "$PROXY_PORT" > "$LOGS/proxy.log" 2>&1 &
pids+=($!)

i=0
for port in "$PREFILL_PORT" "$DECODE_PORT" "$PROXY_PORT"; do
  echo "waiting for port $port (logs in $LOGS) ..."
  until curl -sf "127.0.0.1:$port/health" > /dev/null; do
    kill -0 "${pids[$i]}" 2>/dev/null || { echo "the process for port $port exited; see $LOGS"; exit 1; }
    sleep 2
  done
  i=$((i + 1))
done

request() {
  curl -sf "127.0.0.1:$1/v1/completions" -H 'Content-Type: application/json' -d "{\"model\": \"$MODEL\", \
\"prompt\": \"Paged attention keeps keys and values in blocks\", \"max_tokens\": 16, \"temperature\": 0}" |
    python -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["text"])'
}
via_proxy=$(request "$PROXY_PORT")
colocated=$(request "$DECODE_PORT")
echo "1P1D through the proxy: $via_proxy"
echo "decode instance alone:  $colocated"
if [ "$via_proxy" != "$colocated" ]; then
  echo "the outputs differ"; exit 1
fi
echo "equal greedy output"
if [ "${ONESHOT:-0}" = 1 ]; then
  exit 0
fi
echo "the proxy serves on http://127.0.0.1:$PROXY_PORT; press Ctrl-C to stop"
wait
