"""L3: learner checkpoints: what they hold, their atomic directory layout, save/load with resharding.

=============  ==========================================================================
``io``         ``save_checkpoint`` / ``load_checkpoint``: all ranks, rank-0 file decisions
``state``      what a checkpoint holds (model, optimizer, scheduler, RNG, step, extra state)
``directory``  the on-disk layout: ``iter_<step>/``, ``latest``, atomic renames, ``keep_last``
``validate``   whether a checkpoint loads as asked: format, held state, keys and shapes
``compat``     fixes for megatron-core 0.16.1's distributed optimizer with torch Adam
=============  ==========================================================================

Importing this package imports nothing heavy: ``directory`` needs neither megatron
nor torch.distributed (the CLI reads a checkpoint root with it before any rank starts).
"""
