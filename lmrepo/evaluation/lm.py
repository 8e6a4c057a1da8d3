"""lm-eval's model interface over a causal LM held in memory: a checkpoint consolidated on the
CPU, or the module of a live DeepSpeed engine (any ZeRO stage, AutoTP).

Requests are scored as the harness's own `hf` model (HFLM) scores them: its tokenization rules,
its sort order and batching (the one-token-continuation cache included), right padding for
loglikelihoods, left padding and its stop sequences for greedy generation. What differs is
distribution: HFLM gets its ranks from accelerate and forwards as many batches as its share
needs; here the ranks are the engine's data-parallel ones, and every rank runs as many forwards
as the busiest (ZeRO-3 gathers each layer's weights from every rank in every forward, so a rank
that stopped early would leave the others waiting).
"""

import inspect

import torch
import torch.distributed as dist
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from lm_eval.models.utils_hf import stop_sequences_criteria
from torch.distributed.tensor import DTensor
from tqdm import tqdm

MAX_GEN_TOKS = 256  # HFLM's default for tasks that set no max_gen_toks


def _longest_first(request) -> tuple:
    """HFLM's order: the longest input first (the first batch sets the padded length)."""
    tokens = request[1] + request[2]
    return -len(tokens), tuple(tokens)


def _score(logprobs: torch.Tensor, continuation: list[int]) -> tuple[float, bool]:
    """(sum of the continuation's log-probabilities, whether greedy decoding yields it)."""
    target = torch.tensor(continuation, device=logprobs.device)
    picked = logprobs[-len(continuation) :]
    return float(picked.gather(1, target[:, None]).sum()), bool((picked.argmax(-1) == target).all())


