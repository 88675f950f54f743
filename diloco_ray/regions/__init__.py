"""A region's side of a run across regions: the agent that ``diloco-ray region`` runs on the
region's own Ray cluster (:mod:`~diloco_ray.regions.agent`). The home's side is
:mod:`diloco_ray.driver.regions`; what crosses the channel for a sync is
:mod:`diloco_ray.runtime.region_wire`."""
