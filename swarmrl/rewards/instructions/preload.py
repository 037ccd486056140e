"""Imported by a grading pool's processes before they grade instruction rows (the task type's
`preload` in swarmrl/rewards/registry.py), so that what the checkers load on first use is loaded
at start, not inside the first answer's grading budget.

langdetect's profiles, nltk's Punkt parameters and its Treebank tokenizer take ~0.5-0.9 s each to
load on this 2-core machine, ~1.9 s together, and more under load: past the default
`rewards.verify_timeout_s` of 1 s. A grading process that met its first lowercase or
sentence-count constraint cold would be killed for the time, and its replacement, as cold, would
be killed again, so every such row would score 0 in a run. Loaded here, a forkserver's children
inherit them and a spawned process loads them while it starts (not counted against any answer).
"""

from swarmrl.rewards.instructions import text

text.punkt_sentences("A first sentence. A second one.")
text.word_tokenize("Some words, and more.")
text.detect_language("This is a short English sentence about the weather.")
