"""How a controller talks to the replicas it runs, shared by the home's driver and a region's
agent: the Ray calls it makes (:mod:`~diloco_ray.control.calls`), collecting a sync period's
reports with its deadlines and stall checks (:mod:`~diloco_ray.control.poll`), the ranks'
step events (:mod:`~diloco_ray.control.step_feed`) and connecting to Ray
(:mod:`~diloco_ray.control.ray_connection`). What to do with what it collects is the
controller's own (:mod:`diloco_ray.driver`, :mod:`diloco_ray.regions`).
"""
