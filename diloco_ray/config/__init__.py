"""What a job is: the field table, its validation, the validated config, the typed sections
each part receives, the fault plan, and the generated field docs.

The modules import one way: ``validation`` and ``sections`` read the table in ``fields``
(where each field is declared once, with the sections that carry it), and ``schema`` builds
on all three. Nothing here imports another subpackage: a config loads and validates without
torch or Ray.

``from diloco_ray.config import TrainerConfig`` is the public path (docs/interface.md).
"""

from diloco_ray.config.schema import TrainerConfig
from diloco_ray.config.sections import Sections

__all__ = ["Sections", "TrainerConfig"]
