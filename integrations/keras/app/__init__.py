"""The ``torus-train`` application: its command line (``cli``), trainer (``trainer``), input pipelines
(``data``, ``tfrecords``, ``digits``), atomic checkpoints (``checkpoint``) and the timeline breakdown tool
(``breakdown``).
"""
