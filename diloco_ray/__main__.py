"""``python -m diloco_ray`` is the ``diloco-ray`` command."""

from diloco_ray.cli import main

raise SystemExit(main())
