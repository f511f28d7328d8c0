"""Checkpoints without models: the canonical format (``format``: single-process tensor names
whatever the layout, per-tensor layouts in each safetensors header, JSON metadata), the store
(``store``: naming, atomic publication, ``latest``, reading back), the background writer
(``async_writer``) and resharding to another layout (``reshard``).

Nothing here imports model, family or config code: a checkpoint is read, reassembled and
resharded from its files alone. training/checkpointer.py is where these meet a run.
"""
