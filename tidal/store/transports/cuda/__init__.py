"""CUDA IPC: stored versions in a writer's GPU memory, read by processes on the same host.

- ``ipc``: the transport (:class:`~tidal.store.transports.cuda.ipc.CudaIpcTransport`);
- ``memory``: the GPU memory behind the slots (a writer's device volume, a reader's opened
  ones);
- ``runtime``: the CUDA runtime calls, through ctypes;
- ``copies``: device-to-device copies of a state dict, planned once per layout;
- ``gather`` and ``batch``: one Triton kernel, or one driver call, for a plan's copies.

Every module imports on a machine without CUDA; the calls that need a GPU raise there.
"""
