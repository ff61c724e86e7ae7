"""The stages that make ``model.fit`` / ``evaluate`` / ``predict`` data-parallel under ``TorusStrategy``
(``fit_hook.PIPELINE`` lists them in order), and the coordinated saving and file callbacks they install.
"""
