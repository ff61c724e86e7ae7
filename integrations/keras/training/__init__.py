"""Training aids for large batches: LARS (``lars``), batch-size control and its learning-rate rule
(``schedule``), and the callback that applies both (``callbacks``).
"""
