#!/usr/bin/env python3
"""Writes the sentence data that the translator and the classifier examples
train on, generated here (nothing is downloaded):

  dsl-examples/data/pairs-en-de.tsv       English<TAB>German sentence pairs
  dsl-examples/data/sentiment.tsv         sentence<TAB>label (1 liked, 0 not)
  dsl-examples/data/tokenizer-sentences.json
      a byte-level BPE of 1000 tokens trained on both files, with <pad> (0),
      <s>, </s>, [CLS] and [SEP]; a sentence alone encodes as [CLS] ... [SEP]

The German follows its grammar for what the sentences use: gender and case
of articles and adjectives (nominative subject, accusative object, dative
after "in" with im for in dem), verb-second order after "yesterday", and
"nicht" after a definite object. The sentiment labels follow negation
("was not good") and "but" (the second clause decides).

    python3 tools/make_sentence_data.py          # needs `pip install tokenizers`
"""
import os
import random

OUT = os.path.join(os.path.dirname(__file__), "..", "dsl-examples", "data")

NOUNS = {  # english: (german, gender)
    "dog": ("Hund", "m"), "cat": ("Katze", "f"), "child": ("Kind", "n"), "man": ("Mann", "m"),
    "woman": ("Frau", "f"), "teacher": ("Lehrer", "m"), "bird": ("Vogel", "m"),
    "girl": ("Mädchen", "n"), "boy": ("Junge", "m"), "doctor": ("Ärztin", "f"),
}
THINGS = {
    "ball": ("Ball", "m"), "book": ("Buch", "n"), "car": ("Auto", "n"), "apple": ("Apfel", "m"),
    "letter": ("Brief", "m"), "flower": ("Blume", "f"), "table": ("Tisch", "m"),
    "door": ("Tür", "f"), "window": ("Fenster", "n"), "bag": ("Tasche", "f"),
    "hat": ("Hut", "m"), "picture": ("Bild", "n"), "cup": ("Tasse", "f"), "chair": ("Stuhl", "m"),
}
PLACES = {"garden": ("Garten", "m"), "house": ("Haus", "n"), "city": ("Stadt", "f"),
          "kitchen": ("Küche", "f"), "park": ("Park", "m"), "school": ("Schule", "f")}
ADJ = {"small": "klein", "big": "groß", "red": "rot", "old": "alt", "new": "neu",
       "green": "grün", "young": "jung", "blue": "blau", "beautiful": "schön"}
VERBS = {  # english present, english past: german present, german past
    "sees": ("saw", "sieht", "sah"), "has": ("had", "hat", "hatte"),
    "likes": ("liked", "mag", "mochte"), "finds": ("found", "findet", "fand"),
    "buys": ("bought", "kauft", "kaufte"), "takes": ("took", "nimmt", "nahm"),
    "paints": ("painted", "malt", "malte"), "carries": ("carried", "trägt", "trug"),
    "opens": ("opened", "öffnet", "öffnete"), "wants": ("wanted", "will", "wollte"),
}
NEG_BASE = {"sees": "see", "has": "have", "likes": "like", "finds": "find", "buys": "buy",
            "takes": "take", "paints": "paint", "carries": "carry", "opens": "open", "wants": "want"}

DEF = {"nom": {"m": "der", "f": "die", "n": "das"}, "acc": {"m": "den", "f": "die", "n": "das"},
       "dat": {"m": "dem", "f": "der", "n": "dem"}}
INDEF = {"nom": {"m": "ein", "f": "eine", "n": "ein"}, "acc": {"m": "einen", "f": "eine", "n": "ein"}}
# Adjective endings after the definite (weak) and the indefinite (mixed) article.
WEAK = {"nom": {"m": "e", "f": "e", "n": "e"}, "acc": {"m": "en", "f": "e", "n": "e"}}
MIXED = {"nom": {"m": "er", "f": "e", "n": "es"}, "acc": {"m": "en", "f": "e", "n": "es"}}


