"""BPE training on a bounded sample: a corpus that fits is counted whole, a larger one evenly in windows up to the
cap, the same windows whatever the fan-out; the cap is part of the fingerprint (tests/tasks/dataset/test_stage.py)."""

from __future__ import annotations

import logging

from tasks.dataset.sources import resolve_sources
from tasks.dataset.tokenizer import _Counted, sample_training_texts
from tests.tasks.dataset.corpus import REPO, config, write_corpus


def _sample(tmp_path, corpus, cap_mb: int) -> tuple[list[str], _Counted]:
    cfg = config(tmp_path, dataset=str(corpus / "*.txt"), bpe_sample_mb=cap_mb)
    counted = _Counted()
    texts = [text for batch in sample_training_texts(resolve_sources(cfg.dataset, REPO), cfg, cap_mb << 20, counted,
                                                     3600) for text in batch]
    return texts, counted


def test_a_corpus_under_the_cap_is_sampled_whole_and_a_larger_one_up_to_the_cap(tmp_path, caplog):
    corpus = write_corpus(tmp_path / "corpus", files=3, paragraphs=9000)  # ~3 x 1.4 MB
    total = sum(path.stat().st_size for path in corpus.glob("*.txt"))
    whole, counted = _sample(tmp_path, corpus, 64)
    assert counted.bytes > 0.9 * total  # every training document (the held-out 5% are not counted)
    with caplog.at_level(logging.INFO, logger="gpt_finetune.prepare"):
        capped, counted = _sample(tmp_path, corpus, 1)
    assert 0 < counted.bytes <= 1 << 20 and counted.documents == len(capped)
    assert set(capped) < set(whole)
    assert any("of the windows" in r.getMessage() for r in caplog.records)
    again, _ = _sample(tmp_path, corpus, 1)
    assert again == capped  # the same windows, in the same order


def test_a_tokenizer_larger_than_the_embedding_is_refused_by_name_when_resizing_is_off(tmp_path):
    import json

    import pytest

    from tasks.dataset.errors import PrepareError
    from tasks.dataset.tokenizer import plan_tokenizer

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300,
                                                   "max_position_embeddings": 64}))
    with pytest.raises(PrepareError, match=r"'tokenizer' = 'bpe:512' has 512 tokens, more than the 300 embedding "
                                           r"rows of model .*'resize_embeddings' is false: set it to true"):
        plan_tokenizer(config(tmp_path, model=str(model), resize_embeddings=False))
    plan_tokenizer(config(tmp_path, model=str(model)))  # resized: new rows
    plan_tokenizer(config(tmp_path, model=str(model), tokenizer="bpe:300", resize_embeddings=False))
