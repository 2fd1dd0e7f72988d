"""Scale-out: data-parallel engine replicas behind one front end (``dp``, ``router``), their Ray
backend (``ray_backend``, imported only when asked for), and prefill/decode disaggregation.

See docs/serving.md, "Scale-out".
"""
