"""Job assembly: what `train`, `sft` and `eval` start from (`model_init`), the processes of a run
and how they connect (`wiring`, the SGLang servers), the warm-up, the run directory and the
side effects of a run (metrics, checkpoints, held-out evaluations); `run` holds the jobs."""
