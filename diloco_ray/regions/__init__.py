"""Runs across regions, both sides of the channel: the home's gateway to its regions
(:mod:`~diloco_ray.regions.gateway`) and the members that stand for them in its rounds
(:mod:`~diloco_ray.regions.members`), what crosses the channel for a sync
(:mod:`~diloco_ray.regions.wire`), and a region's side: the agent that ``diloco-ray region``
runs on the region's own Ray cluster (:mod:`~diloco_ray.regions.agent`), its replicas
(:mod:`~diloco_ray.regions.replicas`), its merge of their pseudo-gradients into one message
(:mod:`~diloco_ray.regions.merge`), its books (:mod:`~diloco_ray.regions.books`) and its
mailbox (:mod:`~diloco_ray.regions.mailbox`). Between the actors (:mod:`diloco_ray.runtime`)
and the driver, which runs the home's rounds through the gateway."""
