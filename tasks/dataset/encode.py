"""The encoding engine: chunks of documents -> token ids appended to one stream per split, at the tokenizer's speed.

Three threads, each on its own part: a reader prefetches the next chunk from storage while this thread draws each
document's split and calls `encode_batch_fast` (no character offsets, which packing never needs; it spreads the
call over the process's cores with the tokenizer's thread pool and releases the GIL), while a writer turns the
previous call's encodings into ids and appends them. A chunk is at most a few MiB of text, so one call costs at
most ~110 B of RSS per token it makes, and memory does not grow with the corpus. Consecutive documents of a split
go into one tokenizer input joined by the EOS text where that provably gives the same ids (`joins_at_eos`), which
saves a Python object per document; each document's own length is found at its EOS.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from tasks.dataset.readers import DocumentChunk
from tasks.dataset.split import DocumentDraws

log = logging.getLogger("gpt_finetune.prepare")

INPUT_CHARS = 8 << 10  # documents joined into one tokenizer input of about this many characters
SPLITS = ("train", "validation")
# Fixed, not taken from the data: whether documents are joined must not depend on which unit a task reads.
JOIN_PROBE = ["First paragraph.", "", " leading space", "trailing newline\n", "\nleading newline", "tab\tand  spaces",
              "naïve café – “quoted” 日本語 😀", "12345 67890", "<|endoftext", "|>", "a"]


@dataclass
class Extreme:
    """One split's document with the lowest (train) or highest (validation) draw: the one the "at least one
    validation document, never all" rule may move, with its span in the split's stream of this unit."""

    draw: float
    offset: int  # tokens before it in the split's stream
    tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {"draw": self.draw, "offset": self.offset, "tokens": self.tokens}


@dataclass
class SplitCount:
    documents: int = 0
    tokens: int = 0
    extreme: Extreme | None = None


@dataclass
class EncodeStats:
    """What one encoding pass did (a unit, or the whole corpus in one task)."""

    splits: dict[str, SplitCount] = field(default_factory=lambda: {name: SplitCount() for name in SPLITS})
    consumed: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(split.tokens for split in self.splits.values())

    @property
    def documents(self) -> int:
        return sum(split.documents for split in self.splits.values())


def joins_at_eos(tokenizer, eos_token: str) -> bool:
    """Whether documents joined by the EOS text encode to exactly each document's ids followed by the EOS id.

    It holds when the EOS is an added token matched on the raw text with nothing stripped around it (the tokenizer
    then cuts its input at every EOS before normalizing and pre-tokenizing, so the pieces are encoded as if alone)
    and no other added token can match across a document boundary. A fixed probe is also encoded both ways, which
    catches what the token flags cannot show: a pre-tokenizer that treats only the start of the input specially
    (Metaspace with prepend_scheme "first"), or special tokens not matched in text (encode_special_tokens).
    """
    added = tokenizer.get_added_tokens_decoder()
    eos_ids = [index for index, token in added.items() if token.content == eos_token]
    if len(eos_ids) != 1:
        return False
    eos = added[eos_ids[0]]
    if eos.normalized or eos.lstrip or eos.rstrip or eos.single_word:
        return False
    for token in added.values():
        other = token.content
        if other != eos_token and (eos_token in other or any(
            other.endswith(eos_token[:k]) or other.startswith(eos_token[k:]) for k in range(1, len(eos_token))
        )):
            return False
    separate = [encoding.ids for encoding in tokenizer.encode_batch_fast(JOIN_PROBE, add_special_tokens=False)]
    together = tokenizer.encode(eos_token.join(JOIN_PROBE) + eos_token, add_special_tokens=False).ids
    return together == [token for ids in separate for token in (*ids, eos_ids[0])]


@dataclass(frozen=True)
class _Inputs:
    """One encode call's tokenizer inputs, each holding documents of one split, with what they hold."""

    texts: list[str]
    split: list[int]  # 0 train, 1 validation, per input
    documents: list[list[str]]  # per input, its documents (to encode alone when a document contains the EOS text)
    draws: list[list[float]]
    consumed: int


