"""Multi-turn rollouts: tools and environments that answer the model's turns.

A trajectory is generated token-in, token-out: the engine continues each trajectory from its
exact token ids, the model's tokens are never re-tokenized, and the environment's replies are
appended by rendering only the new messages with the chat template.
"""
