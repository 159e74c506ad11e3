"""The hardware and the launch: the device, the CPU's features and threads (`hardware`, `threads`), several
processes, DeepSpeed and FSDP (`distributed`), and the model under Accelerate's wrappers (`unwrap`)."""
