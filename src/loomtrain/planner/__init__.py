"""Auto-parallel planner (issue #19): architectures, the cost model, cluster specs and the layout search.

``arch``: a model as data (:class:`~loomtrain.planner.arch.Architecture`), Llama-style or GPT-3-style.
``cost``: the one layer cost model (devices, GEMMs, attention), shared with ``--simulate.device``.
``memory``: bytes per device of a parallel layout (:class:`~loomtrain.planner.memory.Layout`).
``time``: seconds per training step on a :class:`~loomtrain.planner.time.Cluster`. ``published``:
Megatron-LM's Tables 1 and 2 beside the predictions. ``cluster``: TOML cluster specs. ``search`` and
``cli``: ``loomtrain plan``. Nothing here imports a model class. See docs/planner.md.
"""
