"""Speculative decoding: the decode loops, the draft tree, verification, draft/target state, proposers
(draft model, n-gram), the payback gate and acceptance replay."""
