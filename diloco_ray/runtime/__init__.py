"""The Ray actors, kept thin: a rank, a replica (its placement group and ranks), a parameter server and its group.

They adapt :mod:`diloco_ray.algo` to Ray and speak the typed messages of :mod:`diloco_ray.runtime.messages`.
Nothing here decides what a run does next; that is :mod:`diloco_ray.driver`'s job.
"""
