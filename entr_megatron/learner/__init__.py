"""L3: the Megatron-core learner (learner issue): model build, forward-backward with the RL loss, optimizer (checkpoints: ``entr_megatron.checkpoint``)."""
