"""Speculative decoding with a Beagle drafter: draft trees, tree verification, acceptance, generation."""
from beagle.decoding.acceptance import Acceptance, greedy_accept, sample_accept
from beagle.decoding.generate import GenerationResult, SpeculativeSession, plain_generate, speculative_generate
from beagle.decoding.tree import DraftConfig, DraftTree, build_draft_tree

__all__ = [
    "Acceptance", "DraftConfig", "DraftTree", "GenerationResult", "build_draft_tree", "greedy_accept",
    "SpeculativeSession", "plain_generate", "sample_accept", "speculative_generate",
]
