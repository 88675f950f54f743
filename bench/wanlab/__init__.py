"""The WAN lab behind ``bench/wan.py``: regions on one machine, joined by real rate-limited
links, and what crossed them.

* :mod:`wanlab.netns`: namespaces, their shaped veth links, and the discipline that tears
  everything down on any exit (shared by both layouts);
* :mod:`wanlab.bridge`: the flat layout, one Ray cluster over namespaces on one bridge;
* :mod:`wanlab.router`: the regions layout, a private Ray cluster per namespace, joined only
  by a delaying relay (:mod:`wanlab.relay`) on the channel's port in a router namespace;
* :mod:`wanlab.capture`: every frame on a link, sorted (payload, acknowledgements, service);
* :mod:`wanlab.runs`: one flat job and its row (wire bytes beside reported bytes);
* :mod:`wanlab.rehearsal`, :mod:`wanlab.layouts`, :mod:`wanlab.outage`: ``--regions N``, its
  runs in both layouts, the rows, equivalence and the outage of one region's link.
"""
