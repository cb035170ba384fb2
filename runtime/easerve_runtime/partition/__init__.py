"""The SM-partition shell: shared-memory control record, backends, NVML signal, controller, profiler.

The decisions themselves live in :mod:`easerve_runtime.policies.partition` (pure); this package
is the I/O around them. Nothing here imports torch at module import time.
"""
