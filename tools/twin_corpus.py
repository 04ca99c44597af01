#!/usr/bin/env python3
"""Writes the text the twin suite's token models train on: 1 MB drawn from a
word-bigram chain of dsl-examples/data/founding-texts.txt with a fixed seed.

The same bytes on every machine and at every commit, so a parity figure can
be compared between runs (a corpus cut from the repository's own sources
changed the batches, and with them the training path, at every commit),
with enough variety that 50 steps of 8 x 256 tokens never see a window
twice.

    python3 tools/twin_corpus.py OUT.txt
"""

import os
import random
import sys


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: twin_corpus.py OUT.txt")
    here = os.path.dirname(os.path.abspath(__file__))
    words = open(os.path.join(here, "..", "dsl-examples", "data", "founding-texts.txt")).read().split()
    follows = {}
    for a, b in zip(words, words[1:] + words[:1]):
        follows.setdefault(a, []).append(b)
    rng = random.Random(0)
    out, size, w = [], 0, words[0]
    while size < 1_000_000:
        out.append(w)
        size += len(w) + 1
        # Mostly the text's own next word, now and then any word: varied but learnable.
        w = rng.choice(follows[w]) if rng.random() < 0.85 else rng.choice(words)
    with open(sys.argv[1], "w") as f:
        f.write(" ".join(out) + "\n")


if __name__ == "__main__":
    main()