class Encoder:
    """Encodes chunks into the per-split streams `outputs` (binary files, appended in document order)."""

    def __init__(self, tokenizer, eos_token: str, eos_id: int, dtype: np.dtype, joined: bool,
                 val_fraction: float, outputs: dict[str, BinaryIO]) -> None:
        self.tokenizer, self.eos_token, self.eos_id, self.dtype = tokenizer, eos_token, eos_id, dtype
        self.joined, self.val_fraction, self.outputs = joined, val_fraction, outputs
        self.stats = EncodeStats()

    def run(self, chunks: Iterable[DocumentChunk], draws: DocumentDraws, on_progress=None) -> EncodeStats:
        began, cpu_began = time.perf_counter(), time.process_time()
        with _tokenizer_threads(), ThreadPoolExecutor(1, thread_name_prefix="prepare-writer") as writer:
            pending = None
            for inputs in self._inputs(_prefetched(chunks), draws):
                encodings = self.tokenizer.encode_batch_fast(inputs.texts, add_special_tokens=False)
                if pending is not None:
                    pending.result()
                    if on_progress:
                        on_progress(self.stats)
                pending = writer.submit(self._append, inputs, encodings)
            if pending is not None:
                pending.result()
        self.stats.wall_s += time.perf_counter() - began
        self.stats.cpu_s += time.process_time() - cpu_began
        return self.stats

    def _inputs(self, chunks: Iterator[DocumentChunk], draws: DocumentDraws) -> Iterator[_Inputs]:
        for chunk in chunks:
            texts, splits, documents, chunk_draws = [], [], [], []
            by_split: list[tuple[list[str], list[float]]] = [([], []), ([], [])]
            for text, draw in zip(chunk.texts, draws.draws(chunk.keys), strict=True):
                held_out = int(draw < self.val_fraction)
                by_split[held_out][0].append(text)
                by_split[held_out][1].append(draw)
            for split, (docs, doc_draws) in enumerate(by_split):
                for group, group_draws in self._groups(docs, doc_draws):
                    texts.append(self.eos_token.join(group) + self.eos_token if self.joined else group[0])
                    splits.append(split)
                    documents.append(group)
                    chunk_draws.append(group_draws)
            yield _Inputs(texts, splits, documents, chunk_draws, chunk.consumed)

    def _groups(self, docs: list[str], draws: list[float]) -> Iterator[tuple[list[str], list[float]]]:
        if not self.joined:
            yield from (([doc], [draw]) for doc, draw in zip(docs, draws, strict=True))
            return
        start, chars = 0, 0
        for index, doc in enumerate(docs):
            chars += len(doc)
            if chars >= INPUT_CHARS:
                yield docs[start:index + 1], draws[start:index + 1]
                start, chars = index + 1, 0
        if start < len(docs):
            yield docs[start:], draws[start:]

    def _append(self, inputs: _Inputs, encodings) -> None:
        """Ids of every input to its split's stream, and the counts (run on the writer thread)."""
        chunks: list[list[np.ndarray]] = [[], []]
        for encoding, split, group, group_draws in zip(encodings, inputs.split, inputs.documents, inputs.draws,
                                                        strict=True):
            ids, lengths = self._ids_and_lengths(encoding, group)
            count = self.stats.splits[SPLITS[split]]
            offset = count.tokens + sum(map(len, chunks[split]))
            self._track_extreme(count, split, group_draws, lengths, offset)
            chunks[split].append(ids)
            count.documents += len(group)
        for split, arrays in enumerate(chunks):
            if arrays:
                data = np.concatenate(arrays)
                self.outputs[SPLITS[split]].write(data.tobytes())
                self.stats.splits[SPLITS[split]].tokens += len(data)
        self.stats.consumed += inputs.consumed

    def _ids_and_lengths(self, encoding, group: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The input's ids (every document followed by the EOS) and each document's token count, EOS included."""
        if not self.joined:
            ids = np.fromiter((*encoding.ids, self.eos_id), dtype=self.dtype, count=len(encoding) + 1)
            return ids, np.array([len(ids)])
        ids = np.fromiter(encoding.ids, dtype=self.dtype, count=len(encoding))
        ends = np.flatnonzero(ids == self.eos_id)
        if len(ends) != len(group):  # a document holds the EOS text itself: its boundaries are not the EOS ids
            alone = self.tokenizer.encode_batch_fast(group, add_special_tokens=False)
            lengths = np.array([len(e) + 1 for e in alone])
            return ids, lengths
        return ids, np.diff(ends + 1, prepend=0)

    def _track_extreme(self, count: SplitCount, split: int, draws: list[float], lengths: np.ndarray,
                       offset: int) -> None:
        pick = int(np.argmin(draws)) if split == 0 else int(np.argmax(draws))
        draw = draws[pick]
        better = count.extreme is None or (draw < count.extreme.draw if split == 0 else draw > count.extreme.draw)
        if better:
            count.extreme = Extreme(draw, offset + int(lengths[:pick].sum()), int(lengths[pick]))


def _prefetched(chunks: Iterable[DocumentChunk], depth: int = 2) -> Iterator[DocumentChunk]:
    """`chunks`, read ahead by a thread: reading (I/O, splitting, decoding) overlaps the tokenizer's work."""
    items: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for chunk in chunks:
                if stop.is_set():
                    return
                items.put(("chunk", chunk))
            items.put(("end", None))
        except BaseException as error:  # noqa: BLE001 - re-raised in the consuming thread
            items.put(("error", error))

    reader = threading.Thread(target=produce, name="prepare-reader", daemon=True)
    reader.start()
    try:
        while True:
            kind, item = items.get()
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        stop.set()
        while reader.is_alive():  # let it finish the put it may be blocked in
            with contextlib.suppress(queue.Empty):
                items.get_nowait()
            reader.join(0.05)


@contextlib.contextmanager
def _tokenizer_threads():
    """Let the tokenizer use every core this process may run on, even where the environment switched its thread
    pool off (threads in this process, not a process pool: a forked child of the threaded Airflow task process can
    deadlock on a lock held at fork time)."""
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
