"""Figures that say whether a model writes the corpus's language, whatever its tokenizer: the known-word rate of
its samples and the eval loss in nats per character.

- Known-word rate: the share of the words a model generates that occur in the training text. A model that has
  not learned yet writes punctuation runs or word fragments (`,,,,` or `thyYou`): its rate is low whatever its
  loss. Words are runs of letters with inner apostrophes (`o'er`, `'tis` -> `tis`), compared in lower case.
- Nats per character: the loss per predicted token times tokens per character of the text they spell. It does
  not depend on the tokenizer, so it compares with character-level figures (nanoGPT's Shakespeare recipe).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

WORD = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)*")


def words(text: str) -> list[str]:
    """The words of `text`, lower-cased, in order."""
    return WORD.findall(text.lower())


def sample_words(text: str) -> list[str]:
    """The words of a generated continuation, less a last word cut off by the token limit (text ends inside it)."""
    found = words(text)
    if found and WORD.search(text[-1:]):
        found.pop()
    return found


def known_word_rate(texts: Iterable[str], vocabulary: set[str]) -> tuple[float | None, int]:
    """(share of the texts' words found in `vocabulary`, number of words); None when they hold no word at all."""
    generated = [word for text in texts for word in sample_words(text)]
    if not generated:
        return None, 0
    return sum(word in vocabulary for word in generated) / len(generated), len(generated)


def nats_per_character(mean_loss: float, predicted_tokens: int, characters: int) -> float | None:
    """Total nats over the characters the predicted tokens spell; None for no characters."""
    return mean_loss * predicted_tokens / characters if characters else None
