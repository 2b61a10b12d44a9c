"""`megainfer profile`: operator times measured on this machine, written as an operator profile
(planner/operator_profile.py) for the step model.

timing          one call's median seconds (warm-up, blocks until a minimum time)
operator_grid   the problem sizes each operator is measured at, per device
operator_timing one timing function per operator, on megainfer's own modules
allreduce_timing  the tensor-parallel all-reduce across spawned ranks
device_info     device name, GPU-catalog name, peak GEMM and copy rates, KV-cache tokens
engine_overhead the real engine's per-step cost outside the operators
profile_run     the run end to end, its progress bar and summary table
"""