def phrase(rng, table, case, definite=None):
    en, (de, g) = rng.choice(sorted(table.items()))
    definite = rng.random() < 0.6 if definite is None else definite
    adj = rng.choice(sorted(ADJ)) if rng.random() < 0.5 else None
    e = ["the" if definite else ("an" if (adj or en)[0] in "aeiou" else "a")]
    d = [DEF[case][g] if definite else INDEF[case][g]]
    if adj:
        e.append(adj)
        d.append(ADJ[adj] + (WEAK if definite else MIXED)[case][g])
    e.append(en)
    d.append(de)
    return e, d


def pair(rng):
    subj_e, subj_d = phrase(rng, NOUNS, "nom")
    verb = rng.choice(sorted(VERBS))
    past, v_de, v_de_past = VERBS[verb]
    when = rng.random() < 0.3
    negate = not when and rng.random() < 0.25
    obj_e, obj_d = phrase(rng, THINGS, "acc", definite=True if negate else None)
    place = rng.random() < 0.35
    if negate:
        e = subj_e + ["does", "not", NEG_BASE[verb]] + obj_e
        d = subj_d + [v_de] + obj_d + ["nicht"]
    elif when:
        e = ["yesterday"] + subj_e + [past] + obj_e
        d = ["gestern", v_de_past] + subj_d + obj_d
    else:
        e = subj_e + [verb] + obj_e
        d = subj_d + [v_de] + obj_d
    if place:
        p_en, (p_de, g) = rng.choice(sorted(PLACES.items()))
        e += ["in", "the", p_en]
        d += (["im"] if g in "mn" else ["in", "der"]) + [p_de]
    e, d = " ".join(e), " ".join(d)
    return e[0].upper() + e[1:] + ".", d[0].upper() + d[1:] + "."


GOOD = ["good", "great", "wonderful", "lovely", "excellent", "funny", "moving", "delicious", "fresh"]
BAD = ["bad", "awful", "boring", "dull", "terrible", "cold", "bland", "slow", "weak"]
TOPICS = ["the film", "the soup", "the music", "the story", "the acting", "the ending", "the bread",
          "the service", "the book", "the concert", "the coffee", "the play", "the room", "the game"]
INTENS = ["", "", "very ", "really ", "quite ", "truly "]


def clause(rng):
    good = rng.random() < 0.5
    neg = rng.random() < 0.3
    word = rng.choice(GOOD if good else BAD)
    verb = rng.choice(["was", "is", "seemed"])
    topic = rng.choice(TOPICS)
    if neg:
        text = f"{topic} {verb} not {word}" if verb != "seemed" else f"{topic} did not seem {word}"
    else:
        text = f"{topic} {verb} {rng.choice(INTENS)}{word}"
    return text, int(good != neg)


def sentiment(rng):
    text, label = clause(rng)
    if rng.random() < 0.3:
        second, label = clause(rng)
        text = f"{text} but {second}"
    elif rng.random() < 0.2:
        text = rng.choice(["i think ", "honestly, ", "to be fair, ", "overall "]) + text
    return text[0].upper() + text[1:] + ".", label


def main():
    rng = random.Random(20261128)
    pairs = sorted({pair(rng) for _ in range(6000)})
    rng.shuffle(pairs)
    pairs = pairs[:4000]
    labelled = sorted({sentiment(rng) for _ in range(5000)})
    rng.shuffle(labelled)
    labelled = labelled[:3000]
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "pairs-en-de.tsv"), "w", encoding="utf-8") as f:
        f.writelines(f"{e}\t{d}\n" for e, d in pairs)
    with open(os.path.join(OUT, "sentiment.tsv"), "w", encoding="utf-8") as f:
        f.writelines(f"{t}\t{y}\n" for t, y in labelled)

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "[CLS]", "[SEP]"]
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [s for p in pairs for s in p] + [t for t, _ in labelled]
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    tok.save(os.path.join(OUT, "tokenizer-sentences.json"))
    print(f"{len(pairs)} pairs, {len(labelled)} labelled sentences, vocabulary {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
