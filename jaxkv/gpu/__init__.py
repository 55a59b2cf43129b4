"""Compiling for a GPU on a machine without one, and reading the compiled HLO.

aot    compile a jitted function for an H200 / GH200 target on the CPU (CUDA plugin)
hlo    count what the optimized program does per call (ops, transfers, host syncs)
specs  the shipped GPU target specs (GpuTargetConfigProto text)
"""
