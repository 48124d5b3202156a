"""entr_megatron: Megatron-scale asynchronous RL with entropy-normalized trust regions.

Layers (see docs/ARCHITECTURE.md; lower layers never import higher ones):
L0 config, types, utils; L1 algorithm, models; L2 parallel;
L3 learner, rollout, checkpoint; L4 weight_sync; L5 controller; L6 cli.
"""

__version__ = "0.1.0"
