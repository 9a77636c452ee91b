"""Scale-out: many chatserve replicas behind one address (Ray Serve), with conversation affinity.

affinity.py (which replica a request goes to; pure Python, no Ray), metrics_merge.py (every
replica's /metrics in one page, with a replica label), ray_serve.py (the Ray Serve deployment,
request router and `chatserve serve --replicas N`; imports ray lazily).
"""
