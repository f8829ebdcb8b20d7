"""core/text_quality.py: the known-word rate and nats per character, on fixed text."""

import pytest

from core.text_quality import known_word_rate, nats_per_character, sample_words, words

TRAINING_TEXT = """KING. Now is the winter of our discontent
Made glorious summer by this sun of York; 'tis o'er the house."""


def test_words_are_letter_runs_with_inner_apostrophes_in_lower_case():
    assert words("Now is the WINTER; 'tis o'er 3 times, Gloucester's") == [
        "now", "is", "the", "winter", "tis", "o'er", "times", "gloucester's"]


def test_a_sample_cut_inside_its_last_word_does_not_count_that_word():
    assert sample_words(" the winter of our disc") == ["the", "winter", "of", "our"]
    assert sample_words(" the winter of our.\n") == ["the", "winter", "of", "our"]
    assert sample_words(",,,,") == []


def test_known_word_rate_on_a_fixed_text():
    vocabulary = set(words(TRAINING_TEXT))
    samples = [" Now is the summer of thyYou,", " glorious sun of Yorkshire dis", ".].].]"]
    # Words: now is the summer of [thyyou] | glorious sun of [yorkshire] ("dis" is cut off) -> 8 of 10 known.
    rate, counted = known_word_rate(samples, vocabulary)
    assert counted == 10 and rate == pytest.approx(0.8)


def test_known_word_rate_is_none_for_samples_without_words():
    assert known_word_rate([",,,,,,", ".].].]"], {"the"}) == (None, 0)


def test_nats_per_character_spreads_the_tokens_loss_over_their_characters():
    # 100 predicted tokens at 3.0 nats spelling 250 characters: 300 nats / 250 characters.
    assert nats_per_character(3.0, 100, 250) == pytest.approx(1.2)
    assert nats_per_character(3.0, 100, 0) is None
