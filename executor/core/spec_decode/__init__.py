"""Speculative decoding: proposers of draft tokens, their verification by the target, and its stats."""
