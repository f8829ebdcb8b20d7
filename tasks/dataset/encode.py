"""The encoding engine: chunks of documents -> token ids appended to one stream per split, at the tokenizer's speed.

Three threads, each on its own part: a reader prefetches the next chunk from storage while this thread draws each
document's split and calls `encode_batch_fast` (no character offsets, which packing never needs; it spreads the
call over the process's cores with the tokenizer's thread pool and releases the GIL), while a writer turns the
previous call's encodings into ids and appends them. A chunk is about 1 MiB of text, so one call's encodings
take ~30 MB (~110 B of RSS per token), and memory does not grow with the corpus. Consecutive documents of a split
go into one tokenizer input joined by the EOS text where that provably gives the same ids (`joins_at_eos`), which
saves a Python object per document; each document's own length is found at its EOS.
"""

from __future__ import annotations

import contextlib
import itertools
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

from core.layout import SPLITS
from tasks.dataset.ranges import DocumentChunk
from tasks.dataset.records import Extreme
from tasks.dataset.split import DocumentDraws, held_out

log = logging.getLogger("gpt_finetune.prepare")

# Documents joined into one tokenizer input of about this many characters: fewer Python objects than one input per
# document, while longer inputs encoded slower on 1 core (8 KiB: 1.3x the time of 1 KiB, 42 plays, BPE 16384).
INPUT_CHARS = 1 << 10
# Fixed, not taken from the data: whether documents are joined must not depend on which unit a task reads.
JOIN_PROBE = ["First paragraph.", "", " leading space", "trailing newline\n", "\nleading newline", "tab\tand  spaces",
              "naïve café – “quoted” 日本語 😀", "12345 67890", "<|endoftext", "|>", "a"]


# The work around the tokenizer, by its CPU time: reading (fetching, finding documents, decoding), splitting (the
# draws, grouping into tokenizer inputs), ids (the encodings' ids to the streams, the counts).
STEPS = ("reading", "splitting", "ids")


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
    # CPU seconds per step: each step around the tokenizer (`STEPS`, timed on its own thread), and the tokenizer's
    # calls as the rest of the pass's CPU time. Not the calls' wall time: on a core shared with the reader and the
    # writer, that also holds the time those threads ran while the call had released the GIL.
    steps: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("tokenizer", *STEPS), 0.0))

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
class _SplitInputs:
    """One split's part of an encode call: its tokenizer inputs and, in order, the documents they hold."""

    texts: list[str]
    sizes: list[int]  # documents per input
    documents: list[str]
    draws: np.ndarray  # float64, one per document


@dataclass(frozen=True)
class _Inputs:
    """One encode call's tokenizer inputs: the training split's, then the validation split's."""

    splits: tuple[_SplitInputs, _SplitInputs]
    consumed: int

    @property
    def texts(self) -> list[str]:
        return self.splits[0].texts + self.splits[1].texts


