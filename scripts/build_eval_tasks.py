"""Rebuild lmrepo's local lm-eval tasks (lmrepo/eval_tasks/*.jsonl) from the held-out Shakespeare split.

    python scripts/build_eval_tasks.py            # rewrites the three jsonl files; same bytes every time

The text is exactly what training holds out: the default run's token stream (data=shakespeare,
GPT-2 BPE, data.val_fraction=0.05: the end of The Two Gentlemen of Verona and The Winter's Tale),
decoded. Its speeches (a SPEAKER. line, then verse or prose; stage directions removed) become:

- speeches.jsonl  {"text"}: every speech of at least MIN_WORDS words (shakespeare_speeches: rolling
  loglikelihood, word and byte perplexity);
- lastword.jsonl  {"text"}: each speech up to its last sentence-ending word, that word last without its
  punctuation, LAMBADA's format (shakespeare_lastword: loglikelihood and greedy accuracy of the last
  word; shakespeare_lastword_gen: the same word generated greedily);
- cloze.jsonl     {"context", "choices", "label"}: the same passages, the true last word against the last
  word of another passage, in a seeded order (shakespeare_cloze: 2-way multiple choice, chance 0.5).
"""

import json
import random
import re
import sys

from lmrepo.data.prepare import open_tokens, prepare_sources
from lmrepo.data.tokenizer import load_tokenizer
from lmrepo.evaluation.tasks import LOCAL_DIR
from lmrepo.plan.compose import load_config
from lmrepo.utils.errors import ConfigError, exit_error

MIN_WORDS = 12  # a passage gives the model something to go on
MAX_WORDS = 120  # and fits a small model's positions (256 tokens) with room to spare
SEED = 1234
SPEAKER = re.compile(r"^[A-Z][A-Z' ]*[A-Z]\.$")  # "LEONTES.", "FIRST LORD."
STAGE_DIRECTION = re.compile(r"\[[^\]]*\]")  # "[Exit.]", "[Music.]" (may span lines)
# the last sentence-ending word: letters only, after a space on its line, before . ! or ?
LAST_WORD = re.compile(r"^(.* )([A-Za-z]{3,})[.!?][^A-Za-z]*$", re.DOTALL)


def held_out_text() -> str:
    config = load_config([])  # the default job: data=shakespeare, the GPT-2 tokenizer
    tokenizer = load_tokenizer(config.model.tokenizer)
    ((directory, _),) = prepare_sources(config.data, tokenizer)
    return tokenizer.decode(open_tokens(directory, "val").tolist())


def speeches(text: str) -> list[str]:
    """Each speech's lines, indentation and stage directions removed; the held-out split's first
    block (it starts mid-sentence) is dropped."""
    found = []
    for block in re.split(r"\n\s*\n", text)[1:]:
        lines = block.strip().split("\n")
        if len(lines) < 2 or not SPEAKER.match(lines[0].strip()):
            continue
        body = STAGE_DIRECTION.sub(" ", "\n".join(line.strip() for line in lines[1:]))
        body = "\n".join(" ".join(line.split()) for line in body.split("\n") if line.strip())
        if MIN_WORDS <= len(body.split()) <= MAX_WORDS:
            found.append(body)
    return found


def last_word_passage(speech: str) -> str | None:
    """The speech up to its last sentence-ending word (punctuation dropped), or None."""
    match = LAST_WORD.match(speech)
    if match is None or len(match.group(1).split()) < MIN_WORDS - 1:
        return None
    return match.group(1) + match.group(2)


def cloze(passages: list[str]) -> list[dict]:
    rng = random.Random(SEED)
    words = [p.rsplit(" ", 1)[1] for p in passages]
    docs = []
    for passage, word in zip(passages, words):
        other = rng.choice([w for w in words if w.lower() != word.lower()])
        label = rng.randrange(2)
        choices = [word, other] if label == 0 else [other, word]
        docs.append({"context": passage.rsplit(" ", 1)[0], "choices": choices, "label": label})
    return docs


def write_jsonl(name: str, docs: list[dict]) -> None:
    (LOCAL_DIR / name).write_text("".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in docs))
    print(f"build_eval_tasks: {LOCAL_DIR / name}: {len(docs)} documents")


def main() -> None:
    try:
        text = held_out_text()
    except ConfigError as err:
        exit_error(str(err))
    kept = speeches(text)
    passages = [p for p in map(last_word_passage, kept) if p is not None]
    write_jsonl("speeches.jsonl", [{"text": s} for s in kept])
    write_jsonl("lastword.jsonl", [{"text": p} for p in passages])
    write_jsonl("cloze.jsonl", cloze(passages))


if __name__ == "__main__":
    sys.exit(main())
