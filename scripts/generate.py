"""Sample from a trained run or a Hugging Face model directory; fill [MASK]s with BERT.

    python scripts/generate.py run=outputs/2026-11-21/12-00-00 prompt="ROMEO:"            # greedy
    python scripts/generate.py run=RUN prompt="ROMEO:" temperature=0.8 top_k=50 top_p=0.95 seed=1
    python scripts/generate.py run=RUN_BERT prompt="the [MASK] of denmark" top_k=5         # fill-mask
    deepspeed --num_gpus 2 scripts/generate.py run=HF_DIR prompt="..."  # DeepSpeed-Inference, AutoTP over 2 ranks

Keys: run, prompt, max_new_tokens (50), temperature (0 = greedy), top_k (0 = off), top_p (1 = off),
seed (1234), dtype (fp32 | bf16 | fp16), json (also write the result there). A run directory is
exported once to RUN/export/<tag>/. Prints the text, tokens/s and the latency per token.
A bad argument or a refused layout: one line on stderr, exit 2.
"""

import sys

from lmrepo.utils import quiet

quiet.install()  # before DeepSpeed is imported: its accelerator notice is no line for the user

from lmrepo.generate import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1:])
