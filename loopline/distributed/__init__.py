"""Scale-out: data-parallel engine replicas behind one front end (``dp``, ``router``), their Ray
backend (``ray_backend``, imported only when asked for), prefill/decode disaggregation (``pd``),
and ``launch.make_client``, which picks among them for a set of engine arguments.

See docs/serving.md, "Scale-out".
"""
