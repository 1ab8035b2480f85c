"""`beagle-pipeline regenerate`: the target answers the inputs' prompts itself (self-distillation data).

A drafter is judged on the target's own outputs. Training it on answers written by another model (the
ShareGPT crawl's ChatGPT) teaches it a distribution the target never produces; regenerating the answers
with the target, then extracting features from those conversations, trains it on exactly what it must
predict at decoding time.
"""