class Encoder:
    """Encodes chunks into the per-split streams `outputs` (binary files, appended in document order)."""

    def __init__(self, tokenizer, eos_token: str, eos_id: int, dtype: np.dtype, joined: bool,
                 val_fraction: float, outputs: dict[str, BinaryIO]) -> None:
        self.tokenizer, self.eos_token, self.eos_id, self.dtype = tokenizer, eos_token, eos_id, dtype
        self.joined, self.val_fraction, self.outputs = joined, val_fraction, outputs
        self.stats = EncodeStats()

    def run(self, chunks: Iterable[tuple[DocumentChunk, DocumentDraws]], on_progress=None) -> EncodeStats:
        """Encode every chunk, each with the draws of its file's documents. One pipeline for the whole iterable
        (a unit's parts, file after file): reading the next file overlaps encoding the last one's end."""
        began, cpu_began = time.perf_counter(), time.process_time()
        around_began = sum(self.stats.steps[step] for step in STEPS)
        with _tokenizer_threads(), ThreadPoolExecutor(1, thread_name_prefix="prepare-writer") as writer:
            pending = None
            for inputs in _prefetched(self._timed_inputs(chunks)):
                encodings = self.tokenizer.encode_batch_fast(inputs.texts, add_special_tokens=False)
                if pending is not None:
                    pending.result()
                    if on_progress:
                        on_progress(self.stats)
                pending = writer.submit(self._append, inputs, encodings)
            if pending is not None:
                pending.result()
        cpu_s = time.process_time() - cpu_began
        self.stats.wall_s += time.perf_counter() - began
        self.stats.cpu_s += cpu_s
        self.stats.steps["tokenizer"] += cpu_s - (sum(self.stats.steps[step] for step in STEPS) - around_began)
        return self.stats

    def _timed_inputs(self, chunks: Iterable[tuple[DocumentChunk, DocumentDraws]]) -> Iterator[_Inputs]:
        """Each chunk's inputs, the reader thread's CPU time counted as reading and splitting."""
        steps, clock = self.stats.steps, time.thread_time()
        for chunk, draws in chunks:
            read = time.thread_time()
            inputs = self._inputs(chunk, draws)
            split = time.thread_time()
            steps["reading"] += read - clock
            steps["splitting"] += split - read
            yield inputs
            clock = time.thread_time()

    def _inputs(self, chunk: DocumentChunk, draws: DocumentDraws) -> _Inputs:
        """The chunk's documents drawn into their splits and grouped into tokenizer inputs (on the reader thread)."""
        drawn = draws.array(chunk.keys)
        validation = held_out(drawn, self.val_fraction)
        splits = []
        for mask in (~validation, validation):
            documents = list(itertools.compress(chunk.texts, mask.tolist()))
            splits.append(_SplitInputs(*self._group(documents), documents, drawn[mask]))
        return _Inputs((splits[0], splits[1]), chunk.consumed)

    def _group(self, documents: list[str]) -> tuple[list[str], list[int]]:
        """Tokenizer inputs of about INPUT_CHARS characters, each a run of documents joined by the EOS text and
        ending with it (a run ends where the documents' running length passes a multiple of INPUT_CHARS); one
        document each when not `joined`. The ids do not depend on where the runs end (`joins_at_eos`)."""
        if not self.joined or not documents:
            return documents, [1] * len(documents)
        lengths = np.fromiter(map(len, documents), dtype=np.int64, count=len(documents))
        ends = [*(np.flatnonzero(np.diff(np.cumsum(lengths) // INPUT_CHARS)) + 1).tolist(), len(documents)]
        eos = self.eos_token
        texts = [eos.join(documents[start:end]) + eos for start, end in itertools.pairwise([0, *ends])]
        return texts, np.diff(ends, prepend=0).tolist()

    def _append(self, inputs: _Inputs, encodings: list) -> None:
        """Ids of each split's inputs to its stream, and the counts (run on the writer thread)."""
        began = time.thread_time()
        first = 0
        for name, split in zip(SPLITS, inputs.splits, strict=True):
            own = encodings[first:first + len(split.texts)]
            first += len(split.texts)
            if not own:
                continue
            ids, lengths = self._ids_and_lengths(own, split)
            count = self.stats.splits[name]
            self._track_extreme(count, name == SPLITS[0], split.draws, lengths)
            self.outputs[name].write(ids.tobytes())
            count.tokens += len(ids)
            count.documents += len(split.documents)
        self.stats.consumed += inputs.consumed
        self.stats.steps["ids"] += time.thread_time() - began

    def _ids_and_lengths(self, encodings: list, split: _SplitInputs) -> tuple[np.ndarray, np.ndarray]:
        """The split's ids (every document followed by the EOS) and each document's token count, EOS included."""
        if not self.joined:
            sizes = np.fromiter((len(encoding) + 1 for encoding in encodings), dtype=np.int64, count=len(encodings))
            ids = np.fromiter(itertools.chain.from_iterable((*e.ids, self.eos_id) for e in encodings),
                              dtype=self.dtype, count=int(sizes.sum()))
            return ids, sizes
        sizes = [len(encoding) for encoding in encodings]
        ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=self.dtype,
                          count=sum(sizes))
        ends = np.flatnonzero(ids == self.eos_id)
        if len(ends) == len(split.documents):
            return ids, np.diff(ends + 1, prepend=0)
        return ids, self._lengths_by_input(ids, sizes, split)

    def _lengths_by_input(self, ids: np.ndarray, sizes: list[int], split: _SplitInputs) -> np.ndarray:
        """Each document's length when a document holds the EOS text itself, so that its boundaries are not the EOS
        ids: the documents of an input whose EOS count is off are encoded alone (rare; the others keep theirs)."""
        lengths, start, document = [], 0, 0
        for size, documents in zip(sizes, split.sizes, strict=True):
            own = ids[start:start + size]
            ends = np.flatnonzero(own == self.eos_id)
            if len(ends) == documents:
                lengths += np.diff(ends + 1, prepend=0).tolist()
            else:
                alone = split.documents[document:document + documents]
                lengths += [len(e) + 1 for e in self.tokenizer.encode_batch_fast(alone, add_special_tokens=False)]
            start += size
            document += documents
        return np.array(lengths, dtype=np.int64)

    @staticmethod
    def _track_extreme(count: SplitCount, is_train: bool, draws: np.ndarray, lengths: np.ndarray) -> None:
        """Keep the split's document with the lowest (train) or highest (validation) draw so far."""
        pick = int(np.argmin(draws) if is_train else np.argmax(draws))
        draw = float(draws[pick])
        if count.extreme is None or (draw < count.extreme.draw if is_train else draw > count.extreme.draw):
            count.extreme = Extreme(draw, count.tokens + int(lengths[:pick].sum()), int(lengths[pick]))


def _prefetched(items_made: Iterable[_Inputs], depth: int = 2) -> Iterator[_Inputs]:
    """`items_made`, made ahead by a thread: reading (I/O, splitting, decoding, drawing, joining) overlaps the
    tokenizer's work."""
    items: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for made in items_made:
                if stop.is_set():
                    return
                items.put(("item", made))
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
