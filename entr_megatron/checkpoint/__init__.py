"""L3: learner checkpoints: what they hold, their atomic directory layout, save/load with resharding.

=============  ==========================================================================
``io``         ``save_checkpoint`` / ``load_checkpoint``: all ranks, rank-0 file decisions
``state``      what a checkpoint holds (model, optimizer, scheduler, RNG, step, extra state)
``directory``  the on-disk layout: ``iter_<step>/``, ``latest``, atomic renames, ``keep_last``
``validate``   whether a checkpoint loads as asked: format, held state, keys and shapes
``compat``     fixes for megatron-core 0.16.1's distributed optimizer with torch Adam
``manifest``   every file's size and SHA-256; choosing the newest good checkpoint
=============  ==========================================================================

For ``entr-megatron convert`` (one process, no model built, one tensor in memory at a time):

================  =======================================================================
``dist_layout``   where each Megatron parameter lives in a dist checkpoint (keys, layer/expert axes)
``dist_reader``   read a torch_dist checkpoint slice by slice, from any saving layout
``dist_writer``   write a torch_dist checkpoint from tensors made one at a time
``dist_convert``  HF safetensors <-> dist checkpoint, streamed, strict; the progress bar
``hf_dir``        a learner checkpoint as a whole HF directory (source, step, config, assets)
``hf_files``      safetensors headers checked, tensors read, shards streamed, staged outputs
``convert``       config comparison, verify math, ``conversion.json``
================  =======================================================================

Importing this package imports nothing heavy: ``directory`` needs neither megatron
nor torch.distributed (the CLI reads a checkpoint root with it before any rank starts).
"""
