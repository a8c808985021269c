"""Devices: what each device can run, and the device-side pieces a rewrite or a step uses.

Takes a device (``"cpu"``, ``"cuda"``, ``"npu"``); gives its backend with the fused replacements
it offers (:mod:`~rewriter.devices.backends`, gated on the chip and torch_npu release by
:mod:`~rewriter.devices.npu_capabilities`), its graph compilers as candidates
(:mod:`~rewriter.devices.executors`) and their persistent caches
(:mod:`~rewriter.devices.compile_cache`), mixed precision (:mod:`~rewriter.devices.amp`), fused
optimizers (:mod:`~rewriter.devices.optimizers`), host settings (:mod:`~rewriter.devices.host`),
the CPU it runs on (:mod:`~rewriter.devices.cpu_identity`), one plan for every rank
(:mod:`~rewriter.devices.distributed`) and, for a model already sharded by FSDP2, its parameters
gathered while deciding (:mod:`~rewriter.devices.gathered`).
"""
