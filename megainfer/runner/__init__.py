"""Running a scheduled step on the device: the colocated model runner, the sampler, memory profiling, kernel warm-up, energy."""
