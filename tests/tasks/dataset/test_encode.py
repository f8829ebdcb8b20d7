"""The encoding engine on its own: the streams are every document's ids and the EOS, in order, and each split's
extreme document (the one the "at least one validation document" rule may move) has its true span, also when a
document holds the EOS text itself and its input must be measured document by document."""

from __future__ import annotations

import io

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tasks.dataset.encode import SPLITS, STEPS, Encoder, joins_at_eos
from tasks.dataset.ranges import DocumentChunk
from tasks.dataset.split import DocumentDraws

EOS = "<|endoftext|>"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards", "quietly",
         "hex", "jumbo", "vexing", "daft", "zebras"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator([" ".join(WORDS)] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return backend


def documents(count: int, eos_every: int = 0) -> list[str]:
    """Documents of 1 to ~40 words; every `eos_every`-th one holds the EOS text in its middle."""
    rng = np.random.default_rng(3)
    out = []
    for index in range(count):
        words = [WORDS[i] for i in rng.integers(0, len(WORDS), size=int(rng.integers(1, 40)))]
        if eos_every and index % eos_every == 0:
            words.insert(len(words) // 2, EOS)
        out.append(" ".join(words))
    return out


def encode(tokenizer: Tokenizer, texts: list[str], chunk_documents: int, joined: bool):
    """Run the engine over `texts` in chunks of `chunk_documents`; the streams, stats and each document's draw."""
    draws = DocumentDraws(seed=11, relpath="corpus.txt")
    keys = list(range(0, 100 * len(texts), 100))
    outputs = {split: io.BytesIO() for split in SPLITS}
    encoder = Encoder(tokenizer, EOS, tokenizer.token_to_id(EOS), np.dtype(np.uint16), joined, 0.3, outputs)
    chunks = [(DocumentChunk(keys[i:i + chunk_documents], texts[i:i + chunk_documents], 1), draws)
              for i in range(0, len(texts), chunk_documents)]
    stats = encoder.run(chunks)
    streams = {split: np.frombuffer(out.getvalue(), np.uint16) for split, out in outputs.items()}
    return streams, stats, draws.array(keys).tolist()


@pytest.mark.parametrize("chunk_documents", [90, 1], ids=["chunks", "one-document-chunks"])
@pytest.mark.parametrize("eos_every", [0, 7], ids=["plain", "documents-holding-the-eos-text"])
@pytest.mark.parametrize("joined", [True, False], ids=["joined", "one-per-input"])
def test_streams_hold_each_document_then_the_eos_and_the_extremes_have_their_spans(tokenizer, joined, eos_every,
                                                                                   chunk_documents):
    texts = documents(600, eos_every)
    eos_id = tokenizer.token_to_id(EOS)
    alone = [[*e.ids, eos_id] for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    streams, stats, draws = encode(tokenizer, texts, chunk_documents=chunk_documents, joined=joined)
    for split, held_out in zip(SPLITS, (False, True), strict=True):
        mine = [index for index, draw in enumerate(draws) if (draw < 0.3) == held_out]
        expected = [token for index in mine for token in alone[index]]
        np.testing.assert_array_equal(streams[split], expected)
        count = stats.splits[split]
        assert (count.documents, count.tokens) == (len(mine), len(expected))
        pick = min(mine, key=lambda i: draws[i]) if split == "train" else max(mine, key=lambda i: draws[i])
        offset = sum(len(alone[index]) for index in mine[:mine.index(pick)])
        assert (count.extreme.draw, count.extreme.offset, count.extreme.tokens) == (
            draws[pick], offset, len(alone[pick]))


def test_each_step_around_the_tokenizer_is_timed(tokenizer):
    _, stats, _ = encode(tokenizer, documents(300), chunk_documents=50, joined=True)
    assert list(stats.steps) == ["tokenizer", *STEPS] == ["tokenizer", "reading", "splitting", "ids"]
    assert stats.steps["tokenizer"] > 0 and stats.steps["ids"] > 0
    assert all(seconds >= 0 for seconds in stats.steps.values()), stats.steps
    # CPU time, not the calls' wall time: what the reader and writer threads ran during a call is theirs alone.
    assert sum(stats.steps.values()) == pytest.approx(stats.cpu_s)


def test_the_probe_allows_joining_for_a_byte_level_bpe(tokenizer):
    assert joins_at_eos(tokenizer, EOS)
