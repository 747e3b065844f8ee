"""Auto-parallel planner (issue #19): architecture descriptions and the memory half of the cost model.

``arch``: a model as data (:class:`~loomtrain.planner.arch.Architecture`), Llama-style or
GPT-3-style, with its parameter count. ``memory``: bytes per device of a parallel layout
(:class:`~loomtrain.planner.memory.Layout`): model states by ZeRO stage, activations per layer and
pipeline micro-batches in flight. Nothing here imports a model class. See docs/planner.md.
"""
