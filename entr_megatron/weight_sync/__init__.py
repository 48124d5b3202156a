"""L4: bucketed, versioned, asynchronous weight broadcasts from the learner to the rollout engines.

    # every learner rank
    groups = stage_groups(master_address, base_port, pp_size=pg.pp_size, engine_ranks=(1,) * num_engines)
    transport = BucketTransport(groups[pg.pp_rank]) if is_weight_sender(pg) else None
    sync = WeightSync.for_learner(chunks, spec, pg, transport)
    handle = sync.push(version)        # blocks for the snapshot only
    ...                                # next training step; the broadcast runs meanwhile
    handle.wait().transfer_s

    # whoever holds engine i
    engine.update_weights(receiver_for(groups, i), version)     # stages, then swaps between two steps

Modules: `group.py` the broadcast group (TCP rendezvous, gloo / NCCL, independent of
the learner's default group), `buckets.py` our bucket headers over the shared flat
layout (`utils.buckets`, SGLang's flattened_bucket), `protocol.py` the messages of one
version, `snapshot.py` the learner's bounded snapshot buffers, `sync.py` `WeightSync`
(learner side), `transports.py` the transport protocol and ours, `sglang_transports.py` the
SGLang adapter (SGLang's weight-update handshake, `SGLangWeightUpdate`, and its shared-memory
form for servers on the learner's host, `SGLangTensorUpdate`), `receiver.py` the engine side, `colocated.py`
the same protocol with each bucket copied into a colocated engine's shared staging copy.
"""

from entr_megatron.weight_sync.buckets import BucketLayout, plan_buckets
from entr_megatron.weight_sync.colocated import ColocatedReceiver, ColocatedTransport
from entr_megatron.weight_sync.group import BroadcastGroup, WeightGroup, default_backend, stage_groups
from entr_megatron.weight_sync.receiver import BroadcastReceiver, leave_all_groups, receiver_for
from entr_megatron.weight_sync.sync import PushHandle, PushReport, WeightSync, WeightSyncConfig, is_weight_sender
from entr_megatron.weight_sync.sglang_transports import (
    SGLangTensorTransport,
    SGLangTensorUpdate,
    SGLangTransport,
    SGLangWeightUpdate,
)
from entr_megatron.weight_sync.transports import BucketTransport, Transport, WeightSyncError

__all__ = [
    "BroadcastGroup",
    "BroadcastReceiver",
    "BucketLayout",
    "BucketTransport",
    "ColocatedReceiver",
    "ColocatedTransport",
    "PushHandle",
    "PushReport",
    "SGLangTensorTransport",
    "SGLangTensorUpdate",
    "SGLangTransport",
    "SGLangWeightUpdate",
    "Transport",
    "WeightGroup",
    "WeightSync",
    "WeightSyncConfig",
    "WeightSyncError",
    "default_backend",
    "is_weight_sender",
    "leave_all_groups",
    "plan_buckets",
    "receiver_for",
    "stage_groups",
]
