"""Sweeps of any config field over a grid, each trial a full DiLoCo run, through Ray Tune
(see :mod:`diloco_ray.sweep.runner`)."""
