"""Timestamps around each action a pipeline schedule executes on this rank, and the step's bubble.

Both pipeline engines run a per-rank list of actions: torch.distributed.pipelining calls its
stages' forward_one_chunk / backward_one_chunk / backward_weight_one_chunk, DeepSpeed's
PipelineEngine looks each instruction up in its _INSTRUCTION_MAP. Wrapping those (on the
instances, nothing global) gives the time this rank spent computing; the rest of the
schedule's wall time is the bubble: waiting for a neighbour, communicating, scheduling.

Kinds: F forward (the last stage's loss included), B input-gradient backward, W weight-gradient
backward, BW a full backward (B and W in one call: the schedules that do not split it), comm
(blocking send/receive and waits on them), other (DeepSpeed's optimizer step and gradient
reductions inside train_batch: not part of the pipeline's span).
"""

import time
from dataclasses import dataclass
from functools import wraps

COMPUTE = ("F", "B", "W", "BW")


@dataclass
class Action:
    kind: str
    start: float  # seconds since the step began
    end: float
    stage: int | None = None  # torch: the chunk's stage index
    micro_batch: int | None = None


class Timeline:
    """This rank's actions of the last step (begin_step .. end_step)."""

    def __init__(self):
        self.actions: list[Action] = []
        self.origin = time.perf_counter()
        self.seconds = 0.0  # the step's wall time

    def begin_step(self) -> None:
        self.actions, self.origin = [], time.perf_counter()

    def end_step(self) -> None:
        self.seconds = time.perf_counter() - self.origin

    def timed(self, function, kind_of):
        """`function`, each call recorded as the kind kind_of(args, kwargs) returns."""

        @wraps(function)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                kind, stage, micro_batch = kind_of(args, kwargs)
                self.actions.append(
                    Action(kind, start - self.origin, time.perf_counter() - self.origin, stage, micro_batch)
                )

        return wrapper

    def seconds_in(self, *kinds: str) -> float:
        return sum(a.end - a.start for a in self.actions if a.kind in kinds)

    def span(self) -> float:
        """The pipeline's share of the step: its wall time less what is no pipeline action (other)."""
        return self.seconds - self.seconds_in("other")

    def bubble(self) -> float:
        """The fraction of the span this rank computed nothing."""
        span = self.span()
        return max(0.0, 1.0 - self.seconds_in(*COMPUTE) / span) if span > 0 else 0.0


def watch_torch_stages(timeline: Timeline, schedule, stages) -> None:
    """Time the compute actions of a torch.distributed.pipelining schedule on this rank's stages."""
    for stage in stages:
        index = stage.stage_index

        def micro(args, kwargs, index=index):
            return index, args[0] if args else kwargs.get("bwd_chunk_id", kwargs.get("fwd_chunk_id"))

        stage.forward_one_chunk = timeline.timed(stage.forward_one_chunk, lambda a, k, m=micro: ("F", *m(a, k)))
        stage.backward_one_chunk = timeline.timed(
            stage.backward_one_chunk,
            lambda a, k, m=micro: ("BW" if k.get("full_backward", True) else "B", *m(a, k)),
        )
        stage.backward_weight_one_chunk = timeline.timed(
            stage.backward_weight_one_chunk, lambda a, k, m=micro: ("W", *m(a, k))
        )
    # The loss of the last stage's output is computed by the schedule, right after that forward.
    schedule._maybe_compute_loss = timeline.timed(
        schedule._maybe_compute_loss, lambda a, k: ("F", a[0].stage_index, a[3])
    )


DEEPSPEED_KINDS = {
    "ForwardPass": "F",
    "BackwardPass": "BW",
    "SendActivation": "comm",
    "RecvActivation": "comm",
    "SendGrad": "comm",
    "RecvGrad": "comm",
    "OptimizerStep": "other",
    "ReduceGrads": "other",
    "ReduceTiedGrads": "other",
}


def watch_deepspeed_pipeline(timeline: Timeline, engine) -> None:
    """Time the instructions of DeepSpeed's PipelineEngine (its class-level map, copied onto the
    instance, each entry wrapped). LoadMicroBatch stays unnamed: it counts as bubble."""
    timed_map = dict(type(engine)._INSTRUCTION_MAP)
    for instruction, function in timed_map.items():
        kind = DEEPSPEED_KINDS.get(instruction.__name__)
        if kind is not None:
            timed_map[instruction] = timeline.timed(function, lambda a, k, kind=kind: (kind, None, k.get("buffer_id")))
    engine._INSTRUCTION_MAP = timed_map
