"""Small random models with the attention of models users serve, for the entry-point run
(eval/lm_eval/entrypoints.sh): gpt-oss's (attention sinks, 64 query / 8 KV heads of
head_dim 64, sliding-window and full layers) and Qwen3-8B's (QK-norm, 32 query / 8 KV heads
of head_dim 128), two layers each. The folders are the test suite's (tests/test_calibrate.py,
tests/test_qwen3.py); the codebooks come from calibrate's defaults on text of the models'
own words and land next to the model, where the backend looks.

    python eval/lm_eval/tiny_models.py {gpt-oss,qwen3} DIR
"""

import argparse
import random
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from test_calibrate import WORDS, gpt_oss_model  # noqa: E402
from test_qwen3 import tiny_qwen3  # noqa: E402

BUILDERS = {"gpt-oss": gpt_oss_model, "qwen3": tiny_qwen3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", choices=BUILDERS)
    p.add_argument("out", help="the model folder to write")
    args = p.parse_args()
    out = Path(args.out)
    BUILDERS[args.model](out)
    rng = random.Random(0)
    text = out / "calibration.txt"
    text.write_text(" ".join(rng.choice(WORDS) for _ in range(20000)))
    subprocess.run([sys.executable, "-m", "vllm_pq_backend.calibrate", "--model", str(out),
                    "--text", str(text), "--tokens", "16384", "--seq-len", "1024"], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
