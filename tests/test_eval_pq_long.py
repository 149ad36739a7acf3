"""eval/lm_eval/pq_long.py's reading of lm-eval's results: one accuracy per task and prompt
length that has prompts (pq_long_utils gives the others -1), and the model arguments it
hands `lm_eval --model vllm` as JSON."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval" / "lm_eval"))
import pq_long  # noqa: E402
from pq_long_utils import mean_of_present, process_results  # noqa: E402


def test_scores_keep_the_lengths_that_have_prompts():
    docs = [dict(task="passkey", length=2048, answer="123456"),
            dict(task="passkey", length=2048, answer="654321"),
            dict(task="passkey", length=8192, answer="111111")]
    outputs = ["The pass key is 123456.", "1", " 111111"]
    per_doc = [process_results(d, [o]) for d, o in zip(docs, outputs)]
    row = {f"{n},none": mean_of_present([r[n] for r in per_doc]) for n in per_doc[0]}
    results = {"results": {f"pq_long_{t}": row for t in pq_long.TASKS}}
    assert pq_long.scores(results) == {t: {"2048": 0.5, "8192": 1.0} for t in pq_long.TASKS}


def test_model_args_name_the_codebooks_for_custom_only():
    base = pq_long.model_args("m", "FLASH_ATTN", None, 8192, kv_cache_memory_bytes=None)
    assert "kv_cache_memory_bytes" not in base
    assert "additional_config" not in base
    custom = pq_long.model_args("m", "CUSTOM", "/b.safetensors", 8192)
    assert custom["additional_config"] == {"pq": {"codebooks": "/b.safetensors"}}
    assert json.loads(json.dumps(custom)) == custom  # lm-eval reads --model_args as JSON
