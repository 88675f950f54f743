"""Ray actor classes and remote functions, made once per target and options for the life of
the process.

``ray.remote(cls)`` makes a new actor class at every call, and Ray exports each new one to
the cluster before its first actor starts: it pickles the class and disassembles its code
to check for name collisions (~60 ms here, on the driver, before the actor can be placed).
A trainer made one per replica, one for its servers and one for its step board, and a
replacement replica, a re-placed server or a second trainer in the same process made them
all again. The class stays a parameter at every call site (tests pass fakes and
subclasses), so the cache is keyed by the class itself.
"""

from __future__ import annotations

import threading

import ray

_made: dict = {}
_lock = threading.Lock()


def remote(target, **options):
    """``ray.remote(**options)(target)`` for a class or a function, the same object for the
    same target and options.

    Options that vary per call (placement, resources, a node) belong in ``.options()`` on
    the result: each distinct value here would make, and export, a class of its own."""
    key = (target, repr(sorted(options.items())))
    with _lock:
        if key not in _made:
            _made[key] = ray.remote(**options)(target) if options else ray.remote(target)
        return _made[key]
