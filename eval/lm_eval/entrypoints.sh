#!/usr/bin/env bash
# The three ways users reach the CUSTOM backend, on SmolLM2-135M with its calibrated
# codebooks next to the model: `vllm serve` (OpenAI API), offline `LLM.generate`, and
# `lm_eval --model vllm` (loglikelihood_rolling on held-out text, against FLASH_ATTN).
#   eval/lm_eval/entrypoints.sh [MODEL_DIR] [LOG]      (LM_EVAL_TIMEOUT: seconds per lm-eval run)
set -euo pipefail
MODEL=${1:-eval/data/smollm2}
LOG=${2:-eval/results/entrypoints.log}
mkdir -p "$(dirname "$LOG")"
exec > >(tee "$LOG") 2>&1
echo "date: $(date -u +%FT%TZ)  device: $(nvidia-smi --query-gpu=name --format=csv,noheader)"
python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"

echo "== 1. vllm serve $MODEL --attention-backend CUSTOM"
vllm serve "$MODEL" --attention-backend CUSTOM --max-model-len 2048 \
  --gpu-memory-utilization 0.3 --port 8123 > serve.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 240); do curl -sf localhost:8123/health >/dev/null && break; sleep 1; done
curl -s localhost:8123/v1/completions -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"The capital of France is\", \"max_tokens\": 12, \"temperature\": 0}" \
  | python -c "import json,sys; r=json.load(sys.stdin); print('completion:', repr(r['choices'][0]['text']))"
kill $SERVER; wait $SERVER 2>/dev/null || true
grep -E "Using AttentionBackendEnum|vllm_pq_backend|KV cache size" serve.log || true

echo "== 2. offline LLM(..., attention_backend=\"CUSTOM\").generate(...)"
python - "$MODEL" <<'PY'
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], attention_backend="CUSTOM", max_model_len=2048, gpu_memory_utilization=0.3)
out = llm.generate(["The capital of France is", "def fibonacci(n):"], SamplingParams(max_tokens=16, temperature=0))
for o in out:
    print("generate:", repr(o.prompt), "->", repr(o.outputs[0].text))
PY

# lm-eval prints its table only at exit (one run printed nothing in 6 minutes): its full
# log and results go to files next to LOG, the engine runs in-process (no engine-core
# subprocess to wait for at shutdown), and a timeout bounds each run.
for backend in CUSTOM FLASH_ATTN; do
  echo "== 3. lm_eval --model vllm ... attention_backend=$backend"
  out="$(dirname "$LOG")/lm_eval_$backend"
  VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_DATASETS_OFFLINE=1 timeout "${LM_EVAL_TIMEOUT:-900}" lm_eval --model vllm \
    --model_args "pretrained=$MODEL,attention_backend=$backend,max_model_len=2048,gpu_memory_utilization=0.3" \
    --tasks pq_heldout --include_path eval/lm_eval --limit 12 --output_path "$out" \
    > "$out.log" 2>&1 || echo "lm_eval exit status $? (log: $out.log)"
  grep -E "^\|" "$out.log" || tail -5 "$out.log"
done
