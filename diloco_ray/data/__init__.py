"""Training data: where rows come from, how they become token samples, and which replica reads which.

Nothing here imports torch at module level, so the tokenising task starts fast.
"""
