"""Regions as Ray clusters of their own, joined by one channel: what crosses it for a sync
(:mod:`~diloco_ray.regions.wire`)."""
