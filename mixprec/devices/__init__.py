"""The hardware and the launch: the device, the CPU's features and threads (`hardware`, `threads`), several
processes, DeepSpeed and FSDP (`distributed`)."""