class LmrepoLM(TemplateLM):
    """`model` must be a transformers causal LM (forward returns .logits, has .generate)."""

    backend = "causal"

    def __init__(self, model, tokenizer, batch_size: int, device: torch.device, group=None, show_progress=False):
        super().__init__()
        self.model, self.tokenizer, self.batch_size, self._device = model, tokenizer, batch_size, device
        self.group = group  # the ranks documents are dealt over (None: all); tensor-parallel peers share theirs
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self._rank = dist.get_rank(group) if distributed else 0
        self._world_size = dist.get_world_size(group) if distributed else 1
        # ZeRO-3 partitions and FSDP2 shards (DTensors): every rank must run every forward (see
        # _in_lockstep); generate() keeps forwarding until all ranks are done (synced_gpus)
        self.synced = distributed and any(hasattr(p, "ds_id") or isinstance(p, DTensor) for p in model.parameters())
        self._max_length = resolve_max_length(model.config, tokenizer)
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.progress = None  # called after every forward or generation: training's watchdog heartbeat
        self.show_progress = show_progress and self._rank == 0  # a bar per request type (scripts/evaluate.py)

    # --- what the harness asks of a model -----------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return MAX_GEN_TOKS

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special = {"add_special_tokens": False}  # as HFLM: a text that starts with BOS gets no second one
        return self.tokenizer.encode(string, **special)

    def get_model_info(self) -> dict:
        params = list(self.model.parameters())
        return {
            "model_num_parameters": sum(getattr(p, "ds_numel", p.numel()) for p in params),
            "model_dtype": str(params[0].dtype),
        }

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        # the harness's own bar (tokenizing) only where this wrapper shows its bars: not in training
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.show_progress)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        # Requests sharing context + continuation[:-1] (multiple choice with one-token answers)
        # share one forward, as HFLM's logits cache does.
        collator = Collator(
            requests, sort_fn=_longest_first, group_by="contexts", group_fn=lambda r: r[-2] + r[-1][:-1]
        )
        scores = []
        for batch in self._bar(self._in_lockstep(list(collator.get_batched(n=self.batch_size))), "loglikelihood"):
            if batch is None:
                self._logprobs([[self.eot_token_id]], [1])
                continue
            # too long: truncated from the left, keeping the continuation (HFLM's rule)
            inputs = [(ctx + cont)[-(self.max_length + 1) :][:-1] for _, ctx, cont in batch]
            for (key, ctx, cont), logprobs in zip(batch, self._logprobs(inputs, [len(cont) for _, _, cont in batch])):
                for _, each, same in collator.get_cache(
                    req_str=key, cxt_toks=ctx, cont_toks=cont, logits=logprobs[None]
                ):
                    scores.append(_score(same[0], each))
        return collator.get_original(scores)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document scored whole in max_length windows (the harness's own windowing), all
        windows of all documents batched together."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        collator = Collator(
            [request.args for request in requests],
            sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
            group_by="gen_kwargs",
            group_fn=lambda r: r[1],
        )
        eos = self.tokenizer.decode(self.eot_token_id)
        texts = []
        for batch in self._bar(self._in_lockstep(list(collator.get_batched(n=self.batch_size))), "generate_until"):
            if batch is None:
                self._generate([[self.eot_token_id]], max_new_tokens=1, stop=[eos])
                continue
            contexts, settings = zip(*batch)
            options = dict(normalize_gen_kwargs(settings[0], self.max_gen_toks))
            stop = handle_stop_sequences(options.pop("until", None), eos=eos)
            new_tokens = options.pop("max_gen_toks")
            for greedy in ("do_sample", "temperature"):  # greedy always (TaskSet refuses sampling tasks)
                options.pop(greedy, None)
            # left-truncated to leave room for the new tokens (HFLM's rule)
            encoded = [self.tok_encode(c)[-(self.max_length - new_tokens) :] for c in contexts]
            for generated in self._generate(encoded, new_tokens, stop, **options):
                texts.append(
                    postprocess_generated_text(self.tokenizer.decode(generated, skip_special_tokens=True), stop, None)
                )
        return collator.get_original(texts)

    # --- distribution: the harness's hooks, over the data-parallel ranks ----------------------

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.stack(parts)

    def gather_object(self, obj, dst: int = 0):
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, group=self.group, group_dst=dst)
        return gathered

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    # --- the model ------------------------------------------------------------------------------

    def _in_lockstep(self, batches: list) -> list:
        """`batches`, then None for each forward this rank owes the busiest rank. The count is
        agreed before any forward: a collective in between would pair with a layer's gather."""
        if not self.synced:
            return batches
        most = torch.tensor([len(batches)], device=self._device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return batches + [None] * (int(most.item()) - len(batches))

    def _bar(self, batches: list, what: str):
        return tqdm(batches, desc=f"{what} batches", disable=not self.show_progress, dynamic_ncols=True)

    @torch.no_grad()
    def _logprobs(self, inputs: list[list[int]], counts: list[int]) -> tuple[torch.Tensor, ...]:
        """Per input, the log-probabilities (fp32) at its last `count` positions, from one forward
        of the right-padded batch (a causal model's real positions never see the padding). Only
        those positions go through the LM head (transformers' logits_to_keep): a small model's
        head over a 50k vocabulary costs more than its blocks."""
        batch = torch.full((len(inputs), max(map(len, inputs))), self.eot_token_id, dtype=torch.long)
        keep = torch.zeros(batch.shape, dtype=torch.bool)
        for row, (tokens, count) in enumerate(zip(inputs, counts)):
            batch[row, : len(tokens)] = torch.tensor(tokens)
            keep[row, len(tokens) - count : len(tokens)] = True
        batch, keep = batch.to(self._device), keep.to(self._device)
        if self.keeps_logits:
            logits = self.model(batch, logits_to_keep=keep).logits  # (kept positions, vocab), row by row
        else:
            logits = self.model(batch).logits[keep]
        if self.progress is not None:
            self.progress()
        return logits.float().log_softmax(-1).split(counts)

    @torch.no_grad()
    def _generate(self, inputs: list[list[int]], max_new_tokens: int, stop: list[str], **options) -> list[list[int]]:
        """Greedy continuations (new tokens only) of left-padded inputs, stopping at `stop`;
        `options`: the task's other generation settings, passed to generate() as HFLM does."""
        width = max(map(len, inputs))
        ids = torch.full((len(inputs), width), self.eot_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, tokens in enumerate(inputs):
            ids[row, width - len(tokens) :] = torch.tensor(tokens)
            mask[row, width - len(tokens) :] = 1
        out = self.model.generate(
            input_ids=ids.to(self._device),
            attention_mask=mask.to(self._device),
            max_length=width + max_new_tokens,
            stopping_criteria=stop_sequences_criteria(self.tokenizer, stop, width, len(inputs)),
            do_sample=False,
            pad_token_id=self.eot_token_id,
            use_cache=True,
            synced_gpus=self.synced,
            **options,
        )
        if self.progress is not None:
            self.progress()
        return out[:, width:].tolist()
