"""The `search` tool: keyword search over a small JSON corpus of short facts.

Scoring is deliberately simple and deterministic so benchmarks and tests can predict the
result: an entry's score is the number of distinct query words (stop words dropped) found
in its title or text, a title match counting one extra; ties go to the smaller id.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

BUNDLED_CORPUS = Path(__file__).parent / "corpus" / "facts.json"
STOP_WORDS = frozenset(
    "a an and are as at be by for from has have how in is it its of on or the to was what "
    "when where which who why with".split()
)


@dataclass(frozen=True)
class Entry:
    id: str
    title: str
    text: str


class Corpus:
    """The entries of one corpus file, tokenized once at load."""

    def __init__(self, entries: list[Entry]) -> None:
        self.entries = sorted(entries, key=lambda e: e.id)
        self._title_words = [words(e.title) for e in self.entries]
        self._all_words = [words(e.title + " " + e.text) for e in self.entries]

    @classmethod
    def load(cls, path: Path) -> Corpus:
        """Read a JSON list of {"id", "title", "text"} objects."""
        return cls([Entry(**item) for item in json.loads(path.read_text(encoding="utf-8"))])

    def search(self, query: str, k: int) -> list[tuple[Entry, int]]:
        """The best `k` entries with their scores; entries sharing no word are left out."""
        query_words = words(query)
        scored = []
        for entry, title, everything in zip(self.entries, self._title_words, self._all_words):
            score = len(query_words & everything) + len(query_words & title)
            if score:
                scored.append((entry, score))
        scored.sort(key=lambda pair: (-pair[1], pair[0].id))
        return scored[:k]


def words(text: str) -> frozenset[str]:
    """Lower-case alphanumeric words of `text`, without stop words."""
    return frozenset(re.findall(r"[a-z0-9]+", text.lower())) - STOP_WORDS
