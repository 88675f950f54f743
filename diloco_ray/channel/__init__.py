"""The channel between regions: one authenticated TLS port at the home, dialled out by the
regions (:mod:`~diloco_ray.channel.server`, :mod:`~diloco_ray.channel.client`), every message
one checked frame (:mod:`~diloco_ray.channel.frames`), its token read from where the user
keeps it (:mod:`~diloco_ray.channel.credentials`)."""
