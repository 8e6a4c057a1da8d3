"""Downstream evaluation with lm-evaluation-harness on a run's checkpoint or a Hugging Face model.

    python scripts/evaluate.py run=outputs/2026-11-21/12-00-00 tasks=shakespeare     # the local tasks, offline
    python scripts/evaluate.py run=RUN tasks=lambada_openai,hellaswag limit=500      # hub tasks (online, or cached)
    python scripts/evaluate.py run=RUN checkpoint=step_00000200 tasks=shakespeare_lastword batch_size=16
    python scripts/evaluate.py run=HF_DIR tasks=shakespeare_cloze
    deepspeed --num_gpus 2 scripts/evaluate.py run=RUN tasks=shakespeare         # documents split over 2 ranks

Keys: run, tasks (comma-separated), checkpoint (a tag; default: latest), limit (documents per task),
batch_size (8), bootstrap_iters (1000), wandb (true). A checkpoint of any ZeRO stage or a pipeline
is consolidated in memory (nothing exported). Writes RUN/eval/<tag>.json (the harness's format),
one line per task in RUN/metrics.jsonl and the W&B run's summary. A bad argument, BERT, a
tensor-parallel checkpoint or a hub task without network: one line on stderr, exit 2.
"""

import sys

from lmrepo.utils import quiet

quiet.install()  # before DeepSpeed is imported: its accelerator notice is no line for the user

from lmrepo.evaluate import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1:])
