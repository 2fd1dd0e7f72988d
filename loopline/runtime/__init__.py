"""The engine loop and its clients: what sits between one engine and the front ends.

``protocol`` (every command and message, PD's included; a request's outputs travel as the engine's
deltas, ``engine/deltas.py``: what it added since the last message), ``core`` (the loop that owns an
engine), ``client`` (reaching it on a thread or in a process of its own), ``heap`` (the startup heap kept out of
the cyclic garbage collector in a process that owns its engine). ``entrypoints/`` and ``distributed/`` import
this package; it imports neither.
"""
