"""The run folder, the user's data: its checks and lock (`rundir`), the checkpoints in it (`checkpointing`),
what a resume may change (`resume`), a signal's checkpoint and exit (`preemption`), the folders a run reads and
never writes (`sources`), and a finished run's weights and settings for the tools (`run_loading`)."""
