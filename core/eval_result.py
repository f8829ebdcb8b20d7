"""An evaluation's result from its workers' parts, combined exactly, and the standard errors the gates use.

Each worker of an evaluation scores its part of the sample (trainer/eval_sample.py) and writes it (`EvalPart`): the
loss of every sequence it scored, in sample order, the tokens and characters scored, and (rank 0) the text samples.
`combine` makes the result (`EvalResult`): the parts' per-sequence losses in rank order are the sample's, so the
loss is their token-weighted mean (every sequence scores `block_size - 1` tokens: the plain mean, summed exactly
with `fsum`, so the order of the parts cannot change it), and the standard error comes from the same losses.

The standard error is that of the sample's mean as an estimate of the whole validation split's loss: the standard
deviation of the sequences' losses over the square root of their number, times the finite-population correction
sqrt((N - n) / (N - 1)) for a sample of n of the split's N sequences, so it is 0 when the whole split is evaluated.
Two models scored on the same sample differ by the mean of their per-sequence differences, whose standard error
(`paired_standard_error`) is far smaller than the two errors together: most of a sequence's loss is how hard the
sequence is, which both models share.
No TensorFlow here: the evaluate task combines the parts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from core.document import Document, DocumentError, read_fields
from core.text_quality import nats_per_character

# The gates allow this many standard errors of a loss delta beyond their tolerance: a model within tolerance fails
# by the sample's chance alone less than 1 time in 40 (one-sided normal tail at 2 sigma: 2.3%).
GATE_STANDARD_ERRORS = 2.0
RANK_FIELDS = ("rank", "sequences", "read_bytes", "read_time_s", "eval_time_s")


class ResultError(RuntimeError):
    """The parts of an evaluation do not make one result (missing ranks, another sample)."""


def part_url(output_url: str, rank: int, num_workers: int) -> str:
    """Where worker `rank` of `num_workers` writes its part: the result itself for a single worker."""
    if num_workers == 1:
        return output_url
    return f"{output_url.removesuffix('.json')}.rank-{rank}-of-{num_workers}.json"


def standard_error(losses: Sequence[float], population: int) -> float | None:
    """Of the mean of `losses`, n sequences of a split of `population`: 0 for the whole split, None below 2 or
    when a loss is not finite."""
    n = len(losses)
    if n >= population:
        return 0.0
    if n < 2 or not all(math.isfinite(loss) for loss in losses):
        return None
    mean = math.fsum(losses) / n
    variance = math.fsum((loss - mean) ** 2 for loss in losses) / (n - 1)
    return math.sqrt(variance / n * (population - n) / (population - 1))


def paired_standard_error(first: Sequence[float], second: Sequence[float], population: int) -> float | None:
    """Of mean(first) - mean(second), the losses of two models on the same sequences in the same order."""
    if len(first) != len(second):
        return None
    return standard_error([a - b for a, b in zip(first, second, strict=True)], population)


@dataclasses.dataclass(frozen=True)
class EvalPart(Document):
    """One worker's part of an evaluation, as `trainer.evaluate` writes it and the evaluate task reads it back.

    Attributes:
        rank, num_workers: which worker of how many wrote it.
        model: the model scored; sample: the sample's identity (trainer/eval_sample.py).
        sequences: how many of the sample's sequences it scored; sequence_losses: each one's loss, in sample order.
        scored_tokens, characters: the tokens scored and the characters they spell.
        read_bytes, read_time_s: the shard bytes read and the time spent reading; eval_time_s: reading and scoring.
        samples, known_words, sampling: rank 0's text samples, their known-word rates and how they were drawn
            (None on the other ranks).
    """

    rank: int
    num_workers: int
    model: str
    sample: dict[str, Any]
    sequences: int
    sequence_losses: tuple[float, ...]
    scored_tokens: int
    characters: int
    read_bytes: int
    read_time_s: float
    eval_time_s: float
    samples: list[dict[str, Any]] | None = None
    known_words: dict[str, Any] | None = None
    sampling: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """An evaluation's result as the evaluate task reads it back (docs/CONTRACTS.md, "Worker entry points").

    Attributes:
        eval_loss, perplexity: the token-weighted mean loss over the sample and its exponential; eval_tokens: the
            tokens scored; eval_time_s: the slowest worker's reading and scoring.
        eval_loss_se: its standard error over the sample's sequences (0 for the whole split, None below 2
            sequences); nats_per_char, known_words, samples: None in results from before them.
        sample: the sample scored (trainer/eval_sample.py's identity, with `workers` and `read_bytes`); None in
            results from before samples.
        sequence_losses: each sequence's loss in sample order (the paired error of a delta); None before them.
        eval_characters: the characters the scored tokens spell; model: the model scored; sampling: how rank 0
            drew the samples; workers: each rank's `RANK_FIELDS`. None in results from before them.
    Keys it does not model (a later version's) stay in the file for their readers.
    """

    eval_loss: float
    perplexity: float
    eval_tokens: int
    eval_time_s: float
    eval_loss_se: float | None = None
    nats_per_char: float | None = None
    known_words: dict[str, Any] | None = None
    samples: list[dict[str, Any]] | None = None
    sample: dict[str, Any] | None = None
    sequence_losses: tuple[float, ...] | None = None
    eval_characters: int | None = None
    model: str | None = None
    sampling: dict[str, Any] | None = None
    workers: list[dict[str, Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        """The result as its file holds it (`from_json` reads it back)."""
        return {field.name: list(value) if isinstance(value := getattr(self, field.name), tuple) else value
                for field in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, value: Any, source: str) -> EvalResult:
        """The result `value` (read from `source`) holds; ResultError naming the file and the field otherwise."""
        try:
            fields, _others = read_fields(cls, value)  # keys of later versions are left to their readers
        except DocumentError as error:
            raise ResultError(f"{source}: {error.brief}{error.shown}: not an evaluation result; evaluate the model "
                              "again.") from error
        return cls(**fields)

    @property
    def sample_id(self) -> str | None:
        """The id of the sample it scored; None before samples existed."""
        return sample_id(self.sample)


def delta_standard_error(first: EvalResult | None, second: EvalResult | None) -> float | None:
    """The standard error of first's eval loss minus second's: paired when both scored one sample sequence by
    sequence, else both errors together (independent samples); None when either lacks one."""
    if not first or not second:
        return None
    same = first.sample_id is not None and first.sample_id == second.sample_id
    if same and first.sequence_losses and second.sequence_losses and first.sample:
        return paired_standard_error(first.sequence_losses, second.sequence_losses,
                                     first.sample["split_sequences"])
    if first.eval_loss_se is None or second.eval_loss_se is None:
        return None
    return math.hypot(first.eval_loss_se, second.eval_loss_se)


def sample_id(sample: Any) -> str | None:
    """The id of a result's `sample`; None when it has none (results before samples existed)."""
    return sample.get("id") if isinstance(sample, Mapping) and isinstance(sample.get("id"), str) else None


def combine(parts: Sequence[EvalPart]) -> EvalResult:
    """The evaluation's result from every worker's part (any order)."""
    parts = sorted(parts, key=lambda part: part.rank)
    _check_parts(parts)
    first = parts[0]
    losses = tuple(loss for part in parts for loss in part.sequence_losses)
    if not losses:
        raise ResultError("The evaluation scored no sequence: the validation split has none to evaluate.")
    loss = math.fsum(losses) / len(losses)
    tokens = sum(part.scored_tokens for part in parts)
    characters = sum(part.characters for part in parts)
    sample = {**first.sample, "workers": len(parts), "read_bytes": sum(part.read_bytes for part in parts)}
    return EvalResult(
        eval_loss=loss, eval_loss_se=standard_error(losses, sample["split_sequences"]),
        perplexity=math.inf if loss > 700 else math.exp(loss), eval_tokens=tokens, eval_characters=characters,
        nats_per_char=nats_per_character(loss, tokens, characters),
        # Every worker scores at once: the evaluation took as long as its slowest worker.
        eval_time_s=max(part.eval_time_s for part in parts),
        model=first.model, samples=first.samples, known_words=first.known_words, sampling=first.sampling,
        sample=sample, workers=[{name: getattr(part, name) for name in RANK_FIELDS} for part in parts],
        sequence_losses=losses)


def _check_parts(parts: Sequence[EvalPart]) -> None:
    if not parts:
        raise ResultError("No part of the evaluation to combine.")
    count = parts[0].num_workers
    ranks = [part.rank for part in parts]
    if ranks != list(range(count)) or any(part.num_workers != count for part in parts):
        raise ResultError(f"The evaluation's parts come from ranks {ranks}, of a group of {count}: every rank must "
                          "write one.")
    scored, asked = sum(part.sequences for part in parts), parts[0].sample["sequences"]
    if scored != asked:
        raise ResultError(f"The evaluation's parts scored {scored} sequences of a sample of {asked}.")
    samples = {part.sample["id"] for part in parts}
    models = {part.model for part in parts}
    if len(samples) != 1 or len(models) != 1:
        raise ResultError(f"The evaluation's parts scored different samples {sorted(samples)} or models "
                          f"{sorted(models)}: they cannot be combined.")
