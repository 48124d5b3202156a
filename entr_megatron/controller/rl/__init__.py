"""The RL loop: one controller loop, four modes, a hard policy-lag bound, and what it holds
(the staleness buffer, the in-flight groups, fixed_lag's schedule, the engine set) and needs
(`interfaces`: the learner and the weight transport, injected)."""
