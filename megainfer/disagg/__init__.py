"""The disaggregated runtime, Ray-free: an attention node's pipelined runner and an expert
node's worker, talking through an `ExpertLink` that deploy/ binds to the M2N transport."""
