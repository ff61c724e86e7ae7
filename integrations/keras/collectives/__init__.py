"""All-reduce, broadcast and all-gather of TensorFlow tensors over a ``TorusComm``: custom training loops
(``loop``), gradient buckets overlapped with backprop (``buckets``), the shared-memory window (``window``),
sparse gradients (``sparse``), the global-gradient rule (``gradients``) and the timeline (``trace``).
"""
