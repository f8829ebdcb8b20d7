"""BPE training on a bounded sample: a corpus that fits is counted whole, a larger one evenly in windows up to the
cap, the same windows whatever the fan-out; the cap is part of the fingerprint (tests/tasks/dataset/test_stage.py)."""

from __future__ import annotations

import logging

import numpy as np

from core import storage
from tasks.dataset.sources import resolve_sources
from tasks.dataset.tokenizer import (
    _Counted,
    load_pretrained_tokenizer,
    packing_backend,
    plan_tokenizer,
    sample_training_texts,
    save_tokenizer,
    train_bpe,
)
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


def test_a_checkpoints_tokenizer_joins_documents_with_its_eos_and_adds_no_bos(tmp_path):
    """A Llama-style tokenizer.json (a post-processor that prepends <s>) packs as GPT-2's: each document's ids,
    then the EOS id; the BOS never enters the stream."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from tasks.dataset.stage import prepare_dataset
    from tests.tasks.dataset.corpus import SAMPLE, shard_tokens

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train([str(path) for path in sorted(SAMPLE.glob("*.txt"))],
                    trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(tmp_path / "llama-tokenizer")
    assert fast("To be")["input_ids"][0] == 0  # the checkpoint's own encoding starts with <s>

    result = prepare_dataset(config(tmp_path, tokenizer=str(tmp_path / "llama-tokenizer")))
    manifest = storage.read_json(result.manifest_url)
    assert (manifest["tokenizer"]["eos_token_id"], manifest["tokenizer"]["vocab_size"]) == (1, 400)
    tokens = shard_tokens(result.manifest_url, "train")
    assert 0 not in tokens and np.count_nonzero(tokens == 1) > 100


def test_the_packing_backend_of_a_reloaded_bpe_has_no_empty_affixes_and_the_saved_files_ids(tmp_path):
    """transformers 5 loads a BPE saved without a subword prefix or word suffix with "" for each: packing drops them
    (a new string per character of every merged word otherwise), and the ids stay those of the saved file."""
    from tokenizers import Tokenizer

    corpus = write_corpus(tmp_path / "corpus", files=2, paragraphs=40)
    cfg = config(tmp_path, dataset=str(corpus / "*.txt"), tokenizer="bpe:300")
    trained = train_bpe(resolve_sources(cfg.dataset, REPO), cfg, plan_tokenizer(cfg).sample, 3600)
    save_tokenizer(trained, tmp_path / "tok")
    loaded = load_pretrained_tokenizer(str(tmp_path / "tok"))
    backend = packing_backend(loaded.backend_tokenizer)
    assert (backend.model.continuing_subword_prefix, backend.model.end_of_word_suffix) == (None, None)
    texts = ["the of and to in that", "naïve café – 日本語 😀 was he for", "x" * 300]
    from_file = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    assert [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)] == \
        [e.ids for e in from_file.encode_batch_fast(texts, add_special_tokens=False)]


def test_the_packing_backend_keeps_a_real_subword_prefix():
    from tokenizers import Tokenizer, models

    backend = packing_backend(Tokenizer(models.BPE(vocab={"a": 0, "##b": 1}, merges=[],
                                                   continuing_subword_prefix="##")))
    assert backend.model.continuing_subword_prefix == "##"
