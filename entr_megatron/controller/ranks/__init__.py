"""Learner-rank plumbing: one `LearnerWorker` per rank, the worker groups that run them (local
processes or Ray actors), the controller's `Learner`/`WeightPusher` over them (`remote`), and an
embedded engine placed by Ray."""
