#!/usr/bin/env bash
# The three ways users reach the CUSTOM backend, on a model with its calibrated codebooks
# next to it (SmolLM2-135M by default): `vllm serve` (OpenAI API), offline `LLM.generate`,
# and `lm_eval --model vllm` (loglikelihood_rolling on held-out text, against FLASH_ATTN).
#   eval/lm_eval/entrypoints.sh [MODEL_DIR] [LOG] [ENGINE_JSON]
# ENGINE_JSON: more engine arguments for all three, as LLM's keyword arguments in JSON (a
# speculative config, say); `vllm serve` gets them as flags. LM_EVAL_TIMEOUT: seconds per
# lm-eval run; PORT: the server's (8123).
set -euo pipefail
MODEL=${1:-eval/data/smollm2}
LOG=${2:-eval/results/entrypoints.log}
ENGINE=${3:-"{}"}
PORT=${PORT:-8123}
SERVE_LOG=$(mktemp)
mkdir -p "$(dirname "$LOG")"
exec > >(tee "$LOG") 2>&1
echo "date: $(date -u +%FT%TZ)  device: $(nvidia-smi --query-gpu=name --format=csv,noheader)"
python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "engine arguments: $ENGINE"
# --key-with-dashes VALUE for each argument; dicts as JSON, booleans as --key / --no-key
mapfile -t FLAGS < <(python - "$ENGINE" <<'PY'
import json, sys
for k, v in json.loads(sys.argv[1]).items():
    flag = "--" + k.replace("_", "-")
    if isinstance(v, bool):
        print(flag if v else "--no-" + flag[2:])
    else:
        print(flag)
        print(json.dumps(v) if isinstance(v, (dict, list)) else v)
PY
)

echo "== 1. vllm serve $MODEL --attention-backend CUSTOM ${FLAGS[*]}"
vllm serve "$MODEL" --attention-backend CUSTOM --max-model-len 2048 \
  --gpu-memory-utilization 0.3 --port $PORT "${FLAGS[@]}" > $SERVE_LOG 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 240); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done
if ! curl -s localhost:$PORT/v1/completions -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"The capital of France is\", \"max_tokens\": 12, \"temperature\": 0}" \
  | python -c "import json,sys; r=json.load(sys.stdin); print('completion:', repr(r['choices'][0]['text']))"; then
  echo "completion: failed; the server's log ends:"; tail -40 $SERVE_LOG
fi
kill $SERVER; wait $SERVER 2>/dev/null || true
grep -E "Using AttentionBackendEnum|vllm_pq_backend|KV cache size" $SERVE_LOG || true

echo "== 2. offline LLM(..., attention_backend=\"CUSTOM\").generate(...)"
python - "$MODEL" "$ENGINE" <<'PY'
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], attention_backend="CUSTOM", max_model_len=2048, gpu_memory_utilization=0.3,
          **json.loads(sys.argv[2]))
out = llm.generate(["The capital of France is", "def fibonacci(n):"], SamplingParams(max_tokens=16, temperature=0))
for o in out:
    print("generate:", repr(o.prompt), "->", repr(o.outputs[0].text))
PY

# lm-eval prints its table only at exit (one run printed nothing in 6 minutes): its full
# log and results go to files next to LOG, the engine runs in-process (no engine-core
# subprocess to wait for at shutdown), and a timeout bounds each run.
for backend in CUSTOM FLASH_ATTN; do
  echo "== 3. lm_eval --model vllm ... attention_backend=$backend"
  out="${LOG%.log}_lm_eval_$backend"
  VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_DATASETS_OFFLINE=1 timeout "${LM_EVAL_TIMEOUT:-900}" lm_eval --model vllm \
    --model_args "$(python -c 'import json, sys; print(json.dumps({"pretrained": sys.argv[1], "attention_backend": sys.argv[2], "max_model_len": 2048, "gpu_memory_utilization": 0.3, **json.loads(sys.argv[3])}))' "$MODEL" "$backend" "$ENGINE")" \
    --tasks pq_heldout --include_path eval/lm_eval --limit 12 --output_path "$out" \
    > "$out.log" 2>&1 || echo "lm_eval exit status $? (log: $out.log)"
  grep -E "^\|" "$out.log" || tail -5 "$out.log"
done
