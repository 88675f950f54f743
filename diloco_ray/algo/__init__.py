"""The math of DiLoCo, as plain functions and classes over tensors (no Ray, no files).

The outer step and its schedules, the codecs for what crosses a link, the partition of rows between
servers and ranks, a rank's side of the sync, the link simulator and the one optimizer lookup. Every
module here is unit-tested without Ray; the actors in :mod:`diloco_ray.runtime` only adapt it.
"""
