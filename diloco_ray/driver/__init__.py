"""The driver: the trainer that owns the servers and replicas, the round loop, and the policies that decide.

Policies (membership, the outcome of a round, when to checkpoint, when to stop) are pure functions that
return decisions; the round loop acts on them. The loop talks to the actors only through the handles it
is given, so tests can run it with fakes and no Ray.
"""
